"""Run the tests: upstream's CPU unit-test suite on the base and on the fork, side by side,
then the fork's kernel op tests (Triton interpreter), the triton-ascend compile check, and
the tooling's own tests.

Steps: build/check the test environment (build/testenv, cached); materialize the fork
(build/fork) and the unpatched base (build/base-VERSION) as `apply` does; run `tests/ut` in
each with vllm_ascend installed editable from that tree, leaving out what upstream routes to
NPU runners (.ci/ut-exclusions.txt); compare per test id.

Fails (exit 1) when a test that passes on the base fails, errors, is skipped or is missing
on the fork; when a test the fork adds (a test file under the repository's tests/) fails,
errors or is skipped; or when the kernel, compile or tooling tests fail. The base's results
are cached per base sha256 + environment + selection, so a warm run runs the fork only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork import series, testenv, upstream
from tools.fork.errors import EXIT_FAILED, BadInput, ForkError, LocalEdits
from tools.fork.materialize import ApplyFailed, materialize, require_tree

HELP = __doc__

EXCLUSIONS_FILE = ".ci/ut-exclusions.txt"
UT_DIR = "tests/ut"
KERNEL_TEST_DIR = "tests/e2e/nightly/single_node/ops/singlecard_ops/triton"
KERNEL_HARNESS = "tools/kernel_harness"
ASCEND_COMPILE = "tools/kernel_harness/ascend_compile.py"
TOOLING_TESTS = "tools/fork/tests"
# Bump when the way the suite is run changes (invalidates cached base results).
RUNNER_VERSION = 2
SUITE_TIMEOUT_S = 30 * 60
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
NOT_PASSING = {"failed", "error", "skipped", "xfailed"}
BROKEN = {"failed", "error"}


def add_arguments(p) -> None:
    p.add_argument(
        "--base",
        metavar="VERSION",
        help="a base listed in fork.toml or any release on the package registry, pre-releases included "
        "(default: the pin)",
    )
    from tools.fork.cli import add_source_arguments

    add_source_arguments(p)
    p.add_argument(
        "--fork-only", action="store_true", help="skip the base run (compare with cached base results if any)"
    )
    p.add_argument(
        "--as-is",
        action="store_true",
        help="test the materialized fork tree as it is (e.g. with local edits) instead of re-applying the series",
    )
    p.add_argument("--env-only", action="store_true", help="build/check the test environment and stop")
    p.add_argument(
        "--bisect",
        action="store_true",
        help="for each prefix of the series: apply it, run upstream's CPU suite and the kernel op tests it adds",
    )
    p.add_argument(
        "--kernels-only",
        action="store_true",
        help="only the Triton kernel checks: op tests under the interpreter, harness tests, triton-ascend compile",
    )
    p.add_argument("--rebuild-env", action="store_true", help="rebuild the test environment from scratch")
    p.add_argument(
        "--no-tooling-tests",
        action="store_true",
        help="leave out the tooling's own tests (they do not depend on the base)",
    )
    p.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k selection for the unit-test suite runs")
    p.add_argument(
        "pytest_args",
        nargs=argparse.REMAINDER,
        metavar="-- PYTEST_ARGS",
        help="extra pytest arguments for the unit-test suite runs (paths under tests/ut replace tests/ut)",
    )


# --- exclusions --------------------------------------------------------------------------


@dataclass(frozen=True)
class Exclusion:
    pattern: str  # a path relative to the tree, may hold glob wildcards (`**` for any depth)
    reason: str
    lineno: int


def parse_exclusions(text: str, source: str = EXCLUSIONS_FILE) -> list[Exclusion]:
    """One path a line, each with its reason as a trailing `# comment`; `#` lines are comments."""
    out: list[Exclusion] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        path, sep, reason = line.partition("#")
        path, reason = path.strip(), reason.strip()
        if not sep or not reason:
            raise BadInput(f"{source}:{lineno}: {path!r} has no reason: add it as a trailing '# comment'")
        if " " in path or "\t" in path:
            raise BadInput(f"{source}:{lineno}: one path a line, got {path!r}")
        if path.startswith("/") or ".." in Path(path).parts:
            raise BadInput(f"{source}:{lineno}: {path!r} must be relative to the tree, without '..'")
        norm = path.rstrip("/")
        if norm in seen:
            raise BadInput(f"{source}:{lineno}: {path!r} is listed twice")
        seen.add(norm)
        out.append(Exclusion(path, reason, lineno))
    return out


def resolve_exclusions(exclusions: list[Exclusion], tree: Path) -> list[tuple[Exclusion, list[str]]]:
    """Each exclusion with the paths (relative, posix) it matches in `tree`; a trailing `/` means directories."""
    resolved = []
    for ex in exclusions:
        pattern = ex.pattern.rstrip("/")
        matches = sorted(
            p.relative_to(tree).as_posix() for p in tree.glob(pattern) if not ex.pattern.endswith("/") or p.is_dir()
        )
        resolved.append((ex, matches))
    return resolved


def load_exclusions(root: Path) -> list[Exclusion]:
    path = root / EXCLUSIONS_FILE
    if not path.is_file():
        raise BadInput(f"{path} not found: it lists what upstream routes to NPU runners")
    return parse_exclusions(path.read_text(), EXCLUSIONS_FILE)


# --- results -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    id: str
    outcome: str  # one of OUTCOMES
    message: str = ""

    @property
    def file(self) -> str:
        return self.id.split("::", 1)[0]


_SEVERITY = {o: i for i, o in enumerate(("passed", "skipped", "xfailed", "error", "failed"))}


def _test_id(case: ET.Element) -> str:
    classname, name, file = case.get("classname", ""), case.get("name", ""), case.get("file")
    if file:
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file.replace("/", ".")
        if not classname:  # a collection error: name is the dotted module
            return file
        if classname == module:
            return f"{file}::{name}"
        if classname.startswith(module + "."):
            return f"{file}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
    return f"{classname}::{name}" if classname else name


def parse_junit(text: str) -> dict[str, Result]:
    """Results per test id from a pytest junit XML (junit_family=xunit1, which keeps `file`)."""
    results: dict[str, Result] = {}
    root = ET.fromstring(text)
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        kinds = {child.tag: child for child in case if child.tag in ("failure", "error", "skipped")}
        if "failure" in kinds:
            outcome, message = "failed", kinds["failure"].get("message", "")
        elif "error" in kinds:
            outcome, message = "error", kinds["error"].get("message", "")
        elif "skipped" in kinds:
            skip = kinds["skipped"]
            outcome = "xfailed" if skip.get("type") == "pytest.xfail" else "skipped"
            message = skip.get("message", "")
        tid = _test_id(case)
        old = results.get(tid)
        if old is None or _SEVERITY[outcome] > _SEVERITY[old.outcome]:
            results[tid] = Result(tid, outcome, message.splitlines()[0][:200] if message else "")
    return results


def counts(results: dict[str, Result]) -> Counter:
    c = Counter(r.outcome for r in results.values())
    return Counter({o: c.get(o, 0) for o in OUTCOMES})


@dataclass
class Comparison:
    regressions: list[tuple[str, str]] = field(default_factory=list)  # passed on base -> (id, fork outcome)
    lost: list[str] = field(default_factory=list)  # passed on base, absent from the fork
    new: list[Result] = field(default_factory=list)  # ids the fork has and the base has not
    fixed: list[str] = field(default_factory=list)  # broken on base, passing on the fork
    fork_added_bad: list[tuple[str, str]] = field(default_factory=list)  # (id or file, outcome/why)

    @property
    def ok(self) -> bool:
        return not (self.regressions or self.lost or self.fork_added_bad)


def is_test_file(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def compare(
    base: dict[str, Result] | None,
    fork: dict[str, Result],
    fork_added_files: list[str],
    excluded_files: set[str] = frozenset(),
) -> Comparison:
    """Base vs fork per test id, and the check of the tests the fork adds.

    `fork_added_files`: test files (relative paths) the fork adds to this suite; each must
    have run, and every test in it must pass. Files in `excluded_files` are not expected to run.
    """
    cmp = Comparison()
    if base is not None:
        for tid, b in sorted(base.items()):
            f = fork.get(tid)
            if b.outcome == "passed":
                if f is None:
                    cmp.lost.append(tid)
                elif f.outcome != "passed":
                    cmp.regressions.append((tid, f.outcome))
            elif b.outcome in BROKEN and f is not None and f.outcome == "passed":
                cmp.fixed.append(tid)
        cmp.new = [r for tid, r in sorted(fork.items()) if tid not in base]
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


# --- running -----------------------------------------------------------------------------


@dataclass
class SuiteRun:
    label: str
    results: dict[str, Result]
    seconds: float
    cached: bool = False
    log: Path | None = None
    junit: Path | None = None


def fork_added_test_files(root: Path) -> list[str]:
    """Test files the series adds: those in the repository's tests/ overlay (relative paths)."""
    tests = root / "tests"
    if not tests.is_dir():
        return []
    return sorted(
        p.relative_to(root).as_posix() for p in tests.rglob("*.py") if is_test_file(p.relative_to(root).as_posix())
    )


def ut_pytest_args(ignores: list[str], keyword: str | None, extra: list[str]) -> list[str]:
    extra = [a for a in extra if a != "--"]
    targets = [a for a in extra if not a.startswith("-") and a.startswith(UT_DIR)]
    args = [] if targets else [UT_DIR]
    args += [f"--ignore={p}" for p in ignores]
    if keyword:
        args += ["-k", keyword]
    return args + extra


def base_cache_key(base_sha256: str, tenv: testenv.TestEnv, pytest_args: list[str]) -> str:
    data = {"runner": RUNNER_VERSION, "base": base_sha256, "env": tenv.stamp, "args": pytest_args}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _tail(path: Path, n: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-n:]


def results_dir(cfg) -> Path:
    """Per-run junit files and logs (this checkout's); cached base results live with the env."""
    return cfg.build_dir / "test-results"


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
    cmd = [
        str(tenv.python), "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
        "--continue-on-collection-errors", "-o", "junit_family=xunit1", f"--junitxml={junit}",
        # The tree is the rootdir (test ids relative to it), whatever config lies above it.
        f"--rootdir={tree}", *pytest_args,
    ]  # fmt: skip
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


def load_cached(path: Path) -> SuiteRun | None:
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        return SuiteRun(meta["label"], parse_junit(path.read_text()), meta["seconds"], cached=True)
    except (FileNotFoundError, ValueError, KeyError, ET.ParseError):
        return None


def store_cached(run: SuiteRun, path: Path) -> None:
    src = run.junit if run.junit is not None else path.parent / f"{run.label}.xml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, path)
    path.with_suffix(".json").write_text(json.dumps({"label": run.label, "seconds": round(run.seconds, 1)}) + "\n")


def kernel_test_command(tenv: testenv.TestEnv, root: Path, tree: Path, files: list[str], junit: Path):
    """The kernel op tests' command: its own process, the Triton interpreter, the harness plugin.

    Returns (argv, env, cwd). Adjust here when tools/kernel_harness changes its interface.
    """
    argv = [
        str(tenv.python), "-m", "pytest", "-q", "-rfE", "--noconftest", "-p", "tools.kernel_harness.plugin",
        "-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={junit}", f"--rootdir={tree}",
        f"--kernel-tree={tree}", *(str(tree / f) for f in files),
    ]  # fmt: skip
    env = tenv.env(
        {
            "PYTHONPATH": str(tenv.triton_site),
            "TRITON_INTERPRET": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "KERNEL_TREE": str(tree),
        }
    )
    return argv, env, root


def ascend_compile_command(tenv: testenv.TestEnv, root: Path, tree: Path):
    """The triton-ascend front-end compile check (it sets up its own triton-ascend env)."""
    argv = [sys.executable, "-m", ASCEND_COMPILE[:-3].replace("/", "."), f"--tree={tree}"]
    return argv, testenv.run_env(None, {"KERNEL_TREE": str(tree)}), root


def tooling_test_command(tenv: testenv.TestEnv, root: Path, junit: Path):
    argv = [
        str(tenv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
        f"--junitxml={junit}", TOOLING_TESTS,
    ]  # fmt: skip
    return argv, tenv.env(), root


@dataclass
class Step:
    name: str
    status: str  # "passed", "FAILED", "none" (nothing to run)
    detail: str = ""
    counts: Counter = field(default_factory=Counter)

    @property
    def failed(self) -> bool:
        return self.status == "FAILED"


def judge_step(name: str, returncode: int, c: Counter, seconds: float, *, junit: bool, allow_skips: bool) -> Step:
    """A step passes on exit 0 and, when it writes junit, at least one passed test and (unless
    `allow_skips`) no skipped or xfailed one: fork-added tests must run."""
    detail = f"exit {returncode}, {seconds:.0f} s"
    if returncode != 0:
        return Step(name, "FAILED", detail, c)
    if junit and c["passed"] == 0:
        return Step(name, "FAILED", f"ran no test ({seconds:.0f} s)", c)
    if junit and not allow_skips and (c["skipped"] or c["xfailed"]):
        return Step(name, "FAILED", f"{c['skipped'] + c['xfailed']} test(s) skipped: fork-added tests must run", c)
    return Step(name, "passed", detail, c)


def _run_step(
    name: str, argv, env, cwd, junit: Path | None, *, allow_skips: bool = True, may_skip=lambda test_id: False
) -> Step:
    """Run one step; with `allow_skips` False only tests `may_skip(id)` accepts may be skipped."""
    print(f"\nfork test: [{name}] {' '.join(str(a) for a in argv[:6])} ...", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL)
    dt = time.monotonic() - t0
    results = parse_junit(junit.read_text()) if junit is not None and junit.exists() else {}
    c = counts(results)
    if not allow_skips:
        allow_skips = all(r.outcome not in ("skipped", "xfailed") or may_skip(r.id) for r in results.values())
    return judge_step(name, proc.returncode, c, dt, junit=junit is not None, allow_skips=allow_skips)


def cuda_only_control(test_id: str) -> bool:
    """The kernel op tests' `test_control_*` cases show the unguarded kernel racing on a real GPU;
    under the CPU interpreter they skip by design (the interpreter cannot show a race)."""
    return "::test_control_" in test_id


def _fmt_counts(c: Counter) -> str:
    parts = [f"{c['passed']} passed", f"{c['failed']} failed", f"{c['error']} errors", f"{c['skipped']} skipped"]
    if c["xfailed"]:
        parts.append(f"{c['xfailed']} xfailed")
    return ", ".join(parts)


def print_side_by_side(base: SuiteRun | None, fork: SuiteRun, base_version: str) -> None:
    print(f"\nupstream CPU unit tests ({UT_DIR}, minus {EXCLUSIONS_FILE})")
    head_b = f"base {base_version}" + (" (cached)" if base and base.cached else "")
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
        if cmp.fixed:
            _list("broken on base, passing on fork", cmp.fixed)
        _list("tests new in the fork", [f"{r.id}: {r.outcome}" for r in cmp.new])
    if cmp.fork_added_bad:
        _list("fork-added tests NOT passing", [f"{t}: {o}" for t, o in cmp.fork_added_bad])


def verdict(cmp: Comparison, steps: list[Step]) -> list[str]:
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


# --- the verb ----------------------------------------------------------------------------


def kernel_steps(cfg, tenv: testenv.TestEnv, fork_tree: Path, added: list[str]) -> list[Step]:
    out = results_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    """The Triton kernel checks: op tests + harness tests under the interpreter, triton-ascend compile."""
    steps: list[Step] = []
    # e. kernel op tests under the Triton interpreter
    kernel_files = [f for f in added if f.startswith(KERNEL_TEST_DIR + "/")]
    if not kernel_files:
        steps.append(Step("kernel op tests", "none", f"the fork adds no test under {KERNEL_TEST_DIR}"))
    else:
        junit = out / "kernel.xml"
        junit.unlink(missing_ok=True)
        command = kernel_test_command(tenv, cfg.root, fork_tree, kernel_files, junit)
        steps.append(_run_step("kernel op tests", *command, junit, allow_skips=False, may_skip=cuda_only_control))
    # e'. the harness's own tests (loader, and a known-bad kernel the Ascend front end must reject)
    junit = out / "kernel-harness.xml"
    junit.unlink(missing_ok=True)
    argv = [
        str(tenv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
        f"--junitxml={junit}", f"{KERNEL_HARNESS}/tests",
    ]  # fmt: skip
    env = tenv.env({"PYTHONPATH": f"{cfg.root}{os.pathsep}{tenv.triton_site}"})
    steps.append(_run_step("kernel harness tests", argv, env, cfg.root, junit))
    # f. triton-ascend front-end compile check
    steps.append(_run_step("triton-ascend compile check", *ascend_compile_command(tenv, cfg.root, fork_tree), None))
    return steps


def bisect(cfg, tenv: testenv.TestEnv, base, ignores: list[str], source) -> int:
    """Bisectability: each prefix of the series applies, and upstream's CPU suite on it loses no
    test that passes on the base while every test file the prefix adds passes (~1 min a prefix)."""
    version = base.version
    patches = series.read(cfg, version)
    pytest_args = ut_pytest_args(ignores, None, [])
    cache = tenv.results_dir / f"base-{version}-{base_cache_key(base.sha256, tenv, pytest_args)[:16]}.xml"
    base_run = load_cached(cache)
    if base_run is None:
        _materialize(cfg, version, cfg.default_base_dir(version), [], source)
        base_run = run_suite(tenv, cfg.default_base_dir(version), version, "base", pytest_args, results_dir(cfg))
        store_cached(base_run, cache)
    failed = []
    for k in range(1, len(patches) + 1):
        tree = (cfg.build_dir / "bisect" / f"prefix-{k}").resolve()
        print(f"\nfork test: --bisect prefix {k}/{len(patches)}: {patches[k - 1].name}")
        materialize(tree, lambda: source, version, patches[:k], force=True)
        added = subprocess.run(
            ["git", "diff", "--name-only", "--diff-filter=A", f"v{version}", "HEAD", "--", "tests"],
            cwd=tree, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        added = [f for f in added if is_test_file(f)]
        run = run_suite(tenv, tree, version, f"prefix-{k}", pytest_args, results_dir(cfg))
        cmp = compare(base_run.results, run.results, [f for f in added if f.startswith(UT_DIR + "/")])
        ok = not (cmp.regressions or cmp.lost or cmp.fork_added_bad)
        print(
            f"fork test: prefix {k}: suite {_fmt_counts(counts(run.results))}; {len(cmp.regressions)} regressed, "
            f"{len(cmp.lost)} lost, {len(cmp.fork_added_bad)} added test(s) not passing"
        )
        ops = [f for f in added if f.startswith(KERNEL_TEST_DIR + "/")]
        if ops:
            junit = results_dir(cfg) / f"prefix-{k}-kernel.xml"
            junit.unlink(missing_ok=True)
            step = _run_step(
                f"prefix {k} kernel op tests",
                *kernel_test_command(tenv, cfg.root, tree, ops, junit),
                junit,
                allow_skips=False,
                may_skip=cuda_only_control,
            )
            print(f"fork test: prefix {k}: kernel op tests {step.status} [{_fmt_counts(step.counts)}]")
            ok = ok and not step.failed
        if not ok:
            failed.append(patches[k - 1].name)
    print("fork test: --bisect: " + ("every prefix passes" if not failed else f"FAILED at: {', '.join(failed)}"))
    return EXIT_FAILED if failed else 0


def _materialize(cfg, version: str, tree: Path, patches, source) -> None:
    outcome = materialize(tree.resolve(), lambda: source, version, patches)
    print(f"fork test: {tree}: vllm-ascend {version} + {len(patches)} patch(es): {outcome}")


def base_source(cfg, version: str, args=None):
    """(source, Base) of any release: a fork.toml base verified by sha256, another trusted on first use."""
    source, base, first_use = upstream.resolve_any(
        cfg,
        version,
        sdist=getattr(args, "sdist", None),
        checkout=getattr(args, "checkout", None),
        version_unchecked=getattr(args, "version_unchecked", False),
    )
    note = " (not in fork.toml: trusted on first use)" if first_use else ""
    print(f"fork test: vllm-ascend {version}: {source.verified}{note}", flush=True)
    return source, base


def run(args, cfg) -> int:
    t_start = time.monotonic()
    version = (args.base or cfg.pin.version).strip().removeprefix("v")
    from tools.fork.config import VERSION_RE

    if not VERSION_RE.match(version):
        raise BadInput(f"--base {args.base!r} is not a release version (e.g. 0.23.0.post1 or 0.30.0rc2)")
    source, base = base_source(cfg, version, args)
    fork_tree = cfg.default_fork_dir(version)
    base_tree = cfg.default_base_dir(version)

    # a. the environment, derived from the base itself (its compatibility matrix and requirements)
    _materialize(cfg, version, base_tree, [], source)
    tenv = testenv.ensure(base_tree, version, rebuild=args.rebuild_env, link_dir=cfg.build_dir / "testenv")
    if args.env_only:
        return 0

    # b. the fork tree
    apply_error = None
    if args.as_is:
        if require_tree(fork_tree) != version:
            raise BadInput(f"{fork_tree} is not materialized on {version}")
        print(f"fork test: {fork_tree}: tested as it is (--as-is)")
    else:
        try:
            _materialize(cfg, version, fork_tree, series.read(cfg, version), source)
        except LocalEdits as exc:
            raise LocalEdits(f"{exc}\nOr test the edited tree as it is: `python -m tools.fork test --as-is`.") from None
        except ApplyFailed as exc:
            if args.kernels_only or args.bisect or args.fork_only:
                raise
            apply_error = exc  # the base's suite still runs (and is cached); the fork's cannot

    if args.kernels_only:
        steps = kernel_steps(cfg, tenv, fork_tree, fork_added_test_files(cfg.root))
        for st in steps:
            extra = f" [{_fmt_counts(st.counts)}]" if st.counts else ""
            print(f"  {st.name}: {st.status}{extra} {st.detail}")
        failed = [st.name for st in steps if st.failed]
        print("fork test: FAILED: " + ", ".join(failed) if failed else "fork test: OK")
        return EXIT_FAILED if failed else 0

    exclusions = load_exclusions(cfg.root)
    resolved = resolve_exclusions(exclusions, fork_tree if apply_error is None else base_tree)
    ignores = sorted({p for _, paths in resolved for p in paths})
    for ex, paths in resolved:
        if not paths:
            print(f"fork test: note: {EXCLUSIONS_FILE}:{ex.lineno} {ex.pattern} matches nothing in {fork_tree}")
    if args.bisect:
        return bisect(cfg, tenv, base, ignores, source)
    pytest_args = ut_pytest_args(ignores, args.keyword, args.pytest_args or [])
    print(f"fork test: excluding {len(ignores)} path(s) routed to NPU runners ({EXCLUSIONS_FILE})")

    # c. the base (cached) and the fork
    key = base_cache_key(base.sha256, tenv, pytest_args)
    cache = tenv.results_dir / f"base-{version}-{key[:16]}.xml"
    base_run = load_cached(cache)
    if base_run is not None:
        print(f"fork test: [base] results cached ({cache.name}; base, environment and selection unchanged)")
    elif not args.fork_only:
        base_run = run_suite(tenv, base_tree, version, "base", pytest_args, results_dir(cfg))
        store_cached(base_run, cache)
    if apply_error is not None:
        c = counts(base_run.results)
        print(f"\nfork test: upstream CPU suite on the base {version}: {_fmt_counts(c)} ({base_run.seconds:.0f} s)")
        print(
            f"fork test: FAILED: the series does not apply on {version}: {apply_error}\n"
            f"Move it there with `python -m tools.fork rebase --onto {version}`."
        )
        print(f"total: {c['passed']} passed, {c['failed'] + c['error']} failed, {c['skipped'] + c['xfailed']} skipped")
        return EXIT_FAILED
    narrowed = pytest_args != ut_pytest_args(ignores, None, [])
    full_cache = (
        tenv.results_dir
        / f"base-{version}-{base_cache_key(base.sha256, tenv, ut_pytest_args(ignores, None, []))[:16]}.xml"
    )
    if base_run is None and args.fork_only and not (narrowed and full_cache.exists()):
        print("fork test: [base] skipped (--fork-only, no cached base results): no base comparison")
    fork_run = run_suite(tenv, fork_tree, version, "fork", pytest_args, results_dir(cfg))
    if base_run is None and args.fork_only and narrowed:
        full = load_cached(full_cache)
        if full is not None:
            # The cached full base run, restricted to the tests this narrowed selection ran.
            full.results = {tid: r for tid, r in full.results.items() if tid in fork_run.results}
            base_run = full
            print(f"fork test: [base] cached full base run ({full_cache.name}), restricted to this selection")

    # d. compare
    added = fork_added_test_files(cfg.root)
    excluded_files = {f for f in added if any(f == p or f.startswith(p + "/") for p in ignores)}
    ut_added = [f for f in added if f.startswith(UT_DIR + "/")]
    if narrowed:
        # a narrowed selection need not include every added file
        ut_added = [f for f in ut_added if any(r.file == f for r in fork_run.results.values())]
    cmp = compare(base_run.results if base_run else None, fork_run.results, ut_added, excluded_files)
    print_side_by_side(base_run, fork_run, version)
    print_comparison(cmp, base_run is not None)

    steps = kernel_steps(cfg, tenv, fork_tree, added)
    # g. the tooling's own tests (they do not depend on the base: `make test` runs them once)
    if args.no_tooling_tests:
        steps.append(Step("tooling tests", "none", "(--no-tooling-tests)"))
    else:
        junit = results_dir(cfg) / "tooling.xml"
        junit.unlink(missing_ok=True)
        steps.append(_run_step("tooling tests", *tooling_test_command(tenv, cfg.root, junit), junit))

    # h. deploy into a pip-installed (non-editable) vllm-ascend, test it there, verify, revert
    if not args.fork_only and all(b.version != version for b in cfg.bases):
        steps.append(Step("deploy check", "none", f"{version} is not a base in fork.toml"))
    elif not args.fork_only:
        from tools.fork import deploy_check

        t0 = time.monotonic()
        try:
            res = deploy_check.check(cfg, tenv.python, version=version)
            steps.append(Step("deploy check", "passed", f"({time.monotonic() - t0:.0f} s)", Counter(res.tests)))
        except BadInput as exc:  # the series changes nothing under vllm_ascend/
            steps.append(Step("deploy check", "none", str(exc)))
        except ForkError as exc:
            steps.append(Step("deploy check", "FAILED", str(exc)))

    # summary
    cf = counts(fork_run.results)
    problems = verdict(cmp, steps)
    print("\nfork test: summary")
    line = f"fork {_fmt_counts(cf)}"
    if base_run:
        line = f"base {_fmt_counts(counts(base_run.results))} | " + line
    print(f"  upstream CPU suite: {line}")
    n_kernel = sum(f.startswith(KERNEL_TEST_DIR + "/") for f in added)
    print(f"  fork-added test files: {len(added)} ({len(ut_added)} in {UT_DIR}, {n_kernel} kernel op)")
    for s in steps:
        extra = f" [{_fmt_counts(s.counts)}]" if sum(s.counts.values()) else ""  # no junit: no made-up zeros
        print(f"  {s.name}: {s.status}{extra} {s.detail}")
    print(f"  wall time: {time.monotonic() - t_start:.0f} s")
    total = cf.copy()
    for s in steps:
        total.update(s.counts)
    if problems:
        print("fork test: FAILED: " + "; ".join(problems))
    else:
        print("fork test: OK")
    # One closing line in the form CI reads: 'N passed, N failed' (failed counts errors too). Upstream
    # tests that are broken on the base as well are the release's own: named apart, not as the fork's.
    broken_on_base = 0
    if base_run is not None:
        broken_on_base = sum(
            1
            for tid, r in fork_run.results.items()
            if r.outcome in BROKEN and tid in base_run.results and base_run.results[tid].outcome in BROKEN
        )
    failed_total = total["failed"] + total["error"] - broken_on_base
    upstream_own = f" ({broken_on_base} broken on the base {version} too)" if broken_on_base else ""
    print(
        f"total: {total['passed']} passed, {failed_total} failed, {total['skipped'] + total['xfailed']} skipped"
        + upstream_own
    )
    return EXIT_FAILED if problems else 0
