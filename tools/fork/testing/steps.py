"""The checks beside upstream's suite, one Step each: kernel op tests, harness tests, compile, tooling, deploy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.core.errors import BadInput, ForkError
from tools.fork.testing import testenv, venvs
from tools.fork.testing.junit import JUNIT_FAMILY, counts, parse_junit
from tools.fork.testing.suite import results_dir

KERNEL_TEST_DIR = "tests/e2e/nightly/single_node/ops/singlecard_ops/triton"
KERNEL_HARNESS = "tools/kernel_harness"
ASCEND_COMPILE = "tools/kernel_harness/ascend_compile.py"
TOOLING_TESTS = "tools/fork/tests"
# What the unpatched release sends its copy paths, driven by vLLM's real scheduler (docs/root-cause.md).
COPY_AUDIT_TESTS = ["benchmarks/test_copy_audit.py", "benchmarks/table_lifetime.py"]

# Kernel op tests that fail deterministically under the interpreter on a kernel without the series'
# fix, as `pytest -k` expressions per file of the fork's tree (a file the fork adds, or an upstream
# file a patch adds cases to): run against the unpatched base's kernels they must fail, or the CPU
# ring could no longer catch that regression. The DS conv rows with TEMPORAL_TILES > 1: a kernel
# without the tile-0 conv guard shifts them once per tile program (the fused kernels' copy-body
# patch's cases in upstream's test_postprocess_mamba.py). A base whose kernel lacks DS rows or tiles
# has no such case.
BASE_MUST_FAIL = {f"{KERNEL_TEST_DIR}/test_postprocess_mamba.py": "shifts_conv_state_in_place and ds and tiles4"}


@dataclass
class Step:
    name: str
    status: str  # "passed", "FAILED", "none" (nothing to run)
    detail: str = ""
    counts: Counter = field(default_factory=Counter)
    of_the_fork: bool = True  # its counts are the fork's tests (the closing total adds them up)

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


def run_step(
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


def kernel_test_command(tenv: testenv.TestEnv, root: Path, tree: Path, files: list[str], junit: Path):
    """The kernel op tests' command: its own process, the Triton interpreter, the harness plugin, and
    the NPU mapped to the CPU (`--npu-on-cpu`): the op tests are written for an NPU, as upstream's are.

    Returns (argv, env, cwd). Adjust here when tools/kernel_harness changes its interface.
    """
    argv = [
        str(tenv.python), "-m", "pytest", "-q", "-rfE", "--noconftest", "-p", "tools.kernel_harness.plugin",
        "--npu-on-cpu",
        "-p", "no:cacheprovider", "-o", JUNIT_FAMILY, f"--junitxml={junit}", f"--rootdir={tree}",
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


def kernel_op_step(name: str, tenv: testenv.TestEnv, root: Path, tree: Path, files: list[str], junit: Path) -> Step:
    """The kernel op tests `files` of `tree` under the interpreter; none may skip."""
    junit.unlink(missing_ok=True)
    command = kernel_test_command(tenv, root, tree, files, junit)
    return run_step(name, *command, junit, allow_skips=False)


def base_must_fail_step(tenv: testenv.TestEnv, root: Path, base_tree: Path, fork_tree: Path, junit: Path) -> Step:
    """BASE_MUST_FAIL's cases, the fork tree's test files, against the unpatched base's kernels:
    passed when at least one fails there."""
    name = "kernel op tests on the unpatched base (must fail)"
    files = [f for f in BASE_MUST_FAIL if (fork_tree / f).is_file()]
    if not files:
        return Step(name, "none", "the fork's tree has none of the files in steps.BASE_MUST_FAIL")
    junit.unlink(missing_ok=True)
    argv, env, cwd = kernel_test_command(tenv, root, base_tree, [], junit)
    # the fork's versions of the test files (the base has none, or its own): test ids relative to that tree
    argv = [f"--rootdir={fork_tree}" if a.startswith("--rootdir=") else a for a in argv]
    argv += [str(fork_tree / f) for f in files] + ["-k", " or ".join(f"({BASE_MUST_FAIL[f]})" for f in files)]
    argv.append("--tb=no")  # failures are expected here: their names, not their tracebacks
    print(f"\nfork test: [{name}] {' '.join(str(a) for a in argv[:6])} ...", flush=True)
    proc = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL)
    c = counts(parse_junit(junit.read_text())) if junit.exists() else Counter()
    if proc.returncode == 5 or not sum(c.values()):  # pytest: no test collected
        return Step(name, "none", "this base's kernel has none of those cases", c, of_the_fork=False)
    if c["failed"]:
        detail = f"{c['failed']} of {sum(c.values())} fail on the base, as they must"
        return Step(name, "passed", detail, c, of_the_fork=False)
    detail = f"all {sum(c.values())} pass on the unpatched base: the tests no longer catch it"
    return Step(name, "FAILED", detail, c, of_the_fork=False)


def ascend_compile_command(tenv: testenv.TestEnv, root: Path, tree: Path):
    """The triton-ascend front-end compile check (it sets up its own triton-ascend env)."""
    argv = [sys.executable, "-m", ASCEND_COMPILE[:-3].replace("/", "."), f"--tree={tree}"]
    return argv, venvs.run_env(None, {"KERNEL_TREE": str(tree)}), root


def tooling_test_command(tenv: testenv.TestEnv, root: Path, junit: Path):
    argv = [
        str(tenv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", JUNIT_FAMILY,
        f"--junitxml={junit}", TOOLING_TESTS,
    ]  # fmt: skip
    return argv, tenv.env(), root


def kernel_steps(
    cfg, tenv: testenv.TestEnv, fork_tree: Path, added: list[str], base_tree: Path, *, version: str | None = None
) -> list[Step]:
    """The Triton kernel checks: op tests + harness tests under the interpreter, triton-ascend compile;
    their junit files in `version`'s results folder."""
    out = results_dir(cfg, version)
    out.mkdir(parents=True, exist_ok=True)
    steps: list[Step] = []
    # e. kernel op tests under the Triton interpreter
    kernel_files = [f for f in added if f.startswith(KERNEL_TEST_DIR + "/")]
    if not kernel_files:
        steps.append(Step("kernel op tests", "none", f"the fork adds no test under {KERNEL_TEST_DIR}"))
    else:
        steps.append(kernel_op_step("kernel op tests", tenv, cfg.root, fork_tree, kernel_files, out / "kernel.xml"))
    steps.append(base_must_fail_step(tenv, cfg.root, base_tree, fork_tree, out / "kernel-base.xml"))
    # e'. the harness's own tests (loader, and a known-bad kernel the Ascend front end must reject)
    junit = out / "kernel-harness.xml"
    junit.unlink(missing_ok=True)
    argv = [
        str(tenv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", JUNIT_FAMILY,
        f"--junitxml={junit}", f"{KERNEL_HARNESS}/tests",
    ]  # fmt: skip
    env = tenv.env({"PYTHONPATH": f"{cfg.root}{os.pathsep}{tenv.triton_site}"})
    steps.append(run_step("kernel harness tests", argv, env, cfg.root, junit))
    # f. triton-ascend front-end compile check
    steps.append(run_step("triton-ascend compile check", *ascend_compile_command(tenv, cfg.root, fork_tree), None))
    return steps


def copy_audit_step(cfg, tenv: testenv.TestEnv, base_tree: Path, version: str) -> Step:
    """The copy audit's small run on the unpatched base, in the base's own test environment."""
    junit = results_dir(cfg, version) / "copy-audit.xml"
    junit.unlink(missing_ok=True)
    files = [f for f in COPY_AUDIT_TESTS if (cfg.root / f).is_file()]
    argv = [
        str(tenv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", JUNIT_FAMILY,
        f"--junitxml={junit}", *files,
    ]  # fmt: skip
    env = tenv.env({"COPY_AUDIT_TREE": str(base_tree), "HF_HUB_OFFLINE": "1"})
    # table_lifetime.py skips the layerwise case on a base without the layerwise path, and the reverse
    return run_step(
        "copy audit of the base", argv, env, cfg.root, junit, allow_skips=False, may_skip=lambda tid: "layerwise" in tid
    )


def tooling_step(cfg, tenv: testenv.TestEnv, skip: bool) -> Step:
    """The tooling's own tests (they do not depend on the base: `make test` runs them once)."""
    if skip:
        return Step("tooling tests", "none", "(--no-tooling-tests)")
    junit = results_dir(cfg) / "tooling.xml"
    junit.unlink(missing_ok=True)
    return run_step("tooling tests", *tooling_test_command(tenv, cfg.root, junit), junit)


def deploy_step(cfg, tenv: testenv.TestEnv, version: str) -> Step:
    """Deploy into a pip-installed (non-editable) vllm-ascend, test it there, verify, revert."""
    if all(b.version != version for b in cfg.bases):
        return Step("deploy check", "none", f"{version} is not a base in fork.toml")
    from tools.fork.deploy import check as deploy_check

    t0 = time.monotonic()
    try:
        res = deploy_check.check(cfg, tenv.python, version=version)
        return Step("deploy check", "passed", f"({time.monotonic() - t0:.0f} s)", Counter(res.tests))
    except BadInput as exc:  # the series changes nothing under vllm_ascend/
        return Step("deploy check", "none", str(exc))
    except ForkError as exc:
        return Step("deploy check", "FAILED", str(exc))
