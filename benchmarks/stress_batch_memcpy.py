"""Stress batch_memcpy_kernel's same-pair left shift for races, tree by tree (a GPU; a smoke on the CPU).

    python benchmarks/stress_batch_memcpy.py --tree build/base --tree build/fork --json guard_stress.json

Each tree's `vllm_ascend/ops/triton/batch_memcpy.py` is loaded on its own (the unpatched base is the
control, expected to corrupt on a GPU; the fork carries the left-overlap guard). Every case launches
the kernel once per trial over ROWS rows of 32 KiB, each row moving its bytes [shift:] to
[:row_bytes - shift] inside itself (the align-mode conv-state shift, long rows and small shifts: the
geometry in which lanes of one program drift apart and a fast one stores over source bytes a slow one
has not loaded). Cases: BLOCK_SIZE 8192 (vllm-ascend's) and 1024 (vLLM's), 4 / 8 / 16 warps, shifts
of 1 / 16 / 64 bytes. A row is corrupted when any of its bytes differs from memmove applied to a
snapshot. The JSON holds every case and per-tree totals.

Exit 0 when every case ran, whatever it found (the base is meant to corrupt); 1 on an error (a kernel
that raises); 2 on bad input (a tree without the kernel file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, device_name, now, select_device, synchronize, versions  # noqa: E402
from tools.kernel_harness import loader  # noqa: E402

KERNEL_FILE = Path("vllm_ascend/ops/triton/batch_memcpy.py")
ROW_BYTES = 32 * 1024
ROWS = 2048
BLOCKS = (8192, 1024)
WARPS = (4, 8, 16)
SHIFTS = (1, 16, 64)


@dataclass(frozen=True)
class Case:
    block: int
    warps: int
    shift: int
    rows: int
    row_bytes: int


@dataclass
class Outcome:
    tree: str
    block: int
    warps: int
    shift: int
    rows: int
    row_bytes: int
    trials: int
    corrupted_trials: int
    corrupted_rows: int


def cases(smoke: bool) -> list[Case]:
    if smoke:  # the interpreter: a few small rows, both block sizes, one warp count
        return [Case(block, 4, shift, 4, 4096) for block in BLOCKS for shift in (1, 64)]
    return [Case(block, warps, shift, ROWS, ROW_BYTES) for block in BLOCKS for warps in WARPS for shift in SHIFTS]


def load_kernels(trees: list[Path]) -> dict[str, object]:
    """{label: batch_memcpy_kernel} of every tree, each file loaded as a module of its own."""
    loader.prepare_interpreter_if_needed()
    loader.provide_triton_utils()
    kernels = {}
    for i, tree in enumerate(trees):
        label = tree.name if tree.name not in kernels else str(tree)
        module = loader.load_file(tree / KERNEL_FILE, f"_stress_batch_memcpy_{i}")
        kernels[label] = module.batch_memcpy_kernel
    return kernels


def run_case(torch, kernel, label: str, case: Case, trials: int, device: str) -> Outcome:
    gen = torch.Generator(device="cpu").manual_seed(case.shift * 131 + case.block)
    pristine = torch.randint(0, 256, (case.rows, case.row_bytes), dtype=torch.uint8, generator=gen).to(device)
    want = pristine.clone()
    want[:, : case.row_bytes - case.shift] = pristine[:, case.shift :]
    rows = torch.empty_like(pristine)
    dst = rows.data_ptr() + case.row_bytes * torch.arange(case.rows, dtype=torch.int64)
    src = (dst + case.shift).to(device)
    dst = dst.to(device)
    sizes = torch.full((case.rows,), case.row_bytes - case.shift, dtype=torch.int32, device=device)
    corrupted_trials = corrupted_rows = 0
    for _ in range(trials):
        rows.copy_(pristine)
        kernel[(case.rows,)](src, dst, sizes, BLOCK_SIZE=case.block, num_warps=case.warps)
        synchronize(device)
        bad = int((rows != want).any(dim=1).sum())
        corrupted_rows += bad
        corrupted_trials += bad > 0
    return Outcome(
        label, case.block, case.warps, case.shift, case.rows, case.row_bytes, trials, corrupted_trials, corrupted_rows
    )


def totals(outcomes: list[Outcome]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for o in outcomes:
        t = out.setdefault(o.tree, {"cases": 0, "corrupted_cases": 0, "rows_total": 0, "corrupted_rows": 0})
        t["cases"] += 1
        t["corrupted_cases"] += o.corrupted_rows > 0
        t["rows_total"] += o.rows * o.trials
        t["corrupted_rows"] += o.corrupted_rows
    return out


def parse_trees(values: list[str] | None) -> list[Path]:
    """--tree, repeatable, each value possibly os.pathsep-joined; build/fork by default."""
    return [p for v in values or [str(ROOT / "build" / "fork")] for p in loader.split_roots(v)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", help=f"a vllm-ascend tree (repeatable, or joined with {os.pathsep!r})")
    p.add_argument("--device", default="auto", help="auto (npu, cuda, else the CPU interpreter), or a torch device")
    p.add_argument("--trials", type=int, default=10, help="launches per case (default 10)")
    p.add_argument("--smoke", action="store_true", help="a few small cases (implied on the CPU)")
    p.add_argument("--json", type=Path, help="write every case and per-tree totals here")
    args = p.parse_args(argv)
    if args.trials < 1:
        p.error("--trials must be at least 1")
    trees = parse_trees(args.tree)
    missing = [str(t / KERNEL_FILE) for t in trees if not (t / KERNEL_FILE).is_file()]
    if missing:
        print(f"stress_batch_memcpy: no kernel file {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.device == "cpu":  # the interpreter must be chosen before any kernel module is imported
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        kernels = load_kernels(trees)
    except (ImportError, loader.HarnessError) as exc:  # no triton / torch here, a Triton placeholder
        print(f"stress_batch_memcpy: {exc}", file=sys.stderr)
        return 1
    import torch

    device = select_device(args.device)
    smoke = args.smoke or device == "cpu"
    outcomes = []
    try:
        for label, kernel in kernels.items():
            for case in cases(smoke):
                o = run_case(torch, kernel, label, case, args.trials, device)
                outcomes.append(o)
                print(
                    f"{label}: block={o.block} warps={o.warps:2d} shift={o.shift:2d}: "
                    f"{o.corrupted_rows} of {o.rows * o.trials} rows corrupted "
                    f"({o.corrupted_trials}/{o.trials} trials)",
                    flush=True,
                )
    except Exception as exc:  # a kernel that does not compile or launch: an error, not a finding
        first_line = (str(exc).splitlines() or [""])[0]
        print(f"stress_batch_memcpy: {type(exc).__name__}: {first_line}", file=sys.stderr)
        return 1
    summary = totals(outcomes)
    for label, t in summary.items():
        print(f"total {label}: {t['corrupted_rows']} of {t['rows_total']} rows corrupted in "
              f"{t['corrupted_cases']} of {t['cases']} cases")  # fmt: skip
    if args.json:
        record = {
            "date": now(),
            "device": device_name(device),
            "versions": versions(),
            "smoke": smoke,
            "trees": {label: str(tree) for label, tree in zip(kernels, trees)},
            "corrupted_rows": sum(t["corrupted_rows"] for t in summary.values()),
            "totals": summary,
            "cases": [asdict(o) for o in outcomes],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
