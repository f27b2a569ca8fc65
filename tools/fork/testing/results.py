"""Compare the suite's results on the base and the fork per test id, and print the comparison."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.core import git
from tools.fork.core.series import base_tag
from tools.fork.testing.exclusions import EXCLUSIONS_FILE
from tools.fork.testing.junit import BROKEN, OUTCOMES, Result, counts, is_test_file
from tools.fork.testing.suite import UT_DIR, SuiteRun


@dataclass
class Comparison:
    regressions: list[tuple[str, str]] = field(default_factory=list)  # passed on base -> (id, fork outcome)
    lost: list[str] = field(default_factory=list)  # passed on base, absent from the fork
    removed: list[str] = field(default_factory=list)  # absent from the fork because a patch deletes the file
    new: list[Result] = field(default_factory=list)  # ids the fork has and the base has not
    fixed: list[str] = field(default_factory=list)  # broken on base, passing on the fork
    broken_both: list[str] = field(default_factory=list)  # broken on base and fork alike (the release's own)
    fork_added_bad: list[tuple[str, str]] = field(default_factory=list)  # (id or file, outcome/why)

    @property
    def ok(self) -> bool:
        return not (self.regressions or self.lost or self.fork_added_bad)


def fork_added_test_files(fork_tree: Path, version: str) -> list[str]:
    """Test files the series adds on `version`: those its commits add under the fork tree's tests/.

    Per base, from the tree: a base that skips a patch (a skip marker) does not get its tests.
    """
    return sorted(f for f in git.added_paths(fork_tree, base_tag(version), "tests") if is_test_file(f))


def files_the_base_must_run(base_collected: set[str], fork: dict[str, Result]) -> list[str]:
    """The test files whose base results can change the comparison: those where the fork does not
    pass every test, and those holding a test the base collects and the fork lacks. In every other
    file each base test is in the fork and passes there, so no regression, loss or shared breakage
    can be found in it whatever the base does."""
    files = {r.file for r in fork.values() if r.outcome != "passed"}
    files |= {tid.split("::", 1)[0] for tid in base_collected if tid not in fork}
    return sorted(files)


def compare(
    base: dict[str, Result] | None,
    fork: dict[str, Result],
    fork_added_files: list[str],
    excluded_files: set[str] = frozenset(),
    removed_files: set[str] = frozenset(),
    base_collected: set[str] | None = None,
) -> Comparison:
    """Base vs fork per test id, and the check of the tests the fork adds.

    `fork_added_files`: test files (relative paths) the fork adds to this suite; each must
    have run, and every test in it must pass. Files in `excluded_files` are not expected to run.
    `removed_files`: upstream test files a patch deletes (a PR may replace a test it makes
    obsolete): their tests are listed as removed, not lost.
    `base_collected`: every test id the base collects, where `base` holds only the files
    `files_the_base_must_run` names (the fork's new tests are those the base does not collect).
    """
    cmp = Comparison()
    if base is not None:
        for tid, b in sorted(base.items()):
            f = fork.get(tid)
            if b.outcome == "passed":
                if f is None:
                    (cmp.removed if b.file in removed_files else cmp.lost).append(tid)
                elif f.outcome != "passed":
                    cmp.regressions.append((tid, f.outcome))
            elif b.outcome in BROKEN and f is not None and f.outcome == "passed":
                cmp.fixed.append(tid)
        cmp.broken_both = broken_on_both(base, fork)
        on_base = base if base_collected is None else base_collected | base.keys()
        cmp.new = [r for tid, r in sorted(fork.items()) if tid not in on_base]
    added = set(fork_added_files)
    seen_files = set()
    for tid, r in sorted(fork.items()):
        if r.file in added:
            seen_files.add(r.file)
            if r.outcome != "passed":
                cmp.fork_added_bad.append((tid, r.outcome + (f": {r.message}" if r.message else "")))
    for f in sorted(added - seen_files - set(excluded_files)):
        cmp.fork_added_bad.append((f, "ran no test (not collected?)"))
    return cmp


def broken_on_both(base: dict[str, Result], fork: dict[str, Result]) -> list[str]:
    """The ids of tests broken on the fork that are broken on the base as well (the release's own failures), sorted."""
    return sorted(tid for tid, r in fork.items() if r.outcome in BROKEN and tid in base and base[tid].outcome in BROKEN)


def print_side_by_side(base: SuiteRun | None, fork: SuiteRun, base_version: str, title: str = "") -> None:
    print(f"\n{title or f'upstream CPU unit tests ({UT_DIR}, minus {EXCLUSIONS_FILE})'}")
    head_b = f"base {base_version}" + (f" ({base.files} files)" if base and base.files is not None else "")
    head_b += " (cached)" if base and base.cached else ""
    print(f"  {'':10}{head_b:>28}{'fork':>14}")
    cb = counts(base.results) if base else None
    cf = counts(fork.results)
    for o in OUTCOMES:
        if o == "xfailed" and not cf[o] and not (cb and cb[o]):
            continue
        print(f"  {o:10}{(cb[o] if cb else '-'):>28}{cf[o]:>14}")
    print(f"  {'total':10}{(sum(cb.values()) if cb else '-'):>28}{sum(cf.values()):>14}")
    bt = f"{base.seconds:.0f} s" if base else "-"
    ft = f"{fork.seconds:.0f} s"
    print(f"  {'time':10}{bt:>28}{ft:>14}")


def _list(title: str, items: list[str], limit: int = 50) -> None:
    print(f"\n{title} ({len(items)}):")
    for item in items[:limit]:
        print(f"  {item}")
    if len(items) > limit:
        print(f"  ... and {len(items) - limit} more")


def print_comparison(cmp: Comparison, have_base: bool) -> None:
    if have_base:
        if cmp.regressions:
            _list("PASS on base, NOT passing on fork", [f"{t}: {o}" for t, o in cmp.regressions])
        if cmp.lost:
            _list("PASS on base, MISSING from fork", cmp.lost)
        if cmp.removed:
            _list("PASS on base, their file deleted by a patch of the series (not judged)", cmp.removed)
        if cmp.fixed:
            _list("broken on base, passing on fork", cmp.fixed)
        if cmp.broken_both:
            _list("broken on base and fork alike (the release's own; not judged)", cmp.broken_both, limit=1000)
        _list("tests new in the fork", [f"{r.id}: {r.outcome}" for r in cmp.new])
    if cmp.fork_added_bad:
        _list("fork-added tests NOT passing", [f"{t}: {o}" for t, o in cmp.fork_added_bad])


def verdict(cmp: Comparison, steps: list) -> list[str]:
    """Why the run fails (empty: it passes). A step with nothing to run ("none") does not fail it."""
    problems = []
    if cmp.regressions:
        problems.append(f"{len(cmp.regressions)} test(s) pass on the base and not on the fork")
    if cmp.lost:
        problems.append(f"{len(cmp.lost)} test(s) pass on the base and are missing from the fork")
    if cmp.fork_added_bad:
        problems.append(f"{len(cmp.fork_added_bad)} fork-added test(s) not passing")
    problems += [f"{s.name} failed" for s in steps if s.failed]
    return problems
