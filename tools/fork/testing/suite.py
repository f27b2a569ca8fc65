"""Run upstream's CPU unit-test suite on one tree in the test environment, and cache the base's results."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tools.fork.core.errors import ForkError
from tools.fork.core.outputs import output_dir
from tools.fork.testing import testenv
from tools.fork.testing.junit import JUNIT_FAMILY, ParseError, Result, parse_junit

UT_DIR = "tests/ut"
# Bump when the way the suite is run changes (invalidates cached base results).
RUNNER_VERSION = 2
SUITE_TIMEOUT_S = 30 * 60


@dataclass
class SuiteRun:
    label: str
    results: dict[str, Result]
    seconds: float
    cached: bool = False
    files: int | None = None  # a run of only the files the comparison needs: how many
    log: Path | None = None
    junit: Path | None = None


def ut_pytest_args(ignores: list[str], keyword: str | None, extra: list[str]) -> list[str]:
    extra = [a for a in extra if a != "--"]
    targets = [a for a in extra if not a.startswith("-") and a.startswith(UT_DIR)]
    args = [] if targets else [UT_DIR]
    args += [f"--deselect={p}" if "::" in p else f"--ignore={p}" for p in ignores]
    if keyword:
        args += ["-k", keyword]
    return args + extra


def with_targets(pytest_args: list[str], files: list[str]) -> list[str]:
    """The same selection (ignores, deselections, -k, extra options) over `files` instead of its targets."""
    return [*files, *(a for a in pytest_args if a.startswith("-") or not a.startswith(UT_DIR))]


def base_cache_key(base_sha256: str, tenv: testenv.TestEnv, pytest_args: list[str]) -> str:
    data = {"runner": RUNNER_VERSION, "base": base_sha256, "env": tenv.stamp, "args": pytest_args}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def base_cache_path(tenv: testenv.TestEnv, version: str, base_sha256: str, pytest_args: list[str]) -> Path:
    """Where the base's results for this environment and selection are cached (shared by checkouts)."""
    return tenv.results_dir / f"base-{version}-{base_cache_key(base_sha256, tenv, pytest_args)[:16]}.xml"


def _tail(path: Path, n: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-n:]


def results_dir(cfg, version: str | None = None) -> Path:
    """Per-run junit files and logs (this checkout's), those of a base's run in a folder of their own
    (`make test` tests two bases in turn); cached base results live with the env."""
    root = cfg.build_dir / "test-results"
    return output_dir(root / version if version else root, "the test results' folder")


def pytest_command(python, tree: Path, junit: Path, args: list[str]) -> list[str]:
    """pytest on a tree as the suite runs it: every failure listed, junit with file attributes, the tree as rootdir."""
    return [
        str(python), "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
        "--continue-on-collection-errors", "-o", JUNIT_FAMILY, f"--junitxml={junit}",
        # The tree is the rootdir (test ids relative to it), whatever config lies above it.
        f"--rootdir={tree}", *args,
    ]  # fmt: skip


def run_suite(
    tenv: testenv.TestEnv, tree: Path, version: str, label: str, pytest_args: list[str], out: Path
) -> SuiteRun:
    """Run upstream's unit-test suite in `tree`; results per test id from junit XML."""
    with tenv.lock(f"{label} suite"):
        testenv.install_tree(tenv, tree, version)
        return _run_suite(tenv, tree, label, pytest_args, out)


def _run_suite(tenv: testenv.TestEnv, tree: Path, label: str, pytest_args: list[str], out: Path) -> SuiteRun:
    out.mkdir(parents=True, exist_ok=True)
    junit = out / f"{label}.xml"
    log = out / f"{label}.log"
    junit.unlink(missing_ok=True)
    cmd = pytest_command(tenv.python, tree, junit, pytest_args)
    env = tenv.env({"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HF_HUB_OFFLINE": "1"})
    print(f"fork test: [{label}] {tree}: pytest {' '.join(pytest_args[:3])}{' ...' if len(pytest_args) > 3 else ''}")
    print(f"fork test: [{label}]   log {log}", flush=True)
    t0 = time.monotonic()
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                timeout=SUITE_TIMEOUT_S,
            )  # fmt: skip
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    dt = time.monotonic() - t0
    tail = _tail(log, 1)
    print(f"fork test: [{label}]   {tail[0] if tail else '(no output)'} (exit {rc}, {dt:.0f} s)", flush=True)
    if rc is None:
        raise ForkError(f"{label}: the unit-test suite ran past {SUITE_TIMEOUT_S} s; see {log}")
    if not junit.exists() or rc not in (0, 1):
        lines = "\n    ".join(_tail(log, 20))
        raise ForkError(f"{label}: pytest could not run the suite (exit {rc}):\n    {lines}")
    return SuiteRun(label, parse_junit(junit.read_text()), dt, log=log, junit=junit)


def collect_ids(tenv: testenv.TestEnv, tree: Path, version: str, pytest_args: list[str], out: Path) -> set[str]:
    """The test ids pytest collects in `tree` with this selection, running none of them (a file that
    fails to import has no ids: its error is the run's to report)."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "base-collect.log"
    cmd = [
        str(tenv.python), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
        "--continue-on-collection-errors", f"--rootdir={tree}", *pytest_args,
    ]  # fmt: skip
    env = tenv.env({"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HF_HUB_OFFLINE": "1"})
    t0 = time.monotonic()
    with tenv.lock("base collection"):
        testenv.install_tree(tenv, tree, version)
        with log.open("w") as f:
            proc = subprocess.run(
                cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                timeout=SUITE_TIMEOUT_S,
            )  # fmt: skip
    if proc.returncode not in (0, 1, 5):  # 1: some file failed to import; 5: nothing collected
        lines = "\n    ".join(_tail(log, 20))
        raise ForkError(f"pytest could not collect {tree}'s suite (exit {proc.returncode}):\n    {lines}")
    # Node ids are the lines naming a test in a file; a traceback line reads `FILE.py:LINE: ...`.
    ids = {line for line in log.read_text().splitlines() if line.startswith(UT_DIR + "/") and ".py::" in line}
    print(f"fork test: [base] collected {len(ids)} test(s) in {time.monotonic() - t0:.0f} s (log {log})", flush=True)
    return ids


def load_collected(path: Path) -> set[str] | None:
    try:
        return set(path.read_text().splitlines())
    except FileNotFoundError:
        return None


def store_collected(ids: set[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text("".join(f"{i}\n" for i in sorted(ids)))
    os.replace(tmp, path)


def load_cached(path: Path) -> SuiteRun | None:
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        results = parse_junit(path.read_text())
        return SuiteRun(meta["label"], results, meta["seconds"], cached=True, files=meta.get("files"))
    except (FileNotFoundError, ValueError, KeyError, ParseError):
        return None


def store_cached(run: SuiteRun, path: Path) -> None:
    src = run.junit if run.junit is not None else path.parent / f"{run.label}.xml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, path)
    path.with_suffix(".json").write_text(
        json.dumps({"label": run.label, "seconds": round(run.seconds, 1), "files": run.files}) + "\n"
    )
