"""Stress the fused Mamba postprocess kernel's in-place conv shift for races on a GPU.

    python benchmarks/stress_fused.py --tree build/fork --json fused_stress.json
    python benchmarks/stress_fused.py --tree build/base-0.30.0rc2  # the unpatched kernel: the control, must fail
    python benchmarks/stress_fused.py --smoke                      # CPU (Triton interpreter): tiny sizes

Every request shifts its conv state in place by 1..3 tokens (`state[blk, bias:] -> state[blk, :width - bias]`)
over long rows with small shifts and many warps: the geometry in which an unordered copy races on a GPU. Per
case (SD and DS layout; "long": ~32 KiB of shifted bytes a request, "model": GDN-like 3 x 8192 tokens or dim
rows), warps and temporal tiles: 256 requests, 3 trials, every state byte checked against torch copies of a
snapshot. The op test (upstream's test_postprocess_mamba.py, the series' cases) runs each case once, with the
kernel's default warps; under the Triton interpreter, which runs a program's lanes in lock-step, it cannot
show a race. This script is where the warps vary. Exit 1 when any case differs from the oracle.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, device_name, now, select_device, synchronize, versions  # noqa: E402
from tools.kernel_harness import loader  # noqa: E402

BLOCK_SIZE, NUM_COLS = 16, 5  # the running state in column 1; its speculative temporal states after it
# (layout, name): conv width, conv dim, dtype name
CASES = {
    ("sd", "long"): (2049, 4, "float32"),
    ("sd", "model"): (3, 8192, "bfloat16"),
    ("ds", "long"): (8196, 2, "float32"),
    ("ds", "model"): (3, 8192, "bfloat16"),
}


def run_case(kernel, torch, device, width, dim, dtype, ds, requests, tiles, warps, seed) -> int:
    """One launch in which every request shifts in place; returns the number of requests with a wrong byte."""
    gen = torch.Generator().manual_seed(seed)
    blocks = requests * NUM_COLS
    conv_shape = (blocks, dim, width) if ds else (blocks, width, dim)
    conv = torch.randn(conv_shape, generator=gen).to(dtype).to(device)
    temporal = torch.randn((blocks, 8), generator=gen).to(device)
    table = torch.randperm(blocks, generator=gen).to(torch.int32).view(requests, NUM_COLS).to(device)
    bias = [1 + r % min(3, width - 1) for r in range(requests)]
    before_conv, before_temporal = conv.cpu().clone(), temporal.cpu().clone()
    expected_conv, expected_temporal = before_conv.clone(), before_temporal.clone()
    for r, b in enumerate(bias):
        blk = int(table[r, 1])
        if ds:
            expected_conv[blk, :, : width - b] = before_conv[blk, :, b:]
        else:
            expected_conv[blk, : width - b] = before_conv[blk, b:]
        expected_temporal[blk] = before_temporal[int(table[r, 1 + b])]

    def t(values, dt=torch.int64):
        return torch.tensor(values, dtype=dt, device=device)

    states = [conv, temporal]
    kernel[(requests, 2, tiles)](
        t([b + 1 for b in bias], torch.int32),  # accepted: the running state stays in column 1, shifted by b
        t([1] * requests, torch.int32),
        None,
        t([2 * BLOCK_SIZE] * requests, torch.int32),  # PRECOMPUTED_NEW_COMPUTED: aligned at column 1
        None,
        t([table.data_ptr()]),
        table.stride(0),
        t([s.data_ptr() for s in states]),
        t([s.stride(0) * s.element_size() for s in states]),
        t([s.element_size() for s in states], torch.int32),
        t([1 if ds else dim, 8]),
        t([width, 0], torch.int32),
        t([0, 0], torch.int32),
        t([dim if ds else 0, 0], torch.int32),
        t([conv.stride(1) * conv.element_size() if ds else 0, 0]),
        t([0] * requests, torch.int32),
        None,
        requests,
        block_size=BLOCK_SIZE,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=ds,
        PRECOMPUTED_NEW_COMPUTED=True,
        TEMPORAL_TILES=tiles,
        num_warps=warps,
    )
    synchronize(device)
    bad_conv = (conv.cpu() != expected_conv).flatten(1).any(1)
    bad_temporal = (temporal.cpu() != expected_temporal).any(1)
    return int(sum(bool(bad_conv[int(table[r, 1])] | bad_temporal[int(table[r, 1])]) for r in range(requests)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default=str(ROOT / "build" / "fork"), help="the vllm-ascend tree whose kernel runs")
    p.add_argument("--warps", default="4,16")
    p.add_argument("--tiles", default="1,4")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny rows, 3 requests, 1 trial (the CPU interpreter)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tree = Path(args.tree).resolve()
    loader.setup(loader.split_roots(str(tree)))
    import torch

    from vllm_ascend.ops.triton.mamba.postprocess import postprocess_mamba_fused_kernel as kernel

    device = select_device()
    requests, trials = (3, 1) if args.smoke else (args.requests, args.trials)
    rows, status = [], 0
    for (layout, name), (width, dim, dtype) in CASES.items():
        if args.smoke:
            width, dim = min(width, 9), min(dim, 40)
        for warps in map(int, args.warps.split(",")):
            for tiles in map(int, args.tiles.split(",")):
                wrong = [
                    run_case(kernel, torch, device, width, dim, getattr(torch, dtype), layout == "ds",
                             requests, tiles, warps, seed=trial)
                    for trial in range(trials)
                ]  # fmt: skip
                failed = sum(w > 0 for w in wrong)
                status |= failed > 0
                rows.append(dict(layout=layout, case=name, warps=warps, tiles=tiles, trials=trials, failed=failed,
                                 wrong_requests=wrong))  # fmt: skip
                print(f"{layout}-{name:5s} warps={warps:2d} tiles={tiles}: {failed} of {trials} trials wrong {wrong}")
    if args.json:
        record = dict(date=now(), device=device_name(device), tree=str(tree), versions=versions(), rows=rows)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
