"""Follow upstream: move the series onto the newest vllm-ascend release, tested, as a branch.

Asks the package registry (pip, pre-releases included) for vllm-ascend releases newer than the
pin and takes the newest; `--release VERSION` names one instead (an older one too: named on
purpose). The tested rebase (`rebase --onto VERSION`: the series' own tests and upstream's CPU suite,
base vs fork, in that release's own test environment) runs in a scratch clone of this repository's
HEAD, in a temporary directory: this checkout (working tree, index, HEAD, build/) is not touched.
When the series moved and the tests are green, branch `follow/VERSION` is left in this repository:
HEAD plus one commit with the new patches/, fork.toml and overlay, its message summarising the
outcome (committed as $GIT_AUTHOR_NAME <$GIT_AUTHOR_EMAIL>, else as "vllm-ascend-fork follow").

The report, per patch (applied, variant used, already upstream with the evidence, or conflict
with the files and every version tried), the test counts base vs fork with what regressed or was
lost, the paired vLLM and the wall time, is written as follow.json and follow.md (a pull-request
description) to --report-dir (default build/follow/VERSION/, the one place in this checkout it
writes), and the Markdown is printed.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from tools.fork.core import config, git, series, upstream
from tools.fork.core.config import OVERLAY_ROOTS, VERSION_RE, ForkConfig
from tools.fork.core.errors import EXIT_CONFLICT, BadInput, ForkError, LocalEdits
from tools.fork.core.outputs import output_dir
from tools.fork.follow import releases, report
from tools.fork.rebase.engine import Outcome, rebase_tested, sigterm_as_interrupt
from tools.fork.testing.base_recipe import paired_vllm

HELP = __doc__

# 0-7 are every verb's (core/errors.py; 3 here: a conflict, 5: the registry, 6: the branch exists);
# 8 and 9 are follow's own, for a scheduler.
EXIT_MOVED = 0  # moved and green: branch follow/VERSION, open a pull request from it
EXIT_NEEDS_PERSON = EXIT_CONFLICT  # 3: a patch conflicts with every version of it the repository has
EXIT_TESTS_FAIL = 8  # the series applies, but tests fail with every version tried
EXIT_NOTHING_NEWER = 9  # the registry has no release newer than the pin: nothing was done

EXIT_CODES = f"""\
exit codes (a scheduler acts on them):
  {EXIT_MOVED}  moved and green: branch follow/VERSION and the report; open a pull request from it
  {EXIT_NEEDS_PERSON}  needs a person: a patch conflicts (the report names it, its files, every version tried)
  {EXIT_TESTS_FAIL}  needs a person: tests fail on the new release (the report names them and their patches)
  {EXIT_NOTHING_NEWER}  nothing newer than the pin on the package registry: nothing was done
  2  bad input (arguments, a version that is not a release, the repository is not a git checkout)
  5  the registry could not be asked, or the release could not be obtained
  6  refused: branch follow/VERSION exists already (delete it to follow that release again)
  7  this Python lacks a package the tooling needs: run it with build/tools-venv/bin/python
  1  anything else failed (the message names it); no branch is left
"""

IDENTITY = ("vllm-ascend-fork follow", "follow@fork.invalid")  # commits when the environment names no one


def add_arguments(p) -> None:
    p.add_argument("--release", metavar="VERSION", help="follow this release instead of the newest (an older one too)")
    p.add_argument(
        "--report-dir",
        type=Path,
        metavar="DIR",
        help="where follow.json and follow.md go (default: build/follow/VERSION)",
    )
    p.epilog = EXIT_CODES


def run(args, cfg: ForkConfig) -> int:
    t0 = time.monotonic()
    head = git.rev(cfg.root, "HEAD") if git.is_repo(cfg.root) else None
    if head is None:
        raise BadInput(f"{cfg.root} is not a git checkout with a commit: follow leaves its result as a branch there")
    if args.report_dir is not None:
        output_dir(args.report_dir, "--report-dir")  # before any work
    version = _target(args, cfg)
    if version is None:
        return EXIT_NOTHING_NEWER
    branch = f"follow/{version}"
    if git.rev(cfg.root, f"refs/heads/{branch}"):
        raise LocalEdits(
            f"branch {branch} exists already (an earlier follow of {version}); nothing was done. "
            f"Delete it (`git branch -D {branch}`) to follow {version} again."
        )
    report_dir = output_dir(args.report_dir or cfg.build_dir / "follow" / version, "--report-dir").resolve()
    _note_uncommitted(cfg.root, head)
    r = {"schema": 1, "version": version, "from": cfg.pin.version, "head": head,
         "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
    # SIGTERM unwinds like Ctrl-C: the scratch clone is removed on either.
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="fork-follow-") as tmp:
        scratch = _scratch_clone(cfg.root, head, Path(tmp) / "repo")
        print(f"fork follow: vllm-ascend {cfg.pin.version} -> {version}, in a scratch clone of HEAD ({scratch})")
        try:
            planned = _planned(scratch, version)
            # --release names the release on purpose: an older one than the pin too
            outcome = rebase_tested(scratch, version, older=args.release is not None)
        except ForkError as exc:
            code = exc.exit_code
            r.update(status=report.FAILED, exit_code=code, message=f"The rebase could not run: {exc}")
        else:
            code = _record(r, outcome, planned, scratch, version)
            if code == EXIT_MOVED:
                r["branch"], r["commit"] = branch, _commit_branch(cfg.root, scratch, branch, r)
    r["wall_s"] = round(time.monotonic() - t0, 1)
    json_path, md_path = report.write(r, report_dir)
    print()
    print(report.markdown(r), end="")
    print(f"\nfork follow: report {json_path} and {md_path}; exit {code} ({r['status']})")
    return code


def _target(args, cfg: ForkConfig) -> str | None:
    """The release to follow: --release, else the newest on the registry newer than the pin (None: none)."""
    if args.release:
        version = upstream.require_version(args.release, "--release")
        if version == cfg.pin.version:
            raise BadInput(f"the series is already on vllm-ascend {version} (the pin); nothing to follow")
        return version
    listed = releases.registry_versions(cfg.dist)
    newer = releases.newer_than(cfg.pin.version, listed)
    if not newer:
        newest = max((v for v in listed if VERSION_RE.match(v)), key=releases.release_key, default="none")
        print(f"fork follow: nothing newer than {cfg.pin.version} on the package registry (newest listed: {newest})")
        return None
    print(f"fork follow: newer than the pin {cfg.pin.version}: {', '.join(newer)}; following the newest, {newer[-1]}")
    return newer[-1]


def _note_uncommitted(root: Path, head: str) -> None:
    # GIT_OPTIONAL_LOCKS=0: `git status` must not refresh this checkout's index.
    lines = git.run(["status", "--porcelain", "--", "patches", "fork.toml", *OVERLAY_ROOTS], root,
                    env={"GIT_OPTIONAL_LOCKS": "0"}).stdout.splitlines()  # fmt: skip
    if lines:
        print(f"fork follow: note: it moves the series committed at HEAD ({head[:12]}); "
              f"uncommitted changes are left out: {', '.join(ln[3:] for ln in lines[:5])}")  # fmt: skip


def _scratch_clone(root: Path, head: str, dest: Path) -> Path:
    """A standalone clone of `root` at `head` (objects hard-linked; `root` is only read)."""
    git.run(["clone", "-q", "--local", "--no-checkout", str(root), str(dest)], root.parent)
    git.run(["checkout", "-q", "--detach", head], dest)
    return dest


def _planned(scratch: Path, version: str) -> list[tuple[str, str]]:
    """Each patch of the series, in order, with the version of it the rebase tries first on `version`."""
    cfg = config.load(scratch)
    return [(name, f.relative_to(scratch).as_posix() if f else "") for name, f in series.resolve(cfg, version)]


def _record(r: dict, outcome: Outcome, planned: list[tuple[str, str]], scratch: Path, version: str) -> int:
    """Fill the report from the rebase's outcome; the exit code."""
    r.update(sha256=outcome.sha256, first_use=outcome.first_use, patches=report.patch_entries(outcome, planned),
             tests=report.test_section(outcome))  # fmt: skip
    r["vllm"], r["vllm_from"] = _paired_vllm(scratch, version)
    if outcome.exit_code == 0:
        r.update(status=report.MOVED, exit_code=EXIT_MOVED)
        r["next"] = [f"Open a pull request from `follow/{version}`; this report is its description."]
        return EXIT_MOVED
    again = (
        f"In a checkout of this repository at {r['head'][:12]}, `python -m tools.fork rebase --onto {version}` "
        "stops at the same place (docs/rebase.md): "
    )
    if outcome.test_failures:
        r.update(status=report.TESTS_FAIL, exit_code=EXIT_TESTS_FAIL)
        r["next"] = [again + "fix the patch in build/rebase/tree (amend its commit), `rebase --continue`, "
                     "then commit patches/, fork.toml and the overlay."]  # fmt: skip
        return EXIT_TESTS_FAIL
    r.update(status=report.CONFLICT, exit_code=EXIT_NEEDS_PERSON)
    r["next"] = [again + "resolve the files named above in build/rebase/tree, `git add`, `rebase --continue`, "
                 "then commit patches/, fork.toml and the overlay."]  # fmt: skip
    return EXIT_NEEDS_PERSON


def _paired_vllm(scratch: Path, version: str) -> tuple[str | None, str]:
    """The vLLM version `version` pairs with, read from the rebased tree (build/rebase/tree when stopped,
    build/fork once written)."""
    for tree in (scratch / "build" / "rebase" / "tree", scratch / "build" / "fork"):
        if tree.is_dir():
            try:
                return paired_vllm(tree, version)
            except BadInput as exc:
                return None, str(exc)
    return None, "no tree to read it from"


def _identity() -> dict[str, str]:
    name = os.environ.get("GIT_AUTHOR_NAME") or IDENTITY[0]
    email = os.environ.get("GIT_AUTHOR_EMAIL") or IDENTITY[1]
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return {
        "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": now,
        "GIT_COMMITTER_NAME": os.environ.get("GIT_COMMITTER_NAME") or name,
        "GIT_COMMITTER_EMAIL": os.environ.get("GIT_COMMITTER_EMAIL") or email, "GIT_COMMITTER_DATE": now,
    }  # fmt: skip


def _commit_branch(root: Path, scratch: Path, branch: str, r: dict) -> str:
    """Commit what the rebase wrote in the scratch clone as `branch`, then fetch that branch into `root`
    (only its refs and objects change there)."""
    git.run(["checkout", "-q", "-b", branch], scratch)
    git.run(["add", "-A", "--", "patches", "fork.toml", *OVERLAY_ROOTS], scratch)
    git.run(["commit", "-q", "--no-verify", "-m", commit_message(r)], scratch, env=_identity())
    git.run(["fetch", "-q", "--no-write-fetch-head", str(scratch), f"refs/heads/{branch}:refs/heads/{branch}"], root)
    return git.out(["rev-parse", f"refs/heads/{branch}"], root)


def commit_message(r: dict) -> str:
    lines = [f"follow: move the series onto vllm-ascend {r['version']} (from {r['from']}), tests green", ""]
    lines.append(f"vllm-ascend {r['version']}, sdist sha256 {r['sha256']}"
                 + (" (trusted on first use)" if r["first_use"] else "") + f"; paired vLLM {r['vllm']}.")  # fmt: skip
    lines += ["", "Patches:"]
    for i, p in enumerate(r["patches"], 1):
        evidence = "; ".join(p["evidence"])
        lines.append(f"  {i}. {p['patch']}: {p['outcome']}" + (f" ({evidence})" if evidence else ""))
    lines += ["", "Tests:", *(f"  {line}" for line in r["tests"]["summary"])]
    lines += ["", "Made by `python3 -m tools.fork follow`; its report (follow.md) is the pull request's description."]
    return "\n".join(lines) + "\n"
