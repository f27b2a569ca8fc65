"""`npu-report` and `pr --npu-report`.

Oracles: the plan's file lists are computed here from the synthetic series' own edits; the verdict
follows its three criteria; phases are fakes (small Python commands writing the records the real
scripts write) except in the one real CPU run, which runs the op tests and the memmove stress of
this repository's trees under the Triton interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tools.fork import cli
from tools.fork.core.config import load
from tools.fork.core.errors import EXIT_BAD_INPUT, EXIT_FAILED
from tools.fork.npu import phases as ph
from tools.fork.npu import plan as plans
from tools.fork.npu import report
from tools.fork.testing.steps import KERNEL_TEST_DIR
from tools.fork.tests.synthetic import UPSTREAM, Fork, const, replace

REPO = Path(__file__).resolve().parents[3]
A = "1.0"
OP_TEST = f"{KERNEL_TEST_DIR}/test_copy_op.py"  # the series' own op test
UPSTREAM_OP_TEST = f"{KERNEL_TEST_DIR}/test_upstream_copy.py"  # upstream's, importing a module the series changes
UNRELATED_OP_TEST = f"{KERNEL_TEST_DIR}/test_other.py"
GROUPS_TEST = "tests/ut/worker/test_mamba_copy_groups.py"

RELEASE = {
    **UPSTREAM,
    UPSTREAM_OP_TEST: "from vllm_ascend.ops.copy import batch_copy\n\ndef test_copy():\n    assert batch_copy\n",
    UNRELATED_OP_TEST: "import vllm_ascend.envs\n\ndef test_other():\n    pass\n",
}
SERIES = [
    (
        "[Ops][BugFix] Guard overlapping copies in batch_copy",
        {
            "vllm_ascend/ops/copy.py": replace(
                "        store(dst[i], data)\n", "        barrier()\n        store(dst[i], data)\n"
            ),
            OP_TEST: const("def test_guarded():\n    pass\n"),
        },
    ),
    (
        "[Ops][Perf] Group copies",
        {
            "vllm_ascend/worker/mamba_copy_groups.py": const("GATHER_BYTES = 1\n"),
            GROUPS_TEST: const("from vllm_ascend.worker import mamba_copy_groups\n\ndef test_groups():\n    pass\n"),
        },
    ),
    ("[Misc][Feature] Alias", {"vllm_ascend/envs.py": replace("}\n", '    "ALIAS": lambda: 0,\n}\n')}),
]


def synthetic(tmp_path, monkeypatch) -> Fork:
    fork = Fork(tmp_path, monkeypatch, {A: RELEASE}, A, [A])
    fork.names = fork.make_series(SERIES, fork_only=(3,))
    fork.ok("apply", "--base-only")
    return fork


def test_plan_is_derived_from_the_series(tmp_path, monkeypatch):
    fork = synthetic(tmp_path, monkeypatch)
    cfg = load(fork.root)
    plan = plans.derive(cfg, fork.tree, fork.tree, cfg.default_base_dir())
    # the series' own op test and upstream's op test of the module patch 1 changes; not the unrelated one
    # (patch 3 changes envs.py, which it imports, but patch 3 is fork-only: it still counts as the series)
    assert OP_TEST in plan.op_tests and UPSTREAM_OP_TEST in plan.op_tests
    assert plan.imports[UPSTREAM_OP_TEST] == ["vllm_ascend/ops/copy.py"]
    assert plan.grouped_copy_tests == [GROUPS_TEST]
    assert [(p.number, p.upstream) for p in plan.patches] == [(1, True), (2, True), (3, False)]
    # staged: a folder with the test files, the touched modules and a plan with relative trees
    staged = plans.stage(plan, tmp_path / "staged")
    again = plans.load(tmp_path / "staged" / plans.PLAN_FILE)
    assert staged.fork_tree == "fork" and again.fork_tree == str((tmp_path / "staged" / "fork").resolve())
    assert (tmp_path / "staged/fork" / OP_TEST).is_file()
    assert (tmp_path / "staged/fork/vllm_ascend/ops/copy.py").read_text() == (
        fork.tree / "vllm_ascend/ops/copy.py"
    ).read_text()
    assert "barrier()" not in (tmp_path / "staged/base/vllm_ascend/ops/copy.py").read_text()
    assert again.op_tests == plan.op_tests
    # a folder it did not write is never emptied
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    r = fork.cli("npu-report", "--stage", str(tmp_path / "mine"))
    assert r.rc == EXIT_BAD_INPUT and (tmp_path / "mine" / "keep.txt").is_file()
    assert fork.ok("npu-report", "--stage", str(tmp_path / "staged")).rc == 0  # its own: written again


def test_no_base_tree_is_one_line(tmp_path, monkeypatch):
    fork = Fork(tmp_path, monkeypatch, {A: RELEASE}, A, [A])
    fork.make_series(SERIES[:1], fork_only=())
    r = fork.cli("npu-report", "--stage", str(tmp_path / "s"))
    assert r.rc == EXIT_BAD_INPUT and "apply --base-only" in r.err and "Traceback" not in r.err


# --- the verdict ----------------------------------------------------------------------------------


def memmove_records(memmove_bad=0, unguarded_bad=5) -> list[dict]:
    return [
        {
            "test": "random_pairs",
            "pairs": 1000,
            "mismatched_pairs": memmove_bad,
            "changed_bytes_outside_destinations": 0,
        },
        {"test": "left_rows", "kernel": "unguarded", "corrupted_rows": unguarded_bad, "rows_total": 100},
        {"test": "left_rows", "kernel": "memmove", "corrupted_rows": 0, "rows_total": 100},
    ]


def bench_records(memmove_ms=(0.1, 0.4, 2.6), torch_ms=(0.4, 1.4, 7.8)) -> list[dict]:
    out = []
    for layout in ("backing", "shared"):
        for n, mm, t in zip((1, 8, 64), memmove_ms, torch_ms):
            for backend, ms in (("memmove", mm), ("torch", t), ("torch_clone", 10 * t)):
                out.append({"backend": backend, "layout": layout, "requests": n, "median_ms": ms, "correct": True,
                            "device": "Ascend910B3"})  # fmt: skip
    return out


def judged(spec_name: str, data) -> ph.PhaseResult:
    spec = next(s for s in ph.PHASES if s.name == spec_name)
    run = ph.RunResult("fork", False, 0, 1.0, "log", data=data)
    status, summary, details = spec.judge(None, [run])
    return ph.PhaseResult(spec_name, status, summary, 1.0, [run], details)


def test_verdict_memmove_when_exact_control_failed_and_faster():
    results = {"stress-memmove": judged("stress-memmove", memmove_records()),
               "copy-paths": judged("copy-paths", bench_records())}  # fmt: skip
    v = report.verdict("npu", results)
    assert v.memmove and not v.reasons and "VLLM_ASCEND_MAMBA_COPY_BACKEND=memmove" in v.line


@pytest.mark.parametrize(
    "stress, bench, why",
    [
        (memmove_records(memmove_bad=1), bench_records(), "memmove exact under stress: no"),
        (memmove_records(unguarded_bad=0), bench_records(), "the unguarded control went wrong: no"),
        (memmove_records(), bench_records(memmove_ms=(0.1, 0.4, 9.0)), "at 64: 9.000 ms against 7.800"),
    ],
)
def test_verdict_keeps_torch_and_says_why(stress, bench, why):
    results = {"stress-memmove": judged("stress-memmove", stress), "copy-paths": judged("copy-paths", bench)}
    v = report.verdict("npu", results)
    assert not v.memmove and v.line.startswith("keep `torch`") and why in v.line


def test_verdict_off_an_npu_keeps_torch():
    results = {"stress-memmove": judged("stress-memmove", memmove_records()),
               "copy-paths": judged("copy-paths", bench_records())}  # fmt: skip
    v = report.verdict("cuda", results)
    assert not v.memmove and "not on an NPU" in v.line
    assert all(met for _, met, _ in v.criteria)  # the criteria themselves were met


# --- whole runs with fake phases ------------------------------------------------------------------


def _write_json(records) -> str:
    return (
        f"import json, sys; open(sys.argv[sys.argv.index('--json') + 1], 'w').write({json.dumps(json.dumps(records))})"
    )


def fake_spec(name, code: str, judge, timeout=30, script=None, control=False) -> ph.PhaseSpec:
    def runs(ctx):
        out = ctx.out / "json" / f"{name}-fork.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        return [ph.Run("fork", [sys.executable, "-c", code, "--json", str(out)], control=control, json=out)]

    real = next((s for s in ph.PHASES if s.name == name), None)
    return ph.PhaseSpec(
        name, real.what if real else name, script, timeout, real.evidence_for if real else (), runs, judge
    )


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    """npu-report on a plan of a synthetic series (stage folder), device 'npu' as the probe reports it."""
    fork = synthetic(tmp_path, monkeypatch)
    fork.ok("npu-report", "--stage", str(tmp_path / "staged"))
    env = {"device": "Ascend910B3", "torch": "2.10.0", "torch_npu": "2.10.0.post4", "CANN": "8.5.0", "driver": "25.2"}
    monkeypatch.setattr(report, "probe", lambda *a, **k: dict(env, **{"triton-ascend": "3.2.0"}))

    def run(*phases: ph.PhaseSpec, extra=()):
        monkeypatch.setattr(ph, "PHASES", list(phases))
        out = tmp_path / "out"
        r = fork.cli("npu-report", "--plan", str(tmp_path / "staged" / plans.PLAN_FILE), "--out", str(out), *extra)
        rec = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
        md = (out / "report.md").read_text() if (out / "report.md").exists() else ""
        return r, rec, md

    run.fork = fork
    return run


def _judge_of(name):
    return next(s for s in ph.PHASES if s.name == name).judge


def test_report_folder_verdict_and_pr_lines(fake_run):
    phases = [
        fake_spec("stress-memmove", _write_json(memmove_records()), _judge_of("stress-memmove")),
        fake_spec("copy-paths", _write_json(bench_records()), _judge_of("copy-paths")),
        fake_spec("stress-batch-memcpy", "", _judge_of("stress-batch-memcpy"), script="benchmarks/no_such_script.py"),
    ]
    r, rec, md = fake_run(*phases)
    assert r.rc == 0, r.text
    assert rec["status"] == "complete" and rec["verdict"]["memmove"]
    assert "`memmove` may become the default on this device: set `VLLM_ASCEND_MAMBA_COPY_BACKEND=memmove`" in md
    assert "| stress-batch-memcpy | not available in this checkout |" in md
    assert "Ascend910B3" in md and "CANN | 8.5.0" in md and "triton-ascend | 3.2.0" in md
    assert "[1/3] stress-memmove: ok" in r.out  # a progress line per phase
    # the lines per upstream patch: patch 1 (ops/copy.py) has no copy-path phase; patch 2 (the grouped copy
    # module) has the benchmark; patch 3 is fork-only
    patches = rec["patches"]
    name1, name2, name3 = fake_run.fork.series()
    assert name3 not in patches and patches[name1]["lines"] == []
    lines2 = "\n".join(patches[name2]["lines"])
    assert lines2.startswith("On an NPU: Ascend910B3") and "`memmove` 0.100 / 0.400 / 2.600" in lines2
    assert "(no phase of this report runs what this patch changes)" in md


def test_a_stress_failure_or_a_quiet_control_keeps_torch(fake_run):
    for records, why in (
        (memmove_records(memmove_bad=3), "FAILED"),
        (memmove_records(unguarded_bad=0), "control did not fail"),
    ):
        phases = [fake_spec("stress-memmove", _write_json(records), _judge_of("stress-memmove")),
                  fake_spec("copy-paths", _write_json(bench_records()), _judge_of("copy-paths"))]  # fmt: skip
        r, rec, md = fake_run(*phases)
        assert r.rc == EXIT_FAILED
        assert rec["phases"][0]["status"] == why and not rec["verdict"]["memmove"]
        assert "keep `torch` (the default)" in md


def test_a_phase_past_its_limit_is_stopped_and_the_others_kept(fake_run):
    phases = [
        fake_spec("stress-memmove", _write_json(memmove_records()), _judge_of("stress-memmove")),
        fake_spec("stress-fused", "import time; time.sleep(60)", _judge_of("stress-fused"), timeout=1),
        fake_spec("copy-paths", _write_json(bench_records()), _judge_of("copy-paths")),
    ]
    r, rec, md = fake_run(*phases)
    status = {p["name"]: p["status"] for p in rec["phases"]}
    assert status == {"stress-memmove": "ok", "stress-fused": "timed out", "copy-paths": "ok"}
    assert r.rc == EXIT_FAILED and rec["status"] == "complete, with problems"
    assert "| stress-fused | timed out |" in md


def test_sigterm_stops_the_run_and_keeps_what_finished(fake_run):
    kill = f"import os, signal, time; os.kill({os.getpid()}, signal.SIGTERM); time.sleep(60)"
    phases = [
        fake_spec("stress-memmove", _write_json(memmove_records()), _judge_of("stress-memmove")),
        fake_spec("stress-fused", kill, _judge_of("stress-fused"), timeout=120),
        fake_spec("copy-paths", _write_json(bench_records()), _judge_of("copy-paths")),
    ]
    handler = signal.getsignal(signal.SIGTERM)
    r, rec, md = fake_run(*phases)
    assert signal.getsignal(signal.SIGTERM) is handler  # given back
    status = {p["name"]: p["status"] for p in rec["phases"]}
    assert status == {"stress-memmove": "ok", "stress-fused": "interrupted", "copy-paths": "not run"}
    assert r.rc == EXIT_FAILED and rec["status"] == "interrupted" and "interrupted" in r.out
    assert (fake_run.fork.tmp / "out" / "logs" / "stress-memmove-fork.log").is_file()


def test_no_npu_is_one_line(tmp_path, monkeypatch):
    fork = synthetic(tmp_path, monkeypatch)
    r = fork.cli("npu-report", "--python", sys.executable, "--out", str(tmp_path / "out"))
    assert r.rc == EXIT_FAILED and len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
    assert ("no NPU" in r.err or "torch is not importable" in r.err) and "--device cuda" in r.err
    assert not (tmp_path / "out").exists()
    r = fork.cli("npu-report", "--python", str(tmp_path / "no-python"), "--device", "cpu")
    assert r.rc == EXIT_BAD_INPUT and "no such program" in r.err and "Traceback" not in r.err


# --- pr --npu-report ------------------------------------------------------------------------------

BODIES = {
    "paragraph": "Text.\n\nCPU only: **no NPU run** of this change. The copy costs 1 ms.\n",
    "bullet": "- **No NPU run.** The kernels ran on a CPU.\n- CPU: 3 passed.\n",
    "sentence": "There has been no run on an NPU: speed is not measured, which is why `torch` stays.\n\n- A test.\n",
    "what": "None of this was run on an NPU: speed and support there are not verified.\n",
}


@pytest.mark.parametrize("kind", BODIES)
def test_pr_text_points_at_the_npu_run_instead_of_saying_there_was_none(kind):
    tested = BODIES[kind]
    body = f"### What this PR does / why we need it?\nA fix.\n\n### How was this patch tested?\n\n{tested}"
    entry = {"lines": ["On an NPU: Ascend910B3 (...)", "", "- stress: 0 errors"]}
    out = report.with_npu_run(body, entry, "2026-12-24T00:00:00Z")
    assert report.NO_NPU_RE.search(out) is None
    assert out.count('The NPU run (2026-12-24) is at the end of "How was this patch tested?".') == 1
    assert out.rstrip().endswith("- stress: 0 errors")
    kept = {"paragraph": "The copy costs 1 ms.", "bullet": "The kernels ran on a CPU.", "sentence": "- A test.",
            "what": "### How was this patch tested?"}[kind]  # fmt: skip
    assert kept in out and "****" not in out


def write_report(folder: Path, device: str, patches: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rec = {"device": device, "date": "2026-12-24T00:00:00Z", "environment": {"device": "X"}, "patches": patches}
    (folder / "report.json").write_text(json.dumps(rec))
    return folder


def test_pr_carries_the_report(tmp_path, monkeypatch):
    fork = synthetic(tmp_path, monkeypatch)
    names = fork.series()
    lines = [
        "On an NPU: Ascend910B3, 2026-12-24:",
        "",
        "- `test_copy_op.py`: 3 passed; on the unpatched kernels 2 failed",
    ]
    entries = {
        names[0]: {"number": 1, "title": SERIES[0][0], "lines": lines},
        names[1]: {"number": 2, "title": SERIES[1][0], "lines": []},
    }
    folder = write_report(tmp_path / "rep", "npu", entries)
    r = fork.ok("pr", "1", "--npu-report", str(folder))
    tested = r.out.split("### How was this patch tested?", 1)[1]
    assert tested.rstrip().endswith(lines[-1]) and "pytest tests/ut (all passed)" in tested
    r = fork.cli("pr", "2", "--npu-report", str(folder))  # the report runs nothing of patch 2
    assert r.rc == EXIT_FAILED and "runs nothing this patch changes" in r.err and r.out == fork.ok("pr", "2").out
    cpu = write_report(tmp_path / "cpu", "cpu", {})
    r = fork.cli("pr", "1", "--npu-report", str(cpu))
    assert r.rc == EXIT_BAD_INPUT and "not an NPU run" in r.err and r.out == ""
    r = fork.cli("pr", "1", "--npu-report", str(tmp_path / "nothing"))
    assert r.rc == EXIT_BAD_INPUT and "no report.json" in r.err


# --- one real run: the CPU's small mode -------------------------------------------------------------


def _cpu_ready() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "this Python has no torch (the test environment has)"
    cfg = load(REPO)
    if not (cfg.default_fork_dir() / "vllm_ascend").is_dir() or not (cfg.default_base_dir() / "vllm_ascend").is_dir():
        return "build/fork or build/base-<pin> missing (python3 -m tools.fork apply; apply --base-only)"
    return None


@pytest.mark.skipif(_cpu_ready() is not None, reason=str(_cpu_ready()))
def test_cpu_small_mode_end_to_end(tmp_path):
    """The op tests (first test of each file, fork and base kernels) and the memmove stress, for real."""
    out = tmp_path / "report"
    rc = cli.main(["npu-report", "--device", "cpu", "--out", str(out), "--phases", "op-tests,stress-memmove",
                   "--max-tests-per-file", "1"])  # fmt: skip
    rec = json.loads((out / "report.json").read_text())
    phases = {p["name"]: p for p in rec["phases"]}
    fork = phases["op-tests"]["details"]["fork"]
    assert set(fork) == set(rec["plan"]["op_tests"])  # every file ran (or reported its error)
    assert sum(c.get("passed", 0) for c in fork.values()) > 0
    assert not phases["op-tests"]["details"]["regressions"]
    memmove = phases["stress-memmove"]
    assert memmove["status"] == "ok", memmove["summary"]  # exact, and the unguarded kernel went wrong
    assert memmove["details"]["memmove_errors"] == 0 and memmove["details"]["rows"]["unguarded"][0] > 0
    assert not rec["verdict"]["memmove"] and "not on an NPU" in rec["verdict"]["line"]
    md = (out / "report.md").read_text()
    assert "small mode under the Triton interpreter" in md and "## Verdict" in md
    assert (out / "logs" / "op-tests-base.xml").is_file() and (out / "json" / "stress-memmove-fork.json").is_file()
    assert rc == (0 if phases["op-tests"]["status"] == "ok" else EXIT_FAILED)


def test_corrupted_rows_a_total_or_the_sum_of_records():
    assert (
        ph._total({"corrupted_rows": 7, "rows": [{"corrupted_rows": 3}, {"corrupted_rows": 4}]}, "corrupted_rows") == 7
    )
    assert ph._total({"trees": {"base": [{"corrupted_rows": 3}, {"corrupted_rows": 4}]}}, "corrupted_rows") == 7
    assert ph._total([{"corrupted_rows": 0}], "corrupted_rows") == 0
