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

import os
import shutil
import signal
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from tools.fork.core import git
from tools.fork.rebase import apply as rebase_apply
from tools.fork.rebase import report as rebase_report
from tools.fork.core import series
from tools.fork.core import upstream
from tools.fork.core.config import VERSION_RE, ForkConfig
from tools.fork.core.errors import EXIT_CONFLICT, BadInput, ForkError, InProgress
from tools.fork.rebase.report import print_conflict, print_test_stop, still_in_progress
from tools.fork.rebase.prepare import first_use_source, require_no_unexported_edits, setup
from tools.fork.rebase.state import (
    NOT_APPLIED,
    Item,
    Result,
    State,
    in_progress_message,
    require_unchanged,
    workdir,
)
from tools.fork.rebase.write import finish
from tools.fork.core.series import base_tag

HELP = __doc__

_NOTHING_CHANGED = "Nothing was changed (build/rebase removed); run the rebase again."


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


def abort(cfg: ForkConfig) -> int:
    work = workdir(cfg)
    if not work.exists():
        raise BadInput("no rebase in progress (build/rebase does not exist)")
    shutil.rmtree(work)
    print("fork rebase: aborted; build/rebase removed. patches/, fork.toml and the overlay were not changed.")
    return 0


def start(cfg: ForkConfig, args) -> int:
    work = workdir(cfg)
    if work.exists():
        raise InProgress(in_progress_message(cfg))
    version = args.onto.strip().removeprefix("v")
    if not VERSION_RE.match(version):
        raise BadInput(f"--onto {args.onto!r} is not a release version (e.g. 0.23.0 or 0.23.0.post1)")
    if version == cfg.pin.version:
        raise BadInput(f"the series is already on vllm-ascend {version} (the pin); nothing to rebase")
    require_no_unexported_edits(cfg)
    old_patches = series.read(cfg)  # validates patches/series
    target = series.resolve(cfg, version)
    old_pin = cfg.pin.version

    known = next((b for b in cfg.bases if b.version == version), None)
    unchecked = getattr(args, "version_unchecked", False)
    if known is not None:
        source = upstream.resolve(cfg, version, sdist=args.sdist, checkout=args.checkout, version_unchecked=unchecked)
        sha256, first_use = known.sha256, False
    else:
        source, sha256 = first_use_source(cfg, version, args.sdist, args.checkout, unchecked)
        first_use = True
    print(f"fork rebase: vllm-ascend {old_pin} -> {version} ({source.verified}); {len(target)} patch(es)", flush=True)

    work.parent.mkdir(parents=True, exist_ok=True)
    try:
        work.mkdir()
    except FileExistsError:
        raise InProgress(in_progress_message(cfg)) from None
    try:
        st = setup(cfg, work, old_pin, old_patches, version, source, target)
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
        raise rebase_report.failure(exc, _NOTHING_CHANGED) from None
    return _drive(cfg, work, st, discard_on_error=True)


def _drive(cfg: ForkConfig, work: Path, st: State, *, discard_on_error: bool) -> int:
    tree = work / "tree"
    total = len(st.items)
    try:
        while st.phase == "apply" and st.index < total:
            item = st.items[st.index]
            if item.file is None:
                result = Result(item.name, NOT_APPLIED, [f"{item.origin} (no patch for {st.onto})"])
            else:
                result = rebase_apply.apply_one(tree, work, item, st)
                if isinstance(result, rebase_apply.Conflict):
                    result = rebase_apply.other_version_applies(cfg, work, tree, st, result)
                if isinstance(result, rebase_apply.Conflict):
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
            raise rebase_report.failure(exc, _NOTHING_CHANGED) from None
        raise rebase_report.failure(exc, still_in_progress()) from None
    return finish(cfg, work, st)


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


def _test_phase(cfg: ForkConfig, work: Path, st: State) -> int | None:
    """Run the tests on the rebased tree; None when the rebase may write, else the exit code of a stop.
    A failing test of a patch that has another version (a per-base variant) makes the rebase try it."""
    from tools.fork.rebase import gate as rebase_test

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
        alternatives = rebase_apply.alternatives(cfg, st, item.name)
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
        rebase_apply.rewind(tree, target)
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


def resume(cfg: ForkConfig, *, test: bool = False, no_test: bool = False) -> int:
    work = workdir(cfg)
    if not work.exists():
        raise BadInput("no rebase in progress (build/rebase does not exist); start one with `rebase --onto VERSION`")
    st = State.load(work)
    st.test = st.test or test
    st.no_test = st.no_test or no_test
    tree = work / "tree"
    if st.phase == "test" and st.stopped:
        require_unchanged(cfg, st)
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
        require_unchanged(cfg, st)
        try:
            if st.stopped:
                result = rebase_apply.resolve_current(tree, st)
                _record(work, st, tree, result)
            else:
                # Cut short while applying (failure or signal): back to the last finished patch.
                rebase_apply.rewind(tree, st.head)
        except BaseException as exc:
            if isinstance(exc, ForkError) and exc.exit_code == EXIT_CONFLICT:
                raise
            raise rebase_report.failure(exc, still_in_progress()) from None
    return _drive(cfg, work, st, discard_on_error=False)
