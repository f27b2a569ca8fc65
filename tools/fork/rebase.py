"""Move the series onto another vllm-ascend release: `rebase --onto VERSION`.

VERSION is a release on the package registry (downloaded with pip, sha256-checked against
fork.toml; a version fork.toml does not list yet is trusted on first use and its sha256 recorded
on success), or comes from a local sdist (--sdist PATH) or an upstream checkout (--checkout DIR,
for bases fork.toml already lists).

Each patch is applied with `git am`; if that fails, with `git am -3`. Per patch it reports:
  applied cleanly            plain `git am` (line offsets are named)
  applied with 3-way merge   `git am -3` (an upstream rename it followed is named)
  partially upstream         `git am -3` left out some of the patch's changes: the files named
                             already have them (with patch-id evidence where upstream's own diff
                             over that file is the same change)
  already upstream (dropped) nothing was left to apply; evidence: upstream's own diff between the
                             two releases over the patch's files has the same `git patch-id`, or
                             "applying it changes nothing"
  CONFLICT                   the rebase stops (exit 3) with the patch, files and hunks named and
                             the tree left ready to resolve: edit, `git add`, then
                             `python -m tools.fork rebase --continue` (or `--abort`)
The work lives in build/rebase/ (tree + state.json). patches/, patches/series, fork.toml and the
overlay are rewritten only when the rebase completes, all at once; `--abort`, a failure or an
interruption leave them byte-identical. On success the new pin is VERSION; the old pin stays in
the support matrix (unless --drop-old-base) and every patch whose old-pin version differs from its
new version (`git patch-id --stable`) is kept as the old pin's variant
(patches/bases/<old>/<name>); VERSION's own variants become the main series. Finally it prints
`git range-diff` of the old series against the new one and a per-patch table.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.fork import config, export, git, materialize, overlay, series, upstream
from tools.fork.check import _hunk_positions, run_fork_tests
from tools.fork.config import OVERLAY_ROOTS, VERSION_RE, Base, ForkConfig
from tools.fork.errors import EXIT_CONFLICT, EXIT_FAILED, BadInput, ForkError, InProgress, LocalEdits
from tools.fork.materialize import ApplyFailed, base_tag
from tools.fork.txn import StagedWrite, _signals_deferred

HELP = __doc__

OLD_REF = "refs/rebase/old"  # the old series, fetched into the rebase tree for range-diff and evidence

APPLIED_CLEANLY = "applied cleanly"
APPLIED_3WAY = "applied with 3-way merge"
PARTIALLY_UPSTREAM = "partially upstream"
ALREADY_UPSTREAM = "already upstream (dropped)"
RESOLVED = "conflict resolved"
RESOLVED_EMPTY = "dropped: resolved to nothing"
NOT_APPLIED = "not applied on this base"


def add_arguments(p) -> None:
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--onto", metavar="VERSION", help="the release to move the series onto")
    mode.add_argument("--continue", dest="cont", action="store_true", help="resume after resolving a conflict")
    mode.add_argument("--abort", action="store_true", help="discard the rebase in progress (build/rebase)")
    from tools.fork.cli import add_source_arguments

    add_source_arguments(p)
    p.add_argument(
        "--drop-old-base",
        action="store_true",
        help="remove the old pin from the support matrix (default: keep it, with variants where needed)",
    )
    p.add_argument("--test", action="store_true", help="after success, run the fork's tests on the new pin")
    p.add_argument(
        "--no-test",
        action="store_true",
        default=os.environ.get("FORK_REBASE_NO_TEST") == "1",
        help="do not run the tests before writing (the report then says the rebase is UNTESTED; "
        "default on when FORK_REBASE_NO_TEST=1)",
    )
    p.add_argument(
        "--series-tests-only",
        action="store_true",
        help="before writing, run only the series' own tests, not upstream's CPU suite (the report says so)",
    )
    p.add_argument(
        "--test-python",
        metavar="PY",
        default=os.environ.get("FORK_TEST_PYTHON") or None,
        help="run the tests with this Python (tree on PYTHONPATH, nothing installed) instead of the "
        "release's own test environment (default: $FORK_TEST_PYTHON)",
    )


# --- state ------------------------------------------------------------------------------------


@dataclass
class Item:
    name: str  # the patch's name in patches/series
    file: str | None  # its copy under build/rebase/queue/ applied on the new base; None: not applied there
    origin: str  # where it came from, for the report ("patches/NAME", "patches/bases/V/NAME", ...)


@dataclass
class Result:
    name: str
    outcome: str
    evidence: list[str] = field(default_factory=list)
    applied: bool = False  # a commit in the rebased tree stands for it


@dataclass
class State:
    onto: str
    onto_sha256: str
    first_use: bool  # VERSION was not in fork.toml: its sha256 is trusted on first use
    old_pin: str
    drop_old_base: bool
    test: bool
    digest: str  # of the protected files when the rebase started
    items: list[Item]
    index: int = 0  # the patch being (or next to be) applied
    head: str = ""  # HEAD after the last finished patch
    stopped: bool = False  # stopped at a conflict on items[index]
    phase: str = "apply"  # apply -> write -> written
    new_digest: str = ""  # of the protected files as the rebase writes them
    results: list[Result] = field(default_factory=list)
    # the tests before the write (rebase_test): off with --no-test
    no_test: bool = False
    series_only: bool = False
    test_python: str = ""
    source_sdist: str = ""
    source_checkout: str = ""
    tested: list[str] = field(default_factory=list)  # the test report's summary ("UNTESTED" with --no-test)
    test_failures: list[dict] = field(default_factory=list)  # set while stopped at failing tests
    tried: dict[str, list[str]] = field(default_factory=dict)  # patch -> variant origins tried
    chosen: dict[str, str] = field(default_factory=dict)  # patch -> why the tests chose its variant
    conflict_files: list[str] = field(default_factory=list)  # files that conflicted in the stopped patch

    @staticmethod
    def load(work: Path) -> State:
        try:
            data = json.loads((work / "state.json").read_text())
            data["items"] = [Item(**i) for i in data["items"]]
            data["results"] = [Result(**r) for r in data["results"]]
            return State(**data)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise InProgress(
                f"{work} exists but its state is unreadable ({exc}); a rebase was cut short. "
                "Discard it with `python -m tools.fork rebase --abort`."
            ) from None

    def save(self, work: Path) -> None:
        tmp = work / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, work / "state.json")


def workdir(cfg: ForkConfig) -> Path:
    return cfg.build_dir / "rebase"


def protected_paths(cfg: ForkConfig) -> list[Path]:
    return [cfg.patches_dir, cfg.toml_path, *(cfg.root / r for r in OVERLAY_ROOTS)]


def _protected_files(cfg: ForkConfig) -> dict[str, bytes]:
    snap = {}
    for root in protected_paths(cfg):
        if root.is_file():
            snap[root.relative_to(cfg.root).as_posix()] = root.read_bytes()
        elif root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
                    snap[p.relative_to(cfg.root).as_posix()] = p.read_bytes()
    return snap


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest())
    return h.hexdigest()


# --- the verb ---------------------------------------------------------------------------------


def run(args, cfg: ForkConfig) -> int:
    with _sigterm_as_interrupt():
        if args.abort:
            return abort(cfg)
        if args.cont:
            return resume(cfg, test=args.test, no_test=args.no_test)
        return start(cfg, args)


@contextmanager
def _sigterm_as_interrupt():
    """SIGTERM unwinds like Ctrl-C, so the cleanup below runs for both."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _failure(exc: BaseException, what_now: str) -> ForkError:
    if isinstance(exc, KeyboardInterrupt):
        cause = "interrupted (SIGINT/SIGTERM)"
        code = EXIT_FAILED
    elif isinstance(exc, ForkError):
        cause, code = str(exc), exc.exit_code
    elif isinstance(exc, OSError):
        cause, code = f"{exc.strerror or exc} ({exc.filename or 'I/O error'})", EXIT_FAILED
    else:
        cause, code = f"{type(exc).__name__}: {exc}", EXIT_FAILED
    return ForkError(f"rebase failed: {cause}\n{what_now}", code)


def abort(cfg: ForkConfig) -> int:
    work = workdir(cfg)
    if not work.exists():
        raise BadInput("no rebase in progress (build/rebase does not exist)")
    shutil.rmtree(work)
    print("fork rebase: aborted; build/rebase removed. patches/, fork.toml and the overlay were not changed.")
    return 0


def _in_progress_message(cfg: ForkConfig) -> str:
    work = workdir(cfg)
    try:
        st = State.load(work)
        where = f"onto vllm-ascend {st.onto}"
        if st.stopped:
            where += f", stopped at a conflict in {st.items[st.index].name}"
    except InProgress:
        where = "(state unreadable)"
    return (
        f"a rebase is already in progress {where} ({work}).\n"
        "Resolve it and run `python -m tools.fork rebase --continue`, or discard it with "
        "`python -m tools.fork rebase --abort`."
    )


def start(cfg: ForkConfig, args) -> int:
    work = workdir(cfg)
    if work.exists():
        raise InProgress(_in_progress_message(cfg))
    version = args.onto.strip().removeprefix("v")
    if not VERSION_RE.match(version):
        raise BadInput(f"--onto {args.onto!r} is not a release version (e.g. 0.23.0 or 0.23.0.post1)")
    if version == cfg.pin.version:
        raise BadInput(f"the series is already on vllm-ascend {version} (the pin); nothing to rebase")
    _require_no_unexported_edits(cfg)
    old_patches = series.read(cfg)  # validates patches/series
    target = series.resolve(cfg, version)
    old_pin = cfg.pin.version

    known = next((b for b in cfg.bases if b.version == version), None)
    unchecked = getattr(args, "version_unchecked", False)
    if known is not None:
        source = upstream.resolve(cfg, version, sdist=args.sdist, checkout=args.checkout, version_unchecked=unchecked)
        sha256, first_use = known.sha256, False
    else:
        source, sha256 = _first_use_source(cfg, version, args.sdist, args.checkout, unchecked)
        first_use = True
    print(f"fork rebase: vllm-ascend {old_pin} -> {version} ({source.verified}); {len(target)} patch(es)", flush=True)

    work.parent.mkdir(parents=True, exist_ok=True)
    try:
        work.mkdir()
    except FileExistsError:
        raise InProgress(_in_progress_message(cfg)) from None
    try:
        st = _setup(cfg, work, old_pin, old_patches, version, source, target)
        st.onto_sha256, st.first_use = sha256, first_use
        st.drop_old_base, st.test = args.drop_old_base, args.test
        st.no_test, st.series_only = (
            bool(getattr(args, "no_test", False)),
            bool(getattr(args, "series_tests_only", False)),
        )
        st.test_python = getattr(args, "test_python", None) or ""
        st.source_sdist = str(source.sdist.resolve()) if source.sdist else ""
        st.source_checkout = str(source.checkout.resolve()) if source.checkout else ""
        st.save(work)
    except BaseException as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise _failure(exc, "Nothing was changed (build/rebase removed); run the rebase again.") from None
    return _drive(cfg, work, st, discard_on_error=True)


def _require_no_unexported_edits(cfg: ForkConfig) -> None:
    tree = cfg.default_fork_dir()
    if git.is_repo(tree) and materialize.base_version(tree) == cfg.pin.version:
        edits = materialize.local_edits(tree)
        if edits:
            raise LocalEdits(
                f"{tree} has work that is not in patches/ and would be left out of the rebase:\n  - "
                + "\n  - ".join(edits)
                + "\nExport it first (`python -m tools.fork export`), or discard it "
                "(`python -m tools.fork apply --force`)."
            )


def _first_use_source(
    cfg: ForkConfig, version: str, sdist: Path | None, checkout: Path | None, version_unchecked: bool = False
):
    """A release fork.toml does not list yet: take the sdist as it is and record its sha256 (TOFU).
    With --checkout the files come from the checkout (its version checked) and the pin's sha256
    from the release's sdist in the cache."""
    cached = config.cache_dir() / "sdists" / upstream.sdist_name(cfg.dist, version)
    if checkout is not None:
        src = upstream.from_checkout(checkout, version, version_unchecked=version_unchecked)
        if not cached.exists():
            raise BadInput(
                f"vllm-ascend {version} is not in fork.toml, and a pin records the release's sdist sha256: get the "
                f"sdist once (`python -m tools.fork test --base {version} --env-only`, or --sdist PATH) and run again"
            )
        _require_sdist_version(cached, version)
        sha256 = upstream.sha256_of(cached)
        _loud(
            f"TRUST ON FIRST USE: vllm-ascend {version} is not in fork.toml. Files from {checkout} "
            f"({src.verified}); the pin records the cached sdist's sha256 {sha256}."
        )
        return src, sha256
    if sdist is not None:
        if not sdist.is_file():
            raise BadInput(f"--sdist {sdist}: no such file")
        path, origin = sdist, "the given sdist"
    elif cached.exists():
        path, origin = cached, "the cached sdist (not yet in fork.toml)"
    else:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".download-") as tmp:
            downloaded = upstream._pip_download(cfg, Base(version, "0" * 64), Path(tmp))
            _require_sdist_version(downloaded, version)
            os.replace(downloaded, cached)
        path, origin = cached, "downloaded from the package registry"
    _require_sdist_version(path, version)
    sha256 = upstream.sha256_of(path)
    _loud(
        f"TRUST ON FIRST USE: vllm-ascend {version} is not in fork.toml. Using {origin}:\n"
        f"  {path}\n  sha256 {sha256}\n"
        "This sha256 is recorded in fork.toml if the rebase completes. Compare it with the hash the "
        f"package registry publishes for {cfg.dist} {version} before you commit fork.toml."
    )
    return upstream.Source(version, sdist=path, verified=f"sha256 {sha256[:12]} (first use)"), sha256


def _require_sdist_version(path: Path, version: str) -> None:
    upstream.require_sdist_version(path, version)


def _loud(message: str) -> None:
    bar = "!" * 78
    print(f"{bar}\n{message}\n{bar}", file=sys.stderr, flush=True)


def _setup(cfg, work: Path, old_pin: str, old_patches, version: str, source, target) -> State:
    """The rebase tree: a clone of the old series (materialized as `apply` does, in build/fork when
    that is free) for range-diff and evidence, plus the new release as a second root commit, on
    which branch `fork` starts."""
    old_tree, tree, queue = _old_series_tree(cfg, work, old_pin, old_patches), work / "tree", work / "queue"
    # --local: objects are hard-linked, not copied; the clone is a standalone repository.
    git.run(["clone", "-q", "--local", "--no-checkout", "--no-tags", "--single-branch", "-b", materialize.BRANCH,
             str(old_tree), str(tree)], work)  # fmt: skip
    git.run(["fetch", "-q", str(old_tree), f"refs/tags/{base_tag(old_pin)}:refs/tags/{base_tag(old_pin)}"], tree)
    git.run(["update-ref", OLD_REF, f"refs/heads/{materialize.BRANCH}"], tree)
    git.run(["remote", "remove", "origin"], tree)
    git.run(["config", "core.commentChar", ";"], tree)  # keep `### ...` PR sections when messages are edited
    if old_tree.parent == work:
        shutil.rmtree(old_tree)
    # The new release: a root commit on an unborn branch, which becomes `fork`.
    git.run(["symbolic-ref", "HEAD", "refs/heads/rebase-new-base"], tree)
    git.run(["read-tree", "--empty"], tree)
    upstream.extract(source, tree)
    materialize.commit_release(source, tree)
    git.run(["branch", "-M", materialize.BRANCH], tree)
    queue.mkdir()
    items = []
    for name, path in target:
        if path is None:
            items.append(Item(name, None, "not needed on this base"))
            continue
        shutil.copyfile(path, queue / name)
        items.append(Item(name, f"queue/{name}", path.relative_to(cfg.root).as_posix()))
    head = git.out(["rev-parse", "HEAD"], tree)
    return State(
        onto=version, onto_sha256="", first_use=False, old_pin=old_pin, drop_old_base=False, test=False,
        digest=_digest(_protected_files(cfg)), items=items, head=head,
    )  # fmt: skip


def _old_series_tree(cfg: ForkConfig, work: Path, old_pin: str, old_patches) -> Path:
    """The old series materialized on the old pin: build/fork (brought up to date as `apply` would),
    or, when build/fork is on another base, a private tree under build/rebase."""
    fork = cfg.default_fork_dir()
    tree = fork if not fork.exists() or materialize.base_version(fork) == old_pin else work / "old"
    try:
        materialize.materialize(tree, lambda: upstream.resolve(cfg, old_pin), old_pin, old_patches)
    except ApplyFailed as exc:
        raise ForkError(
            f"the current series does not apply to its pin {old_pin}: {exc}\n"
            "Fix it first (`python -m tools.fork check`)."
        ) from None
    return tree


# --- applying ---------------------------------------------------------------------------------


@dataclass
class Conflict:
    item: Item
    files: list[str]  # one line per file: path, what happened, hunks
    detail: str = ""


def _drive(cfg: ForkConfig, work: Path, st: State, *, discard_on_error: bool) -> int:
    tree = work / "tree"
    total = len(st.items)
    try:
        while st.phase == "apply" and st.index < total:
            item = st.items[st.index]
            if item.file is None:
                result = Result(item.name, NOT_APPLIED, [f"{item.origin} (no patch for {st.onto})"])
            else:
                result = apply_one(tree, work, item, st)
                if isinstance(result, Conflict):
                    result = _other_version_applies(cfg, work, tree, st, result)
                if isinstance(result, Conflict):
                    st.stopped = True
                    st.conflict_files = [line.split(":", 1)[0] for line in result.files]
                    st.save(work)
                    print_conflict(cfg, st, result)
                    return EXIT_CONFLICT
            _record(work, st, tree, result)
        if st.phase == "apply":
            st.phase = "test"
            st.save(work)
        if st.phase == "test":
            stop = _test_phase(cfg, work, st)
            if stop is not None:
                return stop
    except BaseException as exc:
        if isinstance(exc, _Redrive):
            return _drive(cfg, work, st, discard_on_error=discard_on_error)
        if discard_on_error:
            shutil.rmtree(work, ignore_errors=True)
            raise _failure(exc, "Nothing was changed (build/rebase removed); run the rebase again.") from None
        raise _failure(exc, _still_in_progress()) from None
    return finish(cfg, work, st)


def _other_version_applies(cfg: ForkConfig, work: Path, tree: Path, st: State, conflict: Conflict):
    """A patch that conflicts may have another version that applies as it is (a per-base variant
    written for a release like this one): take the first that `git am` applies without a merge; the
    tests then judge it. None applies: the conflict of the version tried first is left to resolve."""
    item = conflict.item
    files = ", ".join(line.split(":", 1)[0] for line in conflict.files) or "?"
    for alt in _alternatives(cfg, st, item.name):
        materialize.abort_am(tree)
        git.run(["reset", "-q", "--hard", st.head], tree)
        git.run(["clean", "-q", "-fd"], tree)
        rel = alt.relative_to(cfg.root).as_posix()
        st.tried.setdefault(item.name, []).append(item.origin)
        st.tried[item.name].append(rel)
        try:
            materialize.am(tree, series.Patch(item.name, alt))
        except ApplyFailed:
            continue
        copy = f"queue/{item.name}.{len(st.tried[item.name])}"
        shutil.copyfile(alt, work / copy)
        st.items[st.index] = Item(item.name, copy, rel)
        st.chosen[item.name] = f"{item.origin} conflicts in {files}"
        print(f"  [{st.index + 1}/{len(st.items)}] {item.name}: {item.origin} conflicts in {files}; "
              f"{rel} applies", flush=True)  # fmt: skip
        origin = [f"{rel.split('/')[2]} variant"] if rel.startswith("patches/bases/") else []
        return Result(item.name, APPLIED_CLEANLY, origin, applied=True)
    if st.tried.get(item.name):
        materialize.abort_am(tree)
        git.run(["reset", "-q", "--hard", st.head], tree)
        git.run(["clean", "-q", "-fd"], tree)
        return apply_one(tree, work, item, st)
    return conflict


class _Redrive(Exception):
    """The tests chose another variant of a patch: the tree was rewound, apply again from there."""


def _source(st: State) -> upstream.Source:
    if st.source_checkout:
        return upstream.Source(st.onto, checkout=Path(st.source_checkout), verified="checkout")
    return upstream.Source(st.onto, sdist=Path(st.source_sdist), verified=f"sha256 {st.onto_sha256[:12]}")


def _commit_patch(tree: Path, st: State) -> dict[str, str]:
    """Commit -> patch name, for the commits the rebase made (one per applied patch, in order)."""
    commits = git.out(["rev-list", "--reverse", f"{base_tag(st.onto)}..HEAD"], tree).split()
    applied = [r.name for r in st.results if r.applied]
    return dict(zip(commits, applied))


def _alternatives(cfg: ForkConfig, st: State, name: str) -> list[Path]:
    """Other versions of patch `name` the repository has (the pin's and every base's variant),
    not yet tried, by content."""
    item = next(i for i in st.items if i.name == name)
    used = (workdir(cfg) / item.file).read_bytes() if item.file else b""
    seen = {series.patch_id(used)} if used.strip() else set()
    tried = set(st.tried.get(name, []))
    out = []
    for path in [cfg.patches_dir / name, *sorted(cfg.patches_dir.glob(f"bases/*/{name}"))]:
        rel = path.relative_to(cfg.root).as_posix()
        if not path.is_file() or not path.read_bytes().strip() or rel in tried:
            continue
        pid = series.patch_id(path.read_bytes())
        if pid in seen:
            continue
        seen.add(pid)
        out.append(path)
    return out


def _test_phase(cfg: ForkConfig, work: Path, st: State) -> int | None:
    """Run the tests on the rebased tree; None when the rebase may write, else the exit code of a stop.
    A failing test of a patch that has another version (a per-base variant) makes the rebase try it."""
    from tools.fork import rebase_test

    tree = work / "tree"
    if st.no_test:
        st.tested = ["UNTESTED (--no-test): neither the series' own tests nor upstream's CPU suite ran"]
        st.phase = "write"
        st.save(work)
        return None
    print(f"\nfork rebase: testing the rebased tree on vllm-ascend {st.onto} before writing anything", flush=True)
    report = rebase_test.run(
        cfg, tree, st.onto, _source(st), st.onto_sha256, _commit_patch(tree, st),
        series_only=st.series_only, python=st.test_python or None,
    )  # fmt: skip
    for line in report.summary:
        print(f"fork rebase: [tests] {line}")
    if report.ok:
        st.tested = report.summary
        st.test_failures = []
        st.phase = "write"
        st.save(work)
        return None
    for failure in report.failures:
        if failure.patch is None:
            continue
        k = next(i for i, it in enumerate(st.items) if it.name == failure.patch)
        item = st.items[k]
        alternatives = _alternatives(cfg, st, item.name)
        if not alternatives:
            continue
        alt = alternatives[0]
        rel = alt.relative_to(cfg.root).as_posix()
        st.tried.setdefault(item.name, []).append(item.origin)
        st.tried[item.name].append(rel)
        print(
            f"fork rebase: [tests] {failure.test} fails with {item.origin} (patch {k + 1}); "
            f"trying its other version {rel}",
            flush=True,
        )
        st.chosen[item.name] = f"chosen by the tests: {failure.test.split('::')[-1]} fails with {item.origin}"
        # Rewind to just before this patch and apply again from there, with the other version.
        n_before = sum(1 for r in st.results[:k] if r.applied)
        commits = git.out(["rev-list", "--reverse", f"{base_tag(st.onto)}..HEAD"], tree).split()
        target = commits[n_before - 1] if n_before else base_tag(st.onto)
        git.run(["reset", "-q", "--hard", target], tree)
        git.run(["clean", "-q", "-fd"], tree)
        copy = f"queue/{item.name}.{len(st.tried[item.name])}"
        shutil.copyfile(alt, work / copy)
        st.items[k] = Item(item.name, copy, rel)
        st.results = st.results[:k]
        st.index = k
        st.head = git.out(["rev-parse", "HEAD"], tree)
        st.phase = "apply"
        st.save(work)
        raise _Redrive()
    st.test_failures = [asdict(f) for f in report.failures]
    st.stopped = True
    st.save(work)
    print_test_stop(cfg, st)
    return EXIT_CONFLICT


def print_test_stop(cfg: ForkConfig, st: State) -> None:
    tree = workdir(cfg) / "tree"
    fails = st.test_failures
    print(f"fork rebase: TESTS FAILED on vllm-ascend {st.onto} ({len(fails)} test(s)); nothing was written")
    for f in fails[:30]:
        owner = f" (patch {f['patch']})" if f.get("patch") else ""
        msg = f"\n      {f['message']}" if f.get("message") else ""
        print(f"  {f['test']}: {f['outcome']}{owner}{msg}")
    if len(fails) > 30:
        print(f"  ... and {len(fails) - 30} more")
    for name, origins in st.tried.items():
        print(f"  versions of {name} tried: {', '.join(dict.fromkeys(origins))}")
    print("Fix it in the rebase tree (one patch is one commit: amend the patch's commit), then continue:")
    print(f"  cd {tree}")
    print(
        "  # edit, then `git commit --amend` (last patch) or `git commit --fixup=<commit>` + "
        "`git rebase -i --autosquash v" + st.onto + "`"
    )
    print(f"  cd {cfg.root}")
    print("  python -m tools.fork rebase --continue   # runs the tests again; or: python -m tools.fork rebase --abort")


def _still_in_progress() -> str:
    return (
        "patches/, fork.toml and the overlay were not changed. The rebase is still in progress (build/rebase): "
        "fix the cause, then `python -m tools.fork rebase --continue`, or discard it with `--abort`."
    )


def _record(work: Path, st: State, tree: Path, result: Result) -> None:
    st.results.append(result)
    st.index += 1
    st.head = git.out(["rev-parse", "HEAD"], tree)
    st.stopped = False
    st.conflict_files = []
    st.save(work)
    n = len(st.items)
    extra = f" ({'; '.join(result.evidence)})" if result.evidence else ""
    print(f"  [{st.index}/{n}] {result.name}: {result.outcome}{extra}", flush=True)


def apply_one(tree: Path, work: Path, item: Item, st: State) -> Result | Conflict:
    patch = series.Patch(item.name, work / item.file)
    before = git.out(["rev-parse", "HEAD"], tree)
    origin = [f"{item.origin.split('/')[2]} variant"] if item.origin.startswith("patches/bases/") else []
    try:
        materialize.am(tree, patch)
        return Result(item.name, APPLIED_CLEANLY, origin + _offsets(tree, before, patch), applied=True)
    except ApplyFailed:
        materialize.abort_am(tree)
    try:
        materialize.am(tree, patch, three_way=True)
    except ApplyFailed as exc:
        return _conflict(tree, item, st, exc.detail)
    if git.out(["rev-parse", "HEAD"], tree) == before:
        return Result(item.name, ALREADY_UPSTREAM, origin + [_already_upstream_evidence(tree, st, patch)])
    return _merged(tree, st, patch, before, origin)


def _diff(tree: Path, a: str, b: str, paths: list[str] | None = None) -> bytes:
    args = ["diff", "--full-index", "--no-renames", "--no-color", a, b]
    if paths is not None:
        args += ["--", *paths]
    return git.run(args, tree, binary=True).stdout


def _offsets(tree: Path, before: str, patch: series.Patch) -> list[str]:
    mine = _hunk_positions(patch.data)
    applied = _hunk_positions(_diff(tree, before, "HEAD"))
    moved: dict[str, set[int]] = {}
    for (f, old, _), (f2, old2, _) in zip(mine, applied):
        if f == f2 and old != old2:
            moved.setdefault(f, set()).add(old2 - old)
    return [f"offset {f} {', '.join(f'{d:+d}' for d in sorted(ds))} lines" for f, ds in moved.items()]


def _changed_lines(section: bytes) -> Counter:
    body = section.split(b"\n@@", 1)[1] if b"\n@@" in section else b""
    return Counter(line for line in body.splitlines() if line[:1] in (b"+", b"-"))


def _upstream_renames(tree: Path, st: State) -> dict[str, str]:
    out = git.out(
        ["diff", "--find-renames", "--name-status", "--no-color", base_tag(st.old_pin), base_tag(st.onto)], tree
    )
    renames = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if parts[0].startswith("R") and len(parts) == 3:
            renames[parts[1]] = parts[2]
    return renames


def _same_as_upstream(tree: Path, st: State, section: bytes, path: str) -> str:
    """' (same patch-id as upstream's diff A..B of PATH)' when upstream made exactly this change."""
    up = _diff(tree, base_tag(st.old_pin), base_tag(st.onto), [path])
    if up and series.patch_id(up) == series.patch_id(section):
        return f"; upstream's own diff {st.old_pin}..{st.onto} of it has the same patch-id {series.patch_id(up)[:12]}"
    return ""


def _already_upstream_evidence(tree: Path, st: State, patch: series.Patch) -> str:
    files = list(series.file_sections(patch.data))
    up = _diff(tree, base_tag(st.old_pin), base_tag(st.onto), files)
    pid = series.patch_id(patch.data)
    if up and series.patch_id(up) == pid:
        return f"upstream's own diff {st.old_pin}..{st.onto} over {', '.join(files)} has the same patch-id {pid[:12]}"
    return f"applying it changes nothing: {st.onto} already has every change to {', '.join(files)}"


def _merged(tree: Path, st: State, patch: series.Patch, before: str, origin: list[str]) -> Result:
    mine = series.file_sections(patch.data)
    got = series.file_sections(_diff(tree, before, "HEAD"))
    renames = _upstream_renames(tree, st) if set(mine) - set(got) else {}
    evidence, partial = list(origin), False
    for path, section in mine.items():
        target = path
        if path not in got and renames.get(path) in got:
            target = renames[path]
            evidence.append(f"followed upstream's rename {path} -> {target}")
        if target not in got:
            partial = True
            evidence.append(f"{path}: change already in {st.onto}{_same_as_upstream(tree, st, section, path)}")
        else:
            have, want = _changed_lines(got[target]), _changed_lines(section)
            if have != want and have <= want:
                partial = True
                evidence.append(f"{path}: part of the change already in {st.onto}")
    outcome = PARTIALLY_UPSTREAM if partial else APPLIED_3WAY
    return Result(patch.name, outcome, evidence, applied=True)


_STATUS = {
    "UU": "both modified",
    "AA": "added by both (upstream added it too)",
    "DU": "deleted upstream, modified by the patch (modify/delete)",
    "UD": "deleted by the patch, modified upstream (modify/delete)",
    "AU": "added by the patch, conflicting with upstream",
    "UA": "added upstream, conflicting with the patch",
    "DD": "deleted by both",
}


def _conflict(tree: Path, item: Item, st: State, detail: str) -> Conflict:
    status = {}
    for line in git.run(["status", "--porcelain", "--untracked-files=no"], tree).stdout.splitlines():
        status[line[3:]] = line[:2]
    unmerged = git.out(["diff", "--name-only", "--diff-filter=U"], tree).splitlines()
    renames = _upstream_renames(tree, st)
    renamed_from = {new: old for old, new in renames.items()}
    new_files = git.out(["ls-tree", "-r", "--name-only", base_tag(st.onto)], tree).splitlines()
    present = set(new_files)
    lines = []
    for path in unmerged:
        what = _STATUS.get(status.get(path, ""), "conflict")
        if path in renames:
            what += f"; renamed upstream to {renames[path]} (the merge did not follow it)"
        elif path in renamed_from:
            what += f"; renamed upstream from {renamed_from[path]}"
        elif status.get(path) == "DU" and path not in present:
            what += f"; not in {st.onto}"
        hunks = _marker_ranges(tree / path)
        if hunks:
            what += "; conflict markers at lines " + ", ".join(hunks)
        lines.append(f"{path}: {what}")
    if not unmerged:
        # `git am -3` failed without leaving a merge: name the patch's files that moved or went away.
        current = tree / ".git" / "rebase-apply" / "patch"
        for path in series.file_sections(current.read_bytes() if current.exists() else b""):
            if path in renames:
                lines.append(f"{path}: renamed upstream to {renames[path]}")
            elif path not in present:
                lines.append(f"{path}: not in {st.onto} (deleted upstream, or never there)")
    return Conflict(item, lines, detail)


def _marker_ranges(path: Path) -> list[str]:
    try:
        text = path.read_bytes().splitlines()
    except OSError:
        return []
    out, start = [], None
    for i, line in enumerate(text, 1):
        if line.startswith(b"<<<<<<< "):
            start = i
        elif line.startswith(b">>>>>>> ") and start is not None:
            out.append(f"{start}-{i}")
            start = None
    return out


def print_conflict(cfg: ForkConfig, st: State, c: Conflict) -> None:
    tree = workdir(cfg) / "tree"
    n = len(st.items)
    print(
        f"fork rebase: CONFLICT in patch {st.index + 1}/{n} {c.item.name} ({c.item.origin}) onto vllm-ascend {st.onto}"
    )
    for line in c.files or [f"git am -3 could not apply it: {c.detail}"]:
        print(f"  {line}")
    unresolved = [line.split(":", 1)[0] for line in c.files]
    print("Resolve it in the rebase tree, then continue:")
    print(f"  cd {tree}")
    print("  git am --show-current-patch=diff    # the patch being applied")
    print("  # edit the files named above (remove the conflict markers); for a file deleted upstream,")
    print("  # move the change where it now belongs or accept the deletion with `git rm FILE`")
    print(f"  git add {' '.join(unresolved) if unresolved else 'FILES'}")
    print(f"  cd {cfg.root}")
    print("  python -m tools.fork rebase --continue   # or: python -m tools.fork rebase --abort")
    print("(Resolving to no change drops the patch; patches/, fork.toml and the overlay change only at the end.)")


# --- --continue -------------------------------------------------------------------------------


def resume(cfg: ForkConfig, *, test: bool = False, no_test: bool = False) -> int:
    work = workdir(cfg)
    if not work.exists():
        raise BadInput("no rebase in progress (build/rebase does not exist); start one with `rebase --onto VERSION`")
    st = State.load(work)
    st.test = st.test or test
    st.no_test = st.no_test or no_test
    tree = work / "tree"
    if st.phase == "test" and st.stopped:
        _require_unchanged(cfg, st)
        dirty = git.dirty_summary(tree, untracked=False)
        if dirty:
            raise ForkError(
                f"{tree} has uncommitted changes ({dirty}): commit them into the "
                "patch they belong to (`git commit --amend`, or a fixup and `git rebase -i --autosquash`), then "
                "`rebase --continue`",
                EXIT_CONFLICT,
            )
        st.stopped = False
        st.test_failures = []
        st.save(work)
    if st.phase == "apply":
        _require_unchanged(cfg, st)
        try:
            if st.stopped:
                result = resolve_current(tree, st)
                _record(work, st, tree, result)
            else:
                # Cut short while applying (failure or signal): back to the last finished patch.
                materialize.abort_am(tree)
                git.run(["reset", "-q", "--hard", st.head], tree)
                git.run(["clean", "-q", "-fd"], tree)
        except BaseException as exc:
            if isinstance(exc, ForkError) and exc.exit_code == EXIT_CONFLICT:
                raise
            raise _failure(exc, _still_in_progress()) from None
    return _drive(cfg, work, st, discard_on_error=False)


def _require_unchanged(cfg: ForkConfig, st: State) -> None:
    if _digest(_protected_files(cfg)) != st.digest:
        raise LocalEdits(
            "patches/, fork.toml or the overlay changed since the rebase started; finishing it would overwrite "
            "those changes. Undo them (e.g. `git stash`), then `rebase --continue`; or `rebase --abort` and start "
            "again."
        )


def resolve_current(tree: Path, st: State) -> Result:
    """The user's resolution of the stopped patch: a commit, or nothing (dropped)."""
    item = st.items[st.index]
    unmerged = git.out(["diff", "--name-only", "--diff-filter=U"], tree).splitlines()
    if unmerged:
        raise ForkError(
            f"{item.name} is still unresolved in {', '.join(unmerged)}: edit, `git add` (or `git rm`), then "
            "`rebase --continue`",
            EXIT_CONFLICT,
        )
    if git.am_in_progress(tree):
        unstaged = git.out(["diff", "--name-only"], tree).splitlines()
        if unstaged:
            raise ForkError(
                f"changes in {', '.join(unstaged)} are not staged: `git add` them (or `git checkout -- FILE` to drop "
                "them), then `rebase --continue`",
                EXIT_CONFLICT,
            )
        markers = [
            line for line in git.run(["diff", "--cached", "--check", "HEAD"], tree, check=False).stdout.splitlines()
            if "leftover conflict marker" in line
        ]  # fmt: skip
        if markers:
            raise ForkError(
                "conflict markers are still staged: " + "; ".join(markers[:5]) + "; fix them, `git add`, then continue",
                EXIT_CONFLICT,
            )
        staged = git.run(["diff", "--cached", "--quiet", "HEAD"], tree, check=False).returncode != 0
        if not staged:
            git.run(["am", "--skip"], tree)
            return Result(item.name, RESOLVED_EMPTY, ["the resolution left no change"])
        files = git.out(["diff", "--cached", "--name-only", "HEAD"], tree).splitlines()
        by_hand = [f for f in files if f in st.conflict_files] or st.conflict_files or files
        git.run(["am", "--continue"], tree)
        return Result(item.name, RESOLVED, [f"by hand: {', '.join(by_hand)}"], applied=True)
    n = int(git.out(["rev-list", "--count", f"{st.head}..HEAD"], tree) or 0)
    if n == 0:
        return Result(item.name, RESOLVED_EMPTY, ["the git am session was ended without a commit"])
    if n == 1:
        return Result(item.name, RESOLVED, ["committed by hand"], applied=True)
    raise ForkError(
        f"{tree}: {n} commits were made for {item.name}; one patch is one commit: squash them "
        f"(`git reset --soft {st.head[:12]}` then `git commit -C ORIG_HEAD`), then continue",
        EXIT_CONFLICT,
    )


# --- writing the result -----------------------------------------------------------------------


def finish(cfg: ForkConfig, work: Path, st: State) -> int:
    tree = work / "tree"
    try:
        if st.phase == "write":
            changes, names = plan(cfg, tree, st)
            before = _protected_files(cfg)
            after = dict(before)
            for rel, data in changes.items():
                if data is None:
                    after.pop(rel, None)
                else:
                    after[rel] = data
            st.new_digest = _digest(after)
            st.save(work)
            current = _digest(before)
            if current != st.new_digest:
                if current != st.digest:
                    _require_unchanged(cfg, st)
                staged = StagedWrite()
                for rel, data in changes.items():
                    if data is None:
                        staged.delete(cfg.root / rel)
                    else:
                        staged.write(cfg.root / rel, data)
                with _signals_deferred():
                    staged.commit()
                    st.phase = "written"
                    st.save(work)
            else:
                st.phase = "written"
                st.save(work)
    except BaseException as exc:
        if st.phase == "written":  # a signal held off during the write arrives right after it
            raise _failure(exc, _written_but()) from None
        raise _failure(
            exc,
            "patches/, fork.toml and the overlay were not changed. Every patch is applied in build/rebase; fix the "
            "cause (e.g. free disk space), then `python -m tools.fork rebase --continue` writes the result "
            "(or `--abort`).",
        ) from None
    try:
        _after_write(cfg, work, st)
    except BaseException as exc:
        raise _failure(exc, _written_but()) from None
    if st.test:
        rc = run_fork_tests(cfg, st.onto)
        if rc:
            print(f"fork rebase: the fork's tests FAILED on {st.onto} (exit {rc}); the rebase itself is written")
            return EXIT_FAILED
    return 0


def _written_but() -> str:
    return (
        "The rebase IS written (patches/, fork.toml, the overlay); what was cut short is the tidying up "
        "(build/fork, build/rebase): `python -m tools.fork rebase --continue` finishes it."
    )


def plan(cfg: ForkConfig, tree: Path, st: State) -> tuple[dict[str, bytes | None], list[str]]:
    """What the completed rebase writes: {repo-relative path: new bytes, or None to delete}."""
    rendered = export.render(tree, st.onto)
    applied = [r for r in st.results if r.applied]
    if len(rendered) != len(applied):
        raise ForkError(
            f"{tree} has {len(rendered)} commit(s) on {base_tag(st.onto)} for {len(applied)} applied patch(es); "
            "one patch is one commit (squash or drop the extra commits, then `rebase --continue`)"
        )
    new_name = {r.name: name for r, (name, _) in zip(applied, rendered)}
    data_of = dict(rendered)
    kept = [b for b in cfg.bases if b.version != st.onto and not (st.drop_old_base and b.version == st.old_pin)]
    effective = {b.version: dict(series.resolve(cfg, b.version)) for b in kept}

    changes: dict[str, bytes | None] = {}
    names: list[str] = []
    pids: dict[bytes, str] = {}

    def pid(data: bytes) -> str:
        if data not in pids:
            pids[data] = series.patch_id(data)
        return pids[data]

    for item in st.items:
        name = new_name.get(item.name, item.name)
        main = data_of[new_name[item.name]] if item.name in new_name else None
        variants: dict[str, bytes] = {}
        for b in kept:
            path = effective[b.version][item.name]
            mine = path.read_bytes() if path is not None else None
            if mine is None and main is None:
                continue
            if mine is None:
                variants[b.version] = b""  # the new patch is already upstream on this base: skip it there
            elif main is None or pid(mine) != pid(main):
                variants[b.version] = mine
            elif path.parent == cfg.variants_dir(b.version) and mine != main:
                # The base had its own variant, the same change in other bytes (context offsets, index
                # lines): keep its bytes, so that moving back reproduces them exactly.
                variants[b.version] = mine
        if main is None and not variants:
            continue  # upstream on every base that is left: gone from the series
        if name in names:
            raise ForkError(f"two patches would both be named {name}; give one of them another subject")
        names.append(name)
        if main is not None:
            changes[f"patches/{name}"] = main
        for version, data in variants.items():
            changes[f"patches/bases/{version}/{name}"] = data
    for old in sorted(cfg.patches_dir.glob("*.patch")) + sorted(cfg.patches_dir.glob("bases/*/*.patch")):
        rel = old.relative_to(cfg.root).as_posix()
        changes.setdefault(rel, None)
    changes["patches/series"] = series.series_text(names).encode()

    renamed = {old: new for old, new in new_name.items() if old != new}
    removed = [i.name for i in st.items if new_name.get(i.name, i.name) not in names]
    changes["fork.toml"] = updated_fork_toml(cfg, st, kept, renamed, removed).encode()

    own = overlay.ownership(tree, st.onto)
    added = own.added_in_overlay()
    for path in sorted(added):
        changes[path] = overlay.blob(tree, "HEAD", path) or b""
    for path in sorted(overlay.repo_files(cfg) - added):
        changes[path] = None
    return changes, names


# --- fork.toml --------------------------------------------------------------------------------

_HEADER_RE = re.compile(r"^\s*\[")


def _blocks(lines: list[str], header: re.Pattern) -> list[tuple[int, int]]:
    """(start, end) line ranges of the tables whose header matches; end excludes trailing blanks/comments."""
    out = []
    for i, line in enumerate(lines):
        if header.match(line):
            j = i + 1
            while j < len(lines) and not _HEADER_RE.match(lines[j]):
                j += 1
            end = j
            while end > i + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
                end -= 1
            out.append((i, end))
    return out


def _remove(lines: list[str], start: int, end: int) -> None:
    del lines[start:end]
    if start < len(lines) and not lines[start].strip() and (start == 0 or not lines[start - 1].strip()):
        del lines[start]


def updated_fork_toml(cfg: ForkConfig, st: State, kept: list[Base], renamed: dict[str, str], removed: list[str]) -> str:
    """fork.toml with the new pin, the new support matrix and the patch entries renamed; checked by parsing."""
    from tools.fork.config import tomllib

    text = cfg.toml_path.read_text()
    lines = text.splitlines()
    # [upstream]: version and sha256
    up = _blocks(lines, re.compile(r"^\s*\[upstream\]\s*(#.*)?$"))
    if len(up) != 1:
        raise ForkError("fork.toml: cannot find one [upstream] table to update")
    for i in range(*up[0]):
        lines[i] = re.sub(r'^(\s*version\s*=\s*)"[^"]*"', rf'\g<1>"{st.onto}"', lines[i])
        lines[i] = re.sub(r'^(\s*sha256\s*=\s*)"[^"]*"', rf'\g<1>"{st.onto_sha256}"', lines[i])
    # [[bases]]: the bases kept, plus the new pin
    wanted = [b.version for b in cfg.bases if b in kept or b.version == st.onto]
    if st.onto not in wanted:
        wanted.append(st.onto)
    explicit = [str(b.get("version")) for b in tomllib.loads(text).get("bases", [])]
    bases_re = re.compile(r"^\s*\[\[bases\]\]\s*(#.*)?$")
    for (start, end), version in reversed(list(zip(_blocks(lines, bases_re), explicit))):
        if version not in wanted:
            _remove(lines, start, end)
    sha = {b.version: b.sha256 for b in cfg.bases} | {st.onto: st.onto_sha256}
    new_blocks = [
        ["", "[[bases]]", f'version = "{v}"', f'sha256 = "{sha[v]}"'] for v in wanted if v not in explicit
    ]  # fmt: skip
    if new_blocks:
        blocks = _blocks(lines, bases_re)
        at = blocks[-1][1] if blocks else len(lines)
        for block in reversed(new_blocks):
            lines[at:at] = block
    # [patches."NAME"]: follow renames, drop entries of patches that left the series
    for name in removed:
        entry = re.compile(r'^\s*\[patches\."' + re.escape(name) + r'"\]\s*(#.*)?$')
        for start, end in reversed(_blocks(lines, entry)):
            _remove(lines, start, end)
    new_text = export.rename_toml_entries("\n".join(lines) + "\n", renamed)
    _check_toml(new_text, st, wanted, {renamed.get(n, n) for n in cfg.fork_only if n not in removed})
    return new_text


def _check_toml(text: str, st: State, wanted: list[str], fork_only: set[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "fork.toml").write_text(text)
        try:
            new = config.load(Path(tmp))
        except ForkError as exc:
            raise ForkError(f"could not update fork.toml automatically ({exc}); nothing was written") from None
    problems = []
    if (new.pin.version, new.pin.sha256) != (st.onto, st.onto_sha256):
        problems.append(f"pin is {new.pin.version}")
    if sorted(b.version for b in new.bases) != sorted(wanted):
        problems.append(f"bases are {[b.version for b in new.bases]}, expected {wanted}")
    if set(new.fork_only) != fork_only:
        problems.append(f"fork-only patches are {sorted(new.fork_only)}, expected {sorted(fork_only)}")
    if problems:
        raise ForkError("could not update fork.toml automatically (" + "; ".join(problems) + "); nothing was written")


# --- after the write --------------------------------------------------------------------------


def _after_write(cfg: ForkConfig, work: Path, st: State) -> None:
    tree = work / "tree"
    new_cfg = config.load(cfg.root)
    if not tree.is_dir():  # cut short after the write, after the tree was installed
        shutil.rmtree(work, ignore_errors=True)
        print("fork rebase: done (the result was already written).")
        return
    print()
    print(f"fork rebase: git range-diff {st.old_pin}..old-series {st.onto}..new-series")
    # A high creation factor pairs a patch that lost most of its diff (partially upstream) with its
    # old self ("!", with the difference) instead of showing it as dropped and added.
    rd = git.run(
        [
            "range-diff",
            "--no-color",
            "--creation-factor=400",
            f"{base_tag(st.old_pin)}..{OLD_REF}",
            f"{base_tag(st.onto)}..HEAD",
        ],
        tree,
        check=False,
    )
    for line in (rd.stdout or rd.stderr).rstrip().splitlines():
        print(f"    {line}")
    print()
    print_table(st)
    print()
    if st.no_test:
        _loud(
            "fork rebase: this rebase is UNTESTED (--no-test): the series' own tests and upstream's CPU suite "
            f"did not run on {st.onto}. Run `python -m tools.fork test` before you commit."
        )
    else:
        for line in st.tested:
            print(f"fork rebase: tested: {line}")
    print(f"fork rebase: pin vllm-ascend {st.old_pin} -> {st.onto} (sha256 {st.onto_sha256[:12]}); "
          f"bases: {', '.join(b.version for b in new_cfg.bases)}")  # fmt: skip
    variants = sorted(p.relative_to(cfg.root).as_posix() for p in new_cfg.patches_dir.glob("bases/*/*.patch"))
    for v in variants:
        kind = "skip marker (already upstream there)" if not (cfg.root / v).read_bytes().strip() else "variant"
        print(f"fork rebase: {v}: {kind}")
    if st.first_use:
        _loud(f"fork.toml now pins vllm-ascend {st.onto} with sha256 {st.onto_sha256} (trusted on first use).")
    _install_tree(new_cfg, tree, st)
    shutil.rmtree(work, ignore_errors=True)
    print("fork rebase: done. Review with `git diff` and commit patches/, fork.toml and the overlay.")


def print_table(st: State) -> None:
    rows = [
        (str(i), r.name, r.outcome, "; ".join(r.evidence + ([st.chosen[r.name]] if r.name in st.chosen else [])))
        for i, r in enumerate(st.results, 1)
    ]
    head = ("#", "patch", "outcome", "evidence")
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(3)]
    for r in [head, *rows]:
        print("  " + "  ".join(r[k].ljust(widths[k]) for k in range(3)) + "  " + r[3])


def _install_tree(cfg: ForkConfig, tree: Path, st: State) -> None:
    """The rebased tree becomes build/fork (the pin's materialized tree), unless that holds edits."""
    git.run(["update-ref", "-d", OLD_REF], tree, check=False)
    git.run(["tag", "-d", base_tag(st.old_pin)], tree, check=False)
    fork = cfg.default_fork_dir()
    if fork.exists():
        if git.is_repo(fork) and not materialize.local_edits(fork):
            shutil.rmtree(fork)
        else:
            print(
                f"fork rebase: note: {fork} was left as it is (it has local edits); `apply --force` re-materializes it"
            )
            return
    fork.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tree, fork)
    patches = series.read(cfg)
    materialize.State(
        st.onto,
        git.out(["rev-parse", base_tag(st.onto)], fork),
        [(p.name, p.sha256) for p in patches],
        git.out(["rev-parse", "HEAD"], fork),
    ).save(fork)
