"""The tests a rebase runs before it writes anything (`rebase` without `--no-test`).

On the rebased tree (all patches applied on the new release):
  1. the series' own tests: every test file the series adds under tests/ut (found with git in the
     tree, so a variant that adds another test counts), each attributed to the patch whose commit
     last touched it; all must pass;
  2. upstream's CPU suite on the unpatched new release and on the rebased tree, compared per test
     id as `test` does (a test that passes on the base must pass on the fork and not go missing).
The environment is the new release's own (testenv.ensure: its paired vLLM, its requirements).
`--test-python PY` (or FORK_TEST_PYTHON) runs both with that Python instead, the tree on
PYTHONPATH and nothing installed: for small trees (the tooling's own tests) and for debugging.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.fork.core import git
from tools.fork.core.errors import ForkError
from tools.fork.core.materialize import materialize
from tools.fork.core.series import base_tag
from tools.fork.testing import suite, testenv
from tools.fork.testing.exclusions import (
    EXCLUSIONS_FILE,
    ignored_paths,
    is_excluded,
    load_exclusions,
    resolve_exclusions,
)
from tools.fork.testing.junit import counts, fmt_counts, parse_junit
from tools.fork.testing.results import compare, fork_added_test_files


@dataclass
class Failure:
    test: str  # test id (or file when it ran no test)
    outcome: str  # failed / error / skipped / missing / ...
    message: str = ""  # the assertion, first line
    patch: str | None = None  # the patch whose commit added (last touched) the test file
    kind: str = "series"  # "series" (a test the series adds) or "suite" (upstream's CPU suite)

    def line(self) -> str:
        owner = f" [patch {self.patch}]" if self.patch else ""
        msg = f": {self.message}" if self.message else ""
        return f"{self.test}: {self.outcome}{owner}{msg}"


@dataclass
class Report:
    ok: bool
    failures: list[Failure] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    # per run, outcome -> number of tests: "series" (the series' own tests), "base" and "fork" (upstream's suite)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"ok": self.ok, "failures": [asdict(f) for f in self.failures], "summary": self.summary}


def added_test_files(tree: Path, version: str) -> list[str]:
    """Test files under tests/ut the series adds on top of the release (relative paths)."""
    return [f for f in fork_added_test_files(tree, version) if f.startswith(suite.UT_DIR + "/")]


def owners(tree: Path, version: str, files: list[str], commit_patch: dict[str, str]) -> dict[str, str]:
    """File -> the patch whose commit last touched it."""
    out = {}
    for f in files:
        commit = git.out(["log", "-1", "--format=%H", f"{base_tag(version)}..HEAD", "--", f], tree)
        if commit in commit_patch:
            out[f] = commit_patch[commit]
    return out


def _say(msg: str) -> None:
    print(f"fork rebase: [tests] {msg}", flush=True)


def _pytest_plain(python: str, tree: Path, label: str, args: list[str], out: Path) -> suite.SuiteRun:
    """pytest with `python`, the tree on PYTHONPATH, nothing installed (--test-python)."""
    out.mkdir(parents=True, exist_ok=True)
    junit, log = out / f"{label}.xml", out / f"{label}.log"
    junit.unlink(missing_ok=True)
    cmd = suite.pytest_command(python, tree, junit, args)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FORK_TEST_PYTHON")}
    env["PYTHONPATH"] = str(tree)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ in the tree (it would read as a local edit)
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    results = parse_junit(junit.read_text()) if junit.exists() else {}
    if proc.returncode not in (0, 1, 5) or not junit.exists():
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-15:])
        raise ForkError(f"{label}: pytest could not run (exit {proc.returncode}):\n    {tail}")
    return suite.SuiteRun(label, results, time.monotonic() - t0, log=log, junit=junit)


class Runner:
    """Runs pytest on a tree: in the release's own test environment, or with a given Python."""

    def __init__(self, cfg, version: str, source, *, python: str | None = None):
        self.cfg, self.version, self.source, self.python = cfg, version, source, python
        self.out = suite.results_dir(cfg) / "rebase"
        self.base_tree = cfg.default_base_dir(version)
        self._tenv: testenv.TestEnv | None = None

    def base(self) -> Path:
        outcome = materialize(self.base_tree.resolve(), lambda: self.source, self.version, [])
        _say(f"{self.base_tree}: vllm-ascend {self.version} (unpatched): {outcome}")
        return self.base_tree

    def tenv(self) -> testenv.TestEnv:
        if self._tenv is None:
            self._tenv = testenv.ensure(self.base(), self.version, link_dir=self.cfg.build_dir / "testenv")
        return self._tenv

    def run(self, tree: Path, label: str, args: list[str]) -> suite.SuiteRun:
        _say(f"[{label}] pytest {' '.join(args[:3])}{' ...' if len(args) > 3 else ''} in {tree}")
        if self.python:
            r = _pytest_plain(self.python, tree, label, args, self.out)
        else:
            r = suite.run_suite(self.tenv(), tree, self.version, label, args, self.out)
        return r

    def cache_path(self, base_sha256: str, args: list[str]) -> Path | None:
        if self.python:
            return None
        tenv = self.tenv()
        return suite.base_cache_path(tenv, self.version, base_sha256, args)


def run(
    cfg,
    tree: Path,
    version: str,
    source,
    base_sha256: str,
    commit_patch: dict[str, str],
    *,
    series_only: bool = False,
    python: str | None = None,
) -> Report:
    """The gate: the series' own tests, then (unless `series_only`) upstream's suite base vs fork."""
    runner = Runner(cfg, version, source, python=python)
    exclusions = load_exclusions(cfg.root) if (cfg.root / EXCLUSIONS_FILE).is_file() else []
    ignores = ignored_paths(resolve_exclusions(exclusions, tree))
    added = added_test_files(tree, version)
    excluded = {f for f in added if is_excluded(f, ignores)}
    own = [f for f in added if f not in excluded]
    owner = owners(tree, version, own, commit_patch)
    report = Report(ok=True)

    # 1. the series' own tests
    if own:
        r = runner.run(tree, "series-tests", own)
        cmp = compare(None, r.results, own)
        for tid, why in cmp.fork_added_bad:
            res = r.results.get(tid)
            file = tid.split("::", 1)[0]
            outcome = res.outcome if res else "ran no test"
            report.failures.append(Failure(tid, outcome, res.message if res else why, owner.get(file)))
        c = counts(r.results)
        report.counts["series"] = dict(c)
        report.summary.append(f"the series' own tests ({len(own)} file(s)): {fmt_counts(c)}")
        if report.failures:
            report.ok = False
            return report
    else:
        report.summary.append("the series adds no test under tests/ut")

    if series_only:
        report.summary.append("upstream's CPU suite NOT run (--series-tests-only)")
        return report

    # 2. upstream's CPU suite, base vs fork
    args = suite.ut_pytest_args(ignores, None, [])
    cache = runner.cache_path(base_sha256, args)
    base_run = suite.load_cached(cache) if cache is not None else None
    if base_run is not None:
        _say(f"[base] results cached ({cache.name})")
    else:
        base_run = runner.run(runner.base(), "base", args)
        if cache is not None:
            suite.store_cached(base_run, cache)
    fork_run = runner.run(tree, "fork", args)
    removed = set(git.deleted_paths(tree, base_tag(version), suite.UT_DIR))  # tests a patch replaces
    cmp = compare(base_run.results, fork_run.results, own, excluded, removed)
    for tid, outcome in cmp.regressions:
        res = fork_run.results[tid]
        report.failures.append(Failure(tid, f"{outcome} (passes on the base)", res.message, None, "suite"))
    for tid in cmp.lost:
        report.failures.append(Failure(tid, "missing (passes on the base)", "", None, "suite"))
    for tid, why in cmp.fork_added_bad:
        file = tid.split("::", 1)[0]
        report.failures.append(Failure(tid, why, "", owner.get(file), "series"))
    cb, cf = counts(base_run.results), counts(fork_run.results)
    report.counts.update(base=dict(cb), fork=dict(cf))
    report.summary.append(
        f"upstream's CPU suite: base {fmt_counts(cb)} | fork {fmt_counts(cf)}; "
        f"{len(cmp.regressions)} regressed, {len(cmp.lost)} lost"
        + (f", {len(cmp.removed)} in files a patch deletes" if cmp.removed else "")
    )
    report.ok = not report.failures
    return report
