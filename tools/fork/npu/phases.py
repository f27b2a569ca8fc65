"""The phases of an NPU report: what each runs, under which limit, and how its outcome is judged.

PHASES is the table. A phase is one or more runs (a pytest session or a benchmark script, each in a
process of its own) on the fork's kernels and, where there is one, on a control that must go wrong
(the unpatched base's kernels, or the grouped copy without its hazard fallback). A phase whose
script this checkout lacks is reported as not available, not run. `evidence_for` names the upstream
files whose patches the phase gives evidence for (report.py maps phases to patches through them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.npu.plan import Plan
from tools.fork.testing.junit import JUNIT_FAMILY, Result, parse_junit

OK, FAILED, NO_CONTROL = "ok", "FAILED", "control did not fail"
TIMED_OUT, INTERRUPTED, UNAVAILABLE, NOT_RUN = "timed out", "interrupted", "not available in this checkout", "not run"
BUDGET_SPENT = "not run: the budget was spent"

# How each device runs the op tests, which are written for device "npu" (upstream's way).
NPU_MAPPING = {
    "npu": [],  # torch_npu is there
    "cuda": ["-p", "benchmarks.npu_as_cuda"],  # the NPU mapped to the GPU
    "cpu": ["--npu-on-cpu"],  # the NPU mapped to the CPU, kernels under the Triton interpreter
}


@dataclass
class Context:
    root: Path  # this repository (tools/, benchmarks/)
    plan: Plan
    device: str  # npu, cuda or cpu
    python: str  # the Python with torch (and torch_npu / triton-ascend on an NPU) that runs the phases
    out: Path
    env: dict[str, str]
    smoke: bool  # the CPU's small mode
    max_tests_per_file: int = 0  # 0: every test
    bench_args: list[str] = field(default_factory=list)

    def tree(self, label: str) -> str:
        return self.plan.fork_tree if label == "fork" else self.plan.base_tree


@dataclass
class Run:
    label: str  # file name stem of its log / JSON: "fork", "base", ...
    argv: list[str]
    control: bool = False  # must go wrong
    json: Path | None = None
    junit: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # beside the phase's environment


@dataclass
class RunResult:
    label: str
    control: bool
    returncode: int | None  # None: it did not finish
    seconds: float
    log: str
    stopped: str = ""  # TIMED_OUT or INTERRUPTED
    data: object = None  # its JSON
    tests: dict[str, Result] = field(default_factory=dict)  # its junit results


@dataclass
class PhaseResult:
    name: str
    status: str
    summary: str
    seconds: float = 0.0
    runs: list[RunResult] = field(default_factory=list)
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    what: str
    script: str | None  # the file this phase needs in the repository (None: pytest on the plan's files)
    timeout_s: int
    evidence_for: tuple[str, ...]
    runs: Callable[[Context], list[Run]]
    judge: Callable[[Context, list[RunResult]], tuple[str, str, dict]]
    default: bool = True
    on_cpu: bool = True  # False: too large for the interpreter, not run in the small mode


# --- running --------------------------------------------------------------------------------------

_stop_requested: list[int] = []  # the signal that asked to stop


def request_stop(signum, _frame=None) -> None:
    _stop_requested.append(signum)


def reset_stop() -> None:
    _stop_requested.clear()


def stop_requested() -> bool:
    return bool(_stop_requested)


def _kill(proc: subprocess.Popen) -> None:
    """End a run and everything it started (it leads its own process group)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def execute(ctx: Context, phase: str, run: Run, deadline: float) -> RunResult:
    """One run with its output in OUT/logs/PHASE-LABEL.log, stopped at `deadline` or on a signal."""
    log = ctx.out / "logs" / f"{phase}-{run.label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    stopped = ""
    with log.open("w") as f:
        f.write("$ " + " ".join(run.argv) + "\n")
        f.flush()
        env = {**ctx.env, **run.env}
        proc = subprocess.Popen(
            run.argv, cwd=ctx.root, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches us alone: we end the run and keep the rest
        )  # fmt: skip
        while proc.poll() is None:
            if stop_requested():
                stopped = INTERRUPTED
            elif time.monotonic() > deadline:
                stopped = TIMED_OUT
            if stopped:
                _kill(proc)
                break
            time.sleep(0.1)
    result = RunResult(run.label, run.control, None if stopped else proc.returncode, time.monotonic() - t0,
                       str(log.relative_to(ctx.out)), stopped)  # fmt: skip
    if run.json is not None and run.json.is_file():
        with contextlib.suppress(ValueError):
            result.data = json.loads(run.json.read_text())
    if run.junit is not None and run.junit.is_file():
        with contextlib.suppress(Exception):  # a junit file cut short by a kill
            result.tests = parse_junit(run.junit.read_text())
    return result


def run_phase(ctx: Context, spec: PhaseSpec, limit_s: float) -> PhaseResult:
    """Every run of a phase under one limit; judged when all finished."""
    if spec.script is not None and not (ctx.root / spec.script).is_file():
        return PhaseResult(spec.name, UNAVAILABLE, f"{spec.script} is not in this checkout")
    if ctx.smoke and not spec.on_cpu:
        return PhaseResult(spec.name, NOT_RUN, "needs a device: too large for the Triton interpreter")
    runs = spec.runs(ctx)
    if not runs:
        return PhaseResult(spec.name, NOT_RUN, "nothing to run: the series has no file for it")
    t0 = time.monotonic()
    deadline = t0 + limit_s
    results = []
    for run in runs:
        results.append(execute(ctx, spec.name, run, deadline))
        if results[-1].stopped:
            break
    seconds = time.monotonic() - t0
    stopped = next((r for r in results if r.stopped), None)
    if stopped is not None:
        why = f"{stopped.label} run {stopped.stopped} after {stopped.seconds:.0f} s (limit {limit_s:.0f} s)"
        done = [r.label for r in results if not r.stopped]
        why += f"; finished: {', '.join(done)}" if done else ""
        return PhaseResult(spec.name, stopped.stopped, why, seconds, results)
    status, summary, details = spec.judge(ctx, results)
    return PhaseResult(spec.name, status, summary, seconds, results, details)


# --- pytest phases --------------------------------------------------------------------------------


def pytest_argv(ctx: Context, kernels: str, files: list[str], junit: Path, plugins=()) -> list[str]:
    tests = ctx.plan.tests_tree
    return [
        ctx.python, "-m", "pytest", "-q", "-rfE", "--tb=short", "--noconftest", "-p", "tools.kernel_harness.plugin",
        *NPU_MAPPING[ctx.device], *plugins, *_first_tests(ctx), "-p", "no:cacheprovider", "-o", JUNIT_FAMILY,
        f"--junitxml={junit}", f"--rootdir={tests}", f"--kernel-tree={kernels}", "--continue-on-collection-errors",
        *(str(Path(tests) / f) for f in files),
    ]  # fmt: skip


def _first_tests(ctx: Context) -> list[str]:
    """The small mode: the first tests of each file (chosen by each session from its own collection)."""
    n = ctx.max_tests_per_file
    return ["-p", "tools.fork.npu.first_tests", f"--first-tests-per-file={n}"] if n else []


def _op_test_runs(ctx: Context) -> list[Run]:
    """On a device one process per tree and file: a kernel that goes wrong on the base can leave a sticky
    device error (the base's precopy kernel's misaligned access on a GPU) that fails whatever runs after it
    in its process. The small mode runs each tree's files in one process (start-up is most of its time)."""
    files = ctx.plan.op_tests
    groups = [files] if ctx.smoke else [[f] for f in files]
    runs = []
    for label in ("fork", "base"):
        for group in groups if files else []:
            name = label if ctx.smoke else f"{label}-{Path(group[0]).stem}"
            xml = ctx.out / "logs" / f"op-tests-{name}.xml"
            runs.append(Run(name, pytest_argv(ctx, ctx.tree(label), group, xml), control=label == "base", junit=xml))
    return runs


def per_file(results: dict[str, Result]) -> dict[str, dict[str, int]]:
    out: dict[str, Counter] = {}
    for r in results.values():
        out.setdefault(r.file, Counter())[r.outcome] += 1
    return {f: dict(c) for f, c in sorted(out.items())}


def _judge_op_tests(ctx: Context, runs: list[RunResult]):
    fork = {t: r for run in runs if not run.control for t, r in run.tests.items()}
    base = {t: r for run in runs if run.control for t, r in run.tests.items()}
    bad = {t for t, r in fork.items() if r.outcome in ("failed", "error")}
    base_bad = {t for t, r in base.items() if r.outcome in ("failed", "error")}
    broken_both = sorted(bad & base_bad)  # the environment's, not the series' (e.g. an operator missing here)
    regressions = sorted(bad - base_bad)
    # the race proof: tests that pass on the fork and fail on the base's kernels (a failure, not an import error)
    caught = sorted(t for t, r in base.items() if r.outcome == "failed" and t in fork and fork[t].outcome == "passed")
    details = {
        "fork": per_file(fork),
        "base": per_file(base),
        "regressions": regressions,
        "broken_on_both": broken_both,
        "caught_on_base": caught,
    }
    passed = sum(1 for r in fork.values() if r.outcome == "passed")
    summary = f"fork: {passed} passed, {len(bad)} failed or errors of {len(fork)}; base kernels: {len(caught)} fail"
    summary += f" where the fork passes; {len(broken_both)} fail on both (not judged)" if broken_both else ""
    if not fork:
        return FAILED, "the fork's run reported no test (see its log)", details
    if regressions:
        return FAILED, summary + f"; {len(regressions)} fail on the fork only", details
    if not caught:
        return NO_CONTROL, summary + ": the base's kernels pass every test the fork passes", details
    return OK, summary, details


def _grouped_runs(ctx: Context) -> list[Run]:
    specs = ["-p", "benchmarks.vllm_copy_specs"]  # vLLM's copy functions, or models of them without vLLM
    files = ctx.plan.grouped_copy_tests
    if not files:
        return []
    xml = {k: ctx.out / "logs" / f"grouped-copy-{k}.xml" for k in ("fork", "no-fallback")}
    return [
        Run("fork", pytest_argv(ctx, ctx.plan.fork_tree, files, xml["fork"], specs), junit=xml["fork"]),
        # benchmarks/mutations.py: the grouped copy with its interaction check (the hazard fallback) removed
        Run("no-fallback", pytest_argv(ctx, ctx.plan.fork_tree, files, xml["no-fallback"],
                                       [*specs, "-p", "benchmarks.mutations"]),
            control=True, junit=xml["no-fallback"], env={"MAMBA_COPY_MUTATION": "no_interaction_check"}),
    ]  # fmt: skip


def _judge_grouped(ctx: Context, runs: list[RunResult]):
    fork, control = (Counter(r.outcome for r in run.tests.values()) for run in runs)
    details = {"fork": dict(fork), "no_hazard_fallback": dict(control)}
    summary = (
        f"fork: {fork['passed']} passed, {fork['failed'] + fork['error']} failed; without the hazard fallback "
        f"(control): {control['failed']} of {sum(control.values())} fail"
    )
    if not fork["passed"] or fork["failed"] or fork["error"]:
        return FAILED, summary, details
    return (OK if control["failed"] else NO_CONTROL), summary, details


# --- scripts --------------------------------------------------------------------------------------


def _script_run(ctx: Context, phase: str, script: str, label: str, args: list[str], control=False) -> Run:
    out = ctx.out / "json" / f"{phase}-{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return Run(label, [ctx.python, script, *args, "--json", str(out)], control=control, json=out)


def _total(data, key: str) -> int:
    """A JSON document's count `key`: an object's own `key` where it has one (a total), else the sum over
    what it holds, however nested (per-record counts)."""
    if isinstance(data, dict):
        if isinstance(data.get(key), int):
            return data[key]
        return sum(_total(v, key) for v in data.values())
    if isinstance(data, list):
        return sum(_total(v, key) for v in data)
    return 0


def _fork_and_base(script: str, smoke_args: list[str], device_args: list[str], device_flag=True):
    def runs(ctx: Context) -> list[Run]:
        args = smoke_args if ctx.smoke else device_args
        dev = ["--device", ctx.device] if device_flag else []
        phase = _phase_of(script)
        return [
            _script_run(ctx, phase, script, label, ["--tree", ctx.tree(label), *dev, *args], control=label == "base")
            for label in ("fork", "base")
        ]

    return runs


def _judge_by_total(key: str, unit: str):
    def judge(ctx: Context, runs: list[RunResult]):
        fork, base = runs
        wrong = {r.label: (_total(r.data, key) if r.data is not None else None) for r in runs}
        details = {"wrong": wrong, "unit": unit, "fork_exit": fork.returncode, "base_exit": base.returncode}
        summary = f"fork: {wrong['fork']} {unit} (exit {fork.returncode}); base (control): {wrong['base']} {unit}"
        if wrong["fork"] is None or wrong["base"] is None:
            return FAILED, summary + ": a run wrote no JSON (see its log)", details
        if wrong["fork"] or fork.returncode:
            return FAILED, summary, details
        return (OK if wrong["base"] else NO_CONTROL), summary, details

    return judge


def _memmove_runs(ctx: Context) -> list[Run]:
    args = ["--smoke"] if ctx.smoke else ["--pairs", "100000", "--trials", "2"]
    script = "benchmarks/stress_memmove.py"
    trees = ["--tree", ctx.plan.fork_tree, "--base-tree", ctx.tree("base")]  # the base's kernel: the control
    return [_script_run(ctx, "stress-memmove", script, "fork", [*trees, "--device", ctx.device, *args])]


def memmove_stress_numbers(records) -> dict:
    """The memmove kernel's errors and the unguarded control's corrupted rows in stress_memmove.py's records."""
    records = records or []
    memmove_bad = sum(
        r.get("mismatched_pairs", 0)
        + r.get("changed_bytes_outside_destinations", 0)
        + (r.get("corrupted_rows", 0) if r.get("kernel") == "memmove" else 0)
        for r in records
    )
    pairs = sum(r.get("pairs", 0) for r in records if r.get("test") == "random_pairs")
    rows = {k: [0, 0] for k in ("memmove", "unguarded")}
    for r in records:
        if r.get("kernel") in rows:
            rows[r["kernel"]][0] += r.get("corrupted_rows", 0)
            rows[r["kernel"]][1] += r.get("rows_total", 0)
    return {"memmove_errors": memmove_bad, "random_pairs": pairs, "rows": rows}


def _judge_memmove(ctx: Context, runs: list[RunResult]):
    (run,) = runs
    n = memmove_stress_numbers(run.data)
    mm, ug = n["rows"]["memmove"], n["rows"]["unguarded"]
    summary = (
        f"memmove: {n['memmove_errors']} errors over {n['random_pairs']} random pairs and {mm[1]} shifted rows; "
        f"unguarded batch_memcpy_kernel (control): {ug[0]} of {ug[1]} rows corrupted"
    )
    if run.data is None:
        return FAILED, "no JSON written (see its log)", n
    if n["memmove_errors"] or run.returncode:
        return FAILED, summary, n
    return (OK if ug[0] else NO_CONTROL), summary, n


def _copy_paths_runs(ctx: Context) -> list[Run]:
    args = ["--device", ctx.device, "--tree", ctx.plan.fork_tree, "--backends", ",".join(BENCH_BACKENDS),
            "--png", str(ctx.out / "copy_paths.png")]  # fmt: skip
    return [_script_run(ctx, "copy-paths", "benchmarks/copy_paths.py", "fork",
                        [*args, *(["--smoke"] if ctx.smoke else []), *ctx.bench_args])]  # fmt: skip


BENCH_BACKENDS = ("torch", "torch_clone", "memmove")


def bench_table(records) -> dict:
    """{layout: {requests: {backend: median ms}}} of copy_paths.py's device records."""
    out: dict = {}
    for r in records or []:
        if r.get("backend") in BENCH_BACKENDS and "layout" in r and r.get("device") != "host cpu":
            out.setdefault(r["layout"], {}).setdefault(str(r["requests"]), {})[r["backend"]] = r["median_ms"]
    return out


def _judge_copy_paths(ctx: Context, runs: list[RunResult]):
    (run,) = runs
    records = run.data or []
    wrong = sorted({f"{r['backend']} ({r.get('layout')}, {r.get('requests')})" for r in records
                    if r.get("correct") is False})  # fmt: skip
    table = bench_table(records)
    details = {"median_ms": table, "wrong": wrong}
    if not table:
        return FAILED, "no timing records (see its log)", details
    layouts = ", ".join(table)
    summary = f"{len(records)} records, layouts {layouts}"
    if wrong:
        return FAILED, summary + f"; wrong copies: {', '.join(wrong)}", details
    return OK, summary + "; every copy exact", details


def _exit_zero(ctx: Context, runs: list[RunResult]):
    bad = [r.label for r in runs if r.returncode]
    summary = ", ".join(f"{r.label}: exit {r.returncode}" for r in runs)
    return (FAILED if bad else OK), summary, {}


def _phase_of(script: str) -> str:
    return next(p.name for p in PHASES if p.script == script)


POSTPROCESS = "vllm_ascend/ops/triton/mamba/postprocess.py"
PRECOPY = "vllm_ascend/ops/triton/v2/mamba/precopy.py"
MEMMOVE = "vllm_ascend/ops/triton/batch_memmove.py"
MEMCPY = "vllm_ascend/ops/triton/batch_memcpy.py"
GROUPS = "vllm_ascend/worker/mamba_copy_groups.py"

PHASES: list[PhaseSpec] = [
    PhaseSpec(
        "op-tests", "the series' op tests and upstream's op tests of the modules it changes, on the fork's "
        "kernels and on the base's", None, 300, (), _op_test_runs, _judge_op_tests,
    ),
    PhaseSpec(
        "grouped-copy", "the grouped copy's oracle tests (the default `torch` path) on the device, and without its "
        "hazard fallback (control)", None, 120, (GROUPS,), _grouped_runs, _judge_grouped,
    ),
    PhaseSpec(
        "stress-batch-memcpy", "race stress of batch_memcpy_kernel's left-overlap guard (the base's kernel: control)",
        "benchmarks/stress_batch_memcpy.py", 150, (MEMCPY,),
        _fork_and_base("benchmarks/stress_batch_memcpy.py", ["--smoke"], ["--trials", "5"]),
        _judge_by_total("corrupted_rows", "corrupted rows"),
    ),
    PhaseSpec(
        "stress-memmove", "race stress of the memmove kernel against numpy memmove (the unguarded kernel: control)",
        "benchmarks/stress_memmove.py", 180, (MEMMOVE,), _memmove_runs, _judge_memmove,
    ),
    PhaseSpec(
        "stress-fused", "race stress of the fused postprocess kernel's in-place conv shift (the base's kernel: "
        "control)", "benchmarks/stress_fused.py", 180, (POSTPROCESS,),
        _fork_and_base("benchmarks/stress_fused.py", [], [], device_flag=False),
        _judge_by_total("failed", "wrong trials"), on_cpu=False,
    ),
    PhaseSpec(
        "copy-paths", "the copy paths' speed on the layouts the model runners build",
        "benchmarks/copy_paths.py", 240, (MEMMOVE, GROUPS), _copy_paths_runs, _judge_copy_paths,
    ),
    # Not in the report by default (--phases NAME): explorations the GPU ring runs.
    PhaseSpec(
        "fused-bench", "the fused postprocess / precopy kernels' speed, fork against base", "benchmarks/fused_copy.py",
        300, (POSTPROCESS, PRECOPY),
        lambda ctx: [_script_run(ctx, "fused-bench", "benchmarks/fused_copy.py", "fork", [
            "--tree", ctx.plan.fork_tree, "--compare", f"base={Path(ctx.plan.base_tree) / POSTPROCESS}",
            "--precopy-base", str(Path(ctx.plan.base_tree) / PRECOPY)])],
        _exit_zero, default=False,
    ),
    PhaseSpec(
        "micro", "the torch ops a grouped copy is built from", "benchmarks/copy_ops_micro.py", 200, (GROUPS,),
        lambda ctx: [_script_run(ctx, "micro", "benchmarks/copy_ops_micro.py", "fork", [])], _exit_zero,
        default=False,
    ),
    PhaseSpec(
        "plan-time", "where a grouped copy's host time goes, piece by piece", "benchmarks/plan_time.py", 120,
        (GROUPS,),
        lambda ctx: [_script_run(ctx, "plan-time", "benchmarks/plan_time.py", "fork", [
            "--tree", ctx.plan.fork_tree, "--device", ctx.device, *(["--smoke"] if ctx.smoke else [])])],
        _exit_zero, default=False,
    ),
    PhaseSpec(
        "trace", "align-mode trace stress of the copy backends", "benchmarks/align_trace_stress.py", 360,
        (MEMMOVE, GROUPS),
        lambda ctx: [_script_run(ctx, "trace", "benchmarks/align_trace_stress.py", "fork", [
            "--tree", ctx.plan.fork_tree, "--device", ctx.device, "--backends", "unguarded,memmove,torch,dropcopy",
            *(["--smoke"] if ctx.smoke else ["--seconds", "240"])])],
        _exit_zero, default=False,
    ),
]  # fmt: skip
