"""Deploy the fork into an existing vllm-ascend, verify it by content hash, and revert it.

  deploy --to PATH       apply the series for the vllm-ascend version found at PATH
  deploy --verify PATH   a per-file table: every file the series touches has the fork's content
  deploy --revert PATH   undo `deploy --to PATH`, byte for byte

PATH is one of:
  - an upstream git checkout (clean): the series (with the per-base variants of its version) is
    applied with `git am -3`, one commit per patch; the HEAD before is kept in
    .git/fork-deploy.json, and --revert resets to it;
  - an installed `vllm_ascend` package directory (site-packages, from a wheel; or the source tree
    of an editable install; site-packages itself is accepted too): only the hunks under
    vllm_ascend/ are applied (tests and docs are skipped), with `git apply`, after every file the
    series touches was compared with the base release's own file (the sha256-checked sdist).
    The original bytes of every file changed are kept in <dir of the package>/vllm_ascend-fork-deploy/
    (outside the package), and the dist-info RECORD lists the fork's files and that backup, so
    `pip uninstall vllm-ascend` removes them too.
Refused with the reason, and nothing changed: a version that is not a base in fork.toml, a tree that
is already patched, a file that differs from upstream, a dirty checkout, a revert with no backup.
The expected content comes from the fork materialized on that base in build/deploy/<version>.
"""

from __future__ import annotations

from pathlib import Path
from shlex import quote

from tools.fork.core import lock, upstream
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import EXIT_FAILED, EXIT_OK, BadInput, ForkError
from tools.fork.deploy import journal
from tools.fork.deploy.checkout import deploy_checkout, recover_checkout, revert_checkout
from tools.fork.deploy.expected import PACKAGE, expected
from tools.fork.deploy.package import (
    Row,
    deploy_package,
    package_changes,
    record_problems,
    recover,
    revert_package,
    verify_rows,
)
from tools.fork.deploy.target import (
    CHECKOUT_STATE,
    Target,
    base_version,
    find_target,
    load_json,
    refuse_if_deployed,
)

HELP = __doc__


def _target_path(text: str) -> Path:
    if not text.strip():  # e.g. "$PKG" when the command that should have found the package failed
        raise BadInput("the PATH given to --to/--verify/--revert is empty: nothing to deploy into")
    return Path(text)


def add_arguments(p) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--to", type=_target_path, metavar="PATH", help="deploy the series into PATH")
    what.add_argument(
        "--verify", type=_target_path, metavar="PATH", help="check PATH has the fork's content; exit 1 if not"
    )
    what.add_argument("--revert", type=_target_path, metavar="PATH", help="restore what `deploy --to PATH` changed")
    p.add_argument(
        "--base",
        metavar="VERSION",
        help="the vllm-ascend version at PATH, when it cannot be read there (checked if it can)",
    )
    p.add_argument(
        "--sdist", type=Path, metavar="PATH", help="the base's sdist (sha256-checked) instead of cache/registry"
    )
    p.add_argument("--force", action="store_true", help="--revert: restore even files edited after the deploy")


def _short(digest: str | None) -> str:
    return "(absent)" if digest is None else digest[:16]


def print_table(rows: list[Row]) -> None:
    width = max([len(r.path) for r in rows] + [4])
    print(f"  {'path':<{width}}  {'expected (fork)':<16}  {'actual':<16}  result")
    for r in rows:
        print(f"  {r.path:<{width}}  {_short(r.expected):<16}  {_short(r.actual):<16}  {'ok' if r.ok else 'MISMATCH'}")


def verify(cfg: ForkConfig, target: Target, version: str, *, sdist: Path | None = None) -> bool:
    scope = PACKAGE if target.kind == "package" else None
    exp = expected(cfg, version, sdist=sdist, scope=scope)
    if target.kind == "package":
        exp = package_changes(target, exp)
    rows = verify_rows(target, exp)
    where = f"{len(rows)} file(s) the series touches" + (f" under {PACKAGE}/" if scope else "")
    print(f"fork deploy --verify: {target.root if target.kind == 'checkout' else target.package}")
    print(
        f"  vllm-ascend {version} ({target.version_from}), {len(exp.patches)} patch(es), {where}; "
        "sha256, first 16 hex digits"
    )
    if not rows:
        print("  the series touches no file here: nothing to verify")
        return False
    print_table(rows)
    bad = [r for r in rows if not r.ok]
    rec = record_problems(target, exp) if target.kind == "package" else []
    if target.kind == "package" and target.dist_info is not None:
        status = "ok" if not rec else "MISMATCH"
        print(f"  {target.dist_info.name}/RECORD lists the fork's files (pip uninstall removes them): {status}")
        for p in rec:
            print(f"    - {p}")
    deployed = target.backup.exists() if target.kind == "package" else (target.root / ".git" / CHECKOUT_STATE).exists()
    ok = not bad and not rec
    if deployed:
        how = "deployed in place (`deploy --revert` undoes it)"
    else:
        how = "no deploy record (the fork's own build?)" if ok else "not deployed"
    verdict = (
        f"{len(rows)}/{len(rows)} files match the fork"
        if ok
        else f"{len(bad)} of {len(rows)} files differ from the fork"
    )
    print(f"fork deploy --verify: {'OK' if ok else 'FAILED'}: {verdict}; {how}")
    return ok


def run(args, cfg) -> int:
    path = args.to or args.verify or args.revert
    upstream.check_named_sdist(args.sdist)
    target = find_target(path)
    for note in target.notes:
        print(f"fork deploy: note: {note}")
    # One writer per target: the lock is the installed vllm_ascend/ directory itself (lock.py), so no
    # lock file is left in site-packages and a killed holder's lock goes with it.
    with lock.exclusive(target.package, f"{target.package}"):
        return _run_locked(args, cfg, target)


def _run_locked(args, cfg, target: Target) -> int:
    verb = "--revert" if args.revert else "--verify" if args.verify else ""
    if target.kind == "package" and args.verify:
        st = journal.state(journal.Dirs(target.backup))
        if st not in ("clean", "deployed"):
            raise ForkError(journal.interrupted_message(journal.Dirs(target.backup), target.package, st))
    if target.kind == "checkout" and args.verify:
        state = load_json(target.root / ".git" / CHECKOUT_STATE)
        if state is not None and not state.get("post_head"):
            root = quote(str(target.root))
            raise ForkError(
                f"a deploy into {root} was interrupted; `deploy --revert {root}` rolls it back, "
                f"`deploy --to {root}` rolls it back and deploys"
            )
    finished = None
    if not args.verify:
        finished = recover(target) if target.kind == "package" else recover_checkout(target)
        if finished:
            print(f"fork deploy{' ' + verb if verb else ''}: {finished}")
    if args.revert:
        done = (
            revert_checkout(target, force=args.force, recovered=bool(finished))
            if target.kind == "checkout"
            else revert_package(target, force=args.force, recovered=bool(finished))
        )
        for line in done:
            print(f"fork deploy --revert: {line}")
        print(f"fork deploy --revert: {target.root if target.kind == 'checkout' else target.package}: reverted")
        return EXIT_OK
    if args.to:
        refuse_if_deployed(target)
    version = base_version(cfg, target, args.base, fork_build_ok=bool(args.verify))
    if args.sdist is not None:  # a named sdist is verified even when an earlier deploy's tree makes it unneeded
        upstream.obtain(cfg, version, sdist=args.sdist)
    if args.verify:
        return EXIT_OK if verify(cfg, target, version, sdist=args.sdist) else EXIT_FAILED
    if target.kind == "checkout":
        applied = deploy_checkout(cfg, target, version)
        for name in applied:
            print(f"fork deploy: applied {name}")
        print(
            f"fork deploy: {target.root}: vllm-ascend {version} ({target.version_from}) "
            f"+ {len(applied)} commit(s) (git am -3)"
        )
        print(f"fork deploy: undo with `python -m tools.fork deploy --revert {quote(str(target.root))}`")
        return EXIT_OK
    done = deploy_package(cfg, target, version, sdist=args.sdist)
    for line in done:
        print(f"fork deploy: {line}")
    print(
        f"fork deploy: {target.package}: vllm-ascend {version} ({target.version_from}) patched in place, "
        f"{len(done)} file(s); backup in {target.backup}"
        + (f"; {target.dist_info.name}/RECORD updated" if target.dist_info else "")
    )
    pkg = quote(str(target.package))
    print(f"fork deploy: check with `deploy --verify {pkg}`, undo with `deploy --revert {pkg}`")
    return EXIT_OK
