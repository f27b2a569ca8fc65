"""The rebase itself: start, drive (apply each patch, test, write), --continue and --abort.

`rebase_tested(root, version, ...)` is the entry point other families call (see the package docstring);
the `rebase` verb (cmd_rebase) parses its command line and calls start / resume / abort.
"""

from __future__ import annotations

import shutil
import signal
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.fork.core import git, series, upstream
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import EXIT_CONFLICT, BadInput, ForkError, InProgress
from tools.fork.core.series import base_tag
from tools.fork.core.txn import TRASH_SUFFIX, discard, remove_trash
from tools.fork.rebase import apply as rebase_apply
from tools.fork.rebase import report as rebase_report
from tools.fork.rebase.prepare import announce_first_use, is_older, require_no_unexported_edits, setup
from tools.fork.rebase.report import print_conflict, print_test_stop, still_in_progress
from tools.fork.rebase.state import (
    NOT_APPLIED,
    Item,
    Result,
    State,
    digest,
    in_progress_message,
    protected_files,
    require_unchanged,
    workdir,
)
from tools.fork.rebase.write import finish, restore_old

_NOTHING_CHANGED = "Nothing was changed (build/rebase removed); run the rebase again."


@contextmanager
def sigterm_as_interrupt():
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
        discard(work)  # what a killed abort left (build/rebase.fork-trash)
        raise BadInput("no rebase in progress (build/rebase does not exist)")
    try:
        st = State.load(work)
    except InProgress:
        st = None
    if st is not None and st.phase in ("writing", "written", "aborting"):
        # The write began: put the old files back (a kill in here is finished by the next --abort).
        st.phase = "aborting"
        st.save(work)
        restored = restore_old(cfg, work)
    else:
        restored = False
    discard(work)
    remove_trash(cfg.default_fork_dir())  # a rebase killed while installing its tree as build/fork
    if st is not None and digest(protected_files(cfg)) == st.digest:
        what = (
            "the rebase's write was undone: patches/, fork.toml and the overlay are as before it (checked)"
            if restored
            else "patches/, fork.toml and the overlay were not changed (checked)"
        )
    elif st is None:  # state.json is replaced atomically and saved before any write: none began
        what = (
            "it was cut short before it saved its state (build/rebase/state.json), so it wrote nothing to "
            "patches/, fork.toml or the overlay"
        )
    else:
        what = (
            "patches/, fork.toml or the overlay differ from when the rebase started (edited since?); left as they are"
        )
    print(f"fork rebase: aborted; build/rebase removed. {what}.")
    return 0


def start(cfg: ForkConfig, args, *, seen: list | None = None) -> int:
    """`rebase --onto`; `seen` (if given) receives the rebase's State, for the caller to read afterwards."""
    work = workdir(cfg)
    if work.exists():
        raise InProgress(in_progress_message(cfg))
    discard(work)  # what a killed --abort or a finished rebase left half-deleted (build/rebase.fork-trash)
    version = upstream.require_version(args.onto, "--onto")
    if version == cfg.pin.version:
        raise BadInput(f"the series is already on vllm-ascend {version} (the pin); nothing to rebase")
    if is_older(version, cfg.pin.version) and not getattr(args, "older", False):
        raise BadInput(
            f"vllm-ascend {version} is older than the pin {cfg.pin.version}: rebasing would move the pin "
            "backwards. Pass --older to do it on purpose (e.g. to keep an older release green as a base, "
            "`check --all-bases` is the usual way)."
        )
    require_no_unexported_edits(cfg)
    old_patches = series.read(cfg)  # validates patches/series
    target = series.resolve(cfg, version)
    old_pin = cfg.pin.version

    release = upstream.obtain(
        cfg, version, sdist=args.sdist, checkout=args.checkout,
        version_unchecked=getattr(args, "version_unchecked", False), listed_only=False,
    )  # fmt: skip
    if release.first_use:
        announce_first_use(cfg, release)
    source, sha256, first_use = release.source, release.base.sha256, release.first_use
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
    if seen is not None:
        seen.append(st)
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
    st.test_counts = report.counts
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
        if work.with_name(work.name + TRASH_SUFFIX).exists():  # killed while removing a finished rebase's work
            remove_trash(work)
            remove_trash(cfg.default_fork_dir())
            print("fork rebase: done (the result was already written; removed what was left of build/rebase).")
            return 0
        raise BadInput("no rebase in progress (build/rebase does not exist); start one with `rebase --onto VERSION`")
    st = State.load(work)
    st.test = st.test or test
    st.no_test = st.no_test or no_test
    tree = work / "tree"
    if st.phase == "aborting":
        raise InProgress(
            "a `rebase --abort` was cut short: run `python -m tools.fork rebase --abort` again to finish it"
        )
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


@dataclass
class PatchOutcome:
    """One patch of a rebase: what happened to it on the new release."""

    name: str
    outcome: str  # one of rebase.state's outcomes: "applied cleanly", "already upstream (dropped)", ...
    variant: str  # the version of the patch used ("patches/NAME" or "patches/bases/V/NAME")
    evidence: list[str] = field(default_factory=list)
    applied: bool = False


@dataclass
class Outcome:
    """What `rebase_tested` did: written (exit_code 0), or stopped at a conflict or failing tests (3)."""

    exit_code: int
    onto: str
    patches: list[PatchOutcome]
    sha256: str = ""  # of the release's sdist (or checkout digest)
    first_use: bool = False  # the release was not in fork.toml: its sha256 is trusted on first use
    conflict: str | None = None  # the patch it stopped at
    conflict_files: list[str] = field(default_factory=list)
    variants_tried: dict[str, list[str]] = field(default_factory=dict)  # patch -> every version tried
    tests: list[str] = field(default_factory=list)  # the test summary lines ("N passed, ...")
    test_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # "series"/"base"/"fork": outcome -> n
    test_failures: list[dict] = field(default_factory=list)

    @property
    def written(self) -> bool:
        return self.exit_code == 0


def rebase_tested(
    root: Path,
    version: str,
    *,
    sdist: Path | None = None,
    checkout: Path | None = None,
    older: bool = False,
    drop_old_base: bool = False,
    series_tests_only: bool = False,
    test_python: str | None = None,
) -> Outcome:
    """Rebase the fork repository at `root` onto `version`, tested before anything is written.

    Written: exit_code 0. Stopped at a conflict or at failing tests: exit_code 3, with build/rebase
    left for `rebase --continue` / `--abort`. Other failures raise ForkError (its exit_code), with
    patches/, fork.toml and the overlay unchanged."""
    from argparse import Namespace

    from tools.fork.core import config

    cfg = config.load(Path(root).resolve())
    args = Namespace(
        onto=version, sdist=sdist, checkout=checkout, version_unchecked=False, older=older,
        drop_old_base=drop_old_base, test=False, no_test=False, series_tests_only=series_tests_only,
        test_python=test_python,
    )  # fmt: skip
    seen: list[State] = []
    with sigterm_as_interrupt():
        code = start(cfg, args, seen=seen)
    st = seen[0]
    by_name = {r.name: r for r in st.results}
    patches = [
        PatchOutcome(i.name, by_name[i.name].outcome, i.origin, list(by_name[i.name].evidence), by_name[i.name].applied)
        for i in st.items
        if i.name in by_name
    ]
    stopped = st.items[st.index].name if code == EXIT_CONFLICT and st.index < len(st.items) else None
    return Outcome(
        exit_code=code, onto=st.onto, patches=patches, sha256=st.onto_sha256, first_use=st.first_use,
        conflict=stopped, conflict_files=list(st.conflict_files),
        variants_tried={k: list(dict.fromkeys(v)) for k, v in st.tried.items()}, tests=list(st.tested),
        test_counts=dict(st.test_counts), test_failures=list(st.test_failures),
    )  # fmt: skip
