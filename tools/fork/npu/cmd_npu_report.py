"""The NPU evidence for the series in one folder: op tests, race stress with controls, the copy paths' speed.

On an Ascend host with torch_npu, triton-ascend and the fork's vllm-ascend installed, from a clone of
this repository (`make npu-report` materializes the trees first):

    python3 -m tools.fork npu-report --out npu-report

runs, each phase under a time limit, with a progress line each:
  op-tests             the series' op tests and upstream's e2e op tests of the modules it changes
                       (derived from patches/), on the fork's kernels and on the unpatched base's; the
                       base must fail somewhere the fork passes (the race the series fixes)
  grouped-copy         the default `torch` path's oracle tests; without its hazard fallback they must fail
  stress-batch-memcpy  race stress of batch_memcpy_kernel, fork and base (control)
  stress-memmove       race stress of the memmove kernel against numpy memmove (control: the unguarded kernel)
  stress-fused         race stress of the fused postprocess kernel, fork and base (control)
  copy-paths           the copy paths' speed over the KV-cache layouts the model runners build
and writes one folder (report.md, report.json, the plot, the records, the logs) with the environment,
a verdict on making `memmove` the default, and for each upstream patch the lines for its PR's
"How was this patch tested?" (`pr N --npu-report DIR` puts them in). A phase whose script this
checkout lacks is reported as not available. Ctrl-C, SIGTERM or a phase's time limit keep what finished.

--device cuda runs the same on a CUDA GPU (the NPU mapped to it); --device cpu is a small mode under
the Triton interpreter (a few tests a file, smoke-sized stress and benchmark): it checks the tooling,
not the kernels' concurrency or speed.

For a GPU or NPU host without network access, git or vLLM: `--stage DIR` (a folder of your choice,
e.g. build/npu-stage) copies what the phases need from the trees into DIR with a plan
(npu-plan.json). Copy DIR and this repository's tools/ and benchmarks/ to the host; there
`npu-report --plan DIR/npu-plan.json` runs it (torch, triton, pytest and hypothesis; no vLLM).
"""

from __future__ import annotations

import datetime
import glob
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tools.fork.core.config import ForkConfig, cache_dir
from tools.fork.core.errors import EXIT_FAILED, BadInput, ForkError
from tools.fork.npu import phases as ph
from tools.fork.npu import plan as plans
from tools.fork.npu import report

HELP = __doc__
DEVICES = ("npu", "cuda", "cpu")
SMOKE_TESTS_PER_FILE = 2


def add_arguments(p) -> None:
    p.add_argument("--out", type=Path, default=None, help="the report's folder (default: build/npu-report-DEVICE)")
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="npu",
        help="npu (default); cuda: the NPU mapped to a CUDA GPU; cpu: small mode under the interpreter",
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="the Python that runs the phases: torch (torch_npu, triton-ascend on an NPU), pytest, "
        "hypothesis (default: this one)",
    )
    p.add_argument(
        "--fork-tree",
        help="the fork's kernels: a tree (default build/fork), or `installed`: "
        "the vllm_ascend that --python imports (test files then from build/fork)",
    )
    p.add_argument("--base-tree", help="the unpatched base's kernels (default build/base-PIN: `apply --base-only`)")
    p.add_argument("--plan", type=Path, help="run a plan written by --stage (its trees, no git or registry needed)")
    p.add_argument(
        "--stage",
        type=Path,
        metavar="DIR",
        help="copy the trees' files the phases need into DIR (e.g. build/npu-stage) with its plan, run nothing",
    )
    p.add_argument(
        "--phases",
        help=f"comma-separated, `all` for every one (default: "
        f"{','.join(s.name for s in ph.PHASES if s.default)}; also: "
        f"{','.join(s.name for s in ph.PHASES if not s.default)})",
    )
    p.add_argument(
        "--budget",
        type=float,
        help="seconds for the whole run; a phase gets the smaller of its own limit and what is left",
    )
    p.add_argument(
        "--max-tests-per-file",
        type=int,
        default=None,
        help=f"run the first N tests of each test file (default: all; {SMOKE_TESTS_PER_FILE} on cpu)",
    )
    p.add_argument("--bench-args", default="", help="more arguments for benchmarks/copy_paths.py (e.g. --sweep)")


def _say(msg: str) -> None:
    print(f"fork npu-report: {msg}", flush=True)


def _installed_root(python: str) -> Path:
    code = "import importlib.util as u; s = u.find_spec('vllm_ascend'); s and print(s.submodule_search_locations[0])"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise BadInput(f"--fork-tree installed: {python} has no vllm_ascend (install the fork first, README)")
    return Path(proc.stdout.strip()).parent


def _plan(args, cfg: ForkConfig) -> plans.Plan:
    if args.plan is not None:
        if args.fork_tree or args.base_tree:
            raise BadInput("--plan names the trees: leave out --fork-tree and --base-tree")
        return plans.load(args.plan)
    tests_tree = cfg.default_fork_dir()
    if args.fork_tree == "installed":
        fork_tree = _installed_root(args.python)
    elif args.fork_tree:
        fork_tree = tests_tree = Path(args.fork_tree).resolve()
    else:
        fork_tree = tests_tree
    base_tree = Path(args.base_tree).resolve() if args.base_tree else cfg.default_base_dir()
    if not args.base_tree and not base_tree.is_dir() and (cfg.build_dir / "base").is_dir():
        base_tree = cfg.build_dir / "base"
    return plans.derive(cfg, tests_tree, fork_tree, base_tree)


def _selected(spec: str | None) -> list[ph.PhaseSpec]:
    if not spec:
        return [s for s in ph.PHASES if s.default]
    if spec == "all":
        return list(ph.PHASES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = {s.name: s for s in ph.PHASES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BadInput(f"--phases: unknown phase(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return [known[n] for n in names]


def _phase_env(device: str, python: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        # The test environment keeps Triton for the interpreter apart from its venv (testenv.py): use it
        # when this Python has none.
        probe = subprocess.run([python, "-c", "import triton"], capture_output=True, env=env)
        sites = sorted(glob.glob(str(cache_dir() / "testenv" / "triton-*" / "site")))
        if probe.returncode != 0 and sites:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [sites[-1], env.get("PYTHONPATH")]))
    return env


def _prepare_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: not a folder")
    if out.exists() and any(out.iterdir()) and not (out / "report.json").exists():
        raise BadInput(f"{out} is not empty and holds no NPU report: name an empty or new folder with --out")
    for sub in ("logs", "json"):
        for f in (out / sub).glob("*") if (out / sub).is_dir() else []:
            f.unlink()
    (out / "copy_paths.png").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def _command(args, out: Path) -> str:
    """The command line of this run, for the report."""
    words = ["python3 -m tools.fork npu-report", f"--device {args.device}", f"--out {shlex.quote(str(out))}"]
    for option in ("plan", "fork_tree", "base_tree", "phases", "budget", "max_tests_per_file", "bench_args"):
        value = getattr(args, option)
        if value not in (None, ""):
            words.append(f"--{option.replace('_', '-')} {shlex.quote(str(value))}")
    return " ".join(words)


def run(args, cfg: ForkConfig) -> int:
    if args.max_tests_per_file is not None and args.max_tests_per_file < 0:
        raise BadInput("--max-tests-per-file must be 0 (all) or more")
    selected = _selected(args.phases)
    if shutil.which(args.python) is None:
        raise BadInput(f"--python {args.python}: no such program")
    plan = _plan(args, cfg)
    if args.stage is not None:
        plans.stage(plan, args.stage.resolve())
        rel = os.path.relpath(args.stage.resolve() / plans.PLAN_FILE, cfg.root)
        _say(f"staged {len(plan.op_tests)} op test file(s) and the kernels of both trees in {args.stage}")
        _say(
            f"copy {os.path.dirname(rel) or '.'}/ with tools/ and benchmarks/ to the GPU or NPU host, and run there: "
            f"python3 -m tools.fork npu-report --plan {rel} --device npu (or cuda) --out REPORT_DIR"
        )
        return 0
    out = (args.out or cfg.build_dir / f"npu-report-{args.device}").resolve()
    env = _phase_env(args.device, args.python)
    found = report.probe(args.python, args.device, env, cfg.root)
    if "error" in found:
        hint = {"npu": "; on a CUDA GPU use --device cuda, on a CPU --device cpu"}.get(args.device, "")
        raise ForkError(f"{found['error']}{hint}", EXIT_FAILED)
    _prepare_out(out)
    tests = args.max_tests_per_file
    ctx = ph.Context(
        root=cfg.root, plan=plan, device=args.device, python=args.python, out=out, env=env,
        smoke=args.device == "cpu",
        max_tests_per_file=(SMOKE_TESTS_PER_FILE if args.device == "cpu" else 0) if tests is None else tests,
        bench_args=shlex.split(args.bench_args),
    )  # fmt: skip
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    command = _command(args, out)
    _say(f"{report.environment_line(found)}; {len(plan.op_tests)} op test file(s); report in {out}")
    results: dict[str, ph.PhaseResult] = {}

    def save(status: str) -> None:
        rec = report.record(date=date, device=args.device, command=command, env=found, plan=plan,
                            results=results, status=status)  # fmt: skip
        report.write(out, rec)

    ph.reset_stop()
    previous = {s: signal.signal(s, ph.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    t_start = time.monotonic()
    try:
        for i, spec in enumerate(selected, 1):
            if ph.stop_requested():
                break
            limit = spec.timeout_s
            if args.budget is not None:
                limit = min(limit, args.budget - (time.monotonic() - t_start))
                if limit <= 0:
                    results[spec.name] = ph.PhaseResult(spec.name, ph.BUDGET_SPENT, f"--budget {args.budget:.0f} s")
                    continue
            _say(f"[{i}/{len(selected)}] {spec.name}: {spec.what} (limit {limit:.0f} s)")
            res = ph.run_phase(ctx, spec, limit)
            results[spec.name] = res
            _say(f"[{i}/{len(selected)}] {spec.name}: {res.status} in {res.seconds:.0f} s: {res.summary}")
            save("in progress")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    interrupted = ph.stop_requested()
    for spec in selected:
        results.setdefault(spec.name, ph.PhaseResult(spec.name, ph.NOT_RUN, "the run was interrupted"))
    bad = [r.name for r in results.values() if r.status not in (ph.OK, ph.UNAVAILABLE, ph.NOT_RUN)]
    status = "interrupted" if interrupted else ("complete" if not bad else "complete, with problems")
    save(status)
    v = report.verdict(args.device, results)
    _say(f"verdict: {v.line}")
    _say(f"{status}: {out / 'report.md'}")
    if interrupted:
        _say("interrupted: the phases that finished are in the report")
        return EXIT_FAILED
    return EXIT_FAILED if bad else 0
