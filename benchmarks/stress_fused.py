"""Stress the fused Mamba postprocess kernel's in-place conv shift for races on a GPU.

    python benchmarks/stress_fused.py --tree build/fork --json fused_stress.json
    python benchmarks/stress_fused.py --tree build/base    # the unpatched kernel: the control, expected to fail

Every request shifts its conv state in place by 1..3 tokens (`state[blk, bias:] -> state[blk, :width - bias]`)
over long rows with small shifts and many warps: the geometry in which an unordered copy races on a GPU. Per
case (SD and DS layout; "long": ~32 KiB of shifted bytes a request, "model": GDN-like 3 x 8192 tokens or dim
rows), warps and temporal tiles: 256 requests, 3 trials, each launch checked by the op test's oracles
(tests/e2e/.../test_mamba_state_copy.py: the decision-rule model, and numpy memmove of every pool byte).

The op test runs each case once, with the kernel's default warps: under the Triton interpreter, which runs a
program's lanes in lock-step, it cannot show a race. This script is where the warps vary (moved out of the
upstream-bound test, which has no `num_warps` parameter). The op test module is imported from the tree with
the NPU mapped to this device; its launches get `num_warps` here.
Exit 1 when any case differs from the oracles.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, device_name, now, select_device, versions  # noqa: E402
from tools.kernel_harness import loader  # noqa: E402

OP_TEST = "tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_mamba_state_copy.py"


def load_op_test(tree: Path, device: str):
    """The op test module of `tree`, its `npu` device and synchronize mapped to `device`."""
    import torch

    if not hasattr(torch, "npu"):  # the module asks torch.npu whether to skip, and synchronizes through it
        npu = types.ModuleType("torch.npu")
        npu.is_available = lambda: True
        npu.synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        torch.npu = npu
    # an unpatched base tree has no such test: build/fork's, else the overlay's
    path = next((r / OP_TEST for r in (tree, ROOT / "build" / "fork", ROOT) if (r / OP_TEST).exists()), None)
    if path is None:
        raise SystemExit(f"no {OP_TEST} in {tree}, build/fork or {ROOT}")
    spec = importlib.util.spec_from_file_location("_stress_fused_op_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DEVICE = device
    return module


class WithWarps:
    """`kernel[grid](**kwargs)` launched with `num_warps` (the op test launches with the default)."""

    def __init__(self, kernel, num_warps: int):
        self.kernel, self.num_warps, self.arg_names = kernel, num_warps, kernel.arg_names

    def __getitem__(self, grid):
        return lambda **kwargs: self.kernel[grid](**kwargs, num_warps=self.num_warps)


def cases(t):
    G = t.Geometry
    return {
        ("sd", "long"): G(conv_width=2049, conv_dim=4, conv_dtype=t.torch.float32),
        ("sd", "model"): G(conv_dim=8192),
        ("ds", "long"): G(conv_width=8196, conv_dim=2, conv_dtype=t.torch.float32, ds=True),
        ("ds", "model"): G(conv_dim=8192, ds=True),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default=str(ROOT / "build" / "fork"), help="the vllm-ascend tree whose kernel runs")
    p.add_argument("--warps", default="4,16")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tree = Path(args.tree).resolve()
    loader.setup(loader.split_roots(str(tree)))
    device = select_device()
    t = load_op_test(tree, device)
    kernel = t.postprocess_mamba_fused_kernel
    rows, status = [], 0
    for (layout, name), geo in cases(t).items():
        if layout not in t.LAYOUTS:
            continue
        geo = replace(geo, temporal_shape=(8,), temporal_dtype=t.torch.float32)
        for warps in map(int, args.warps.split(",")):
            t.postprocess_mamba_fused_kernel = WithWarps(kernel, warps)
            for tiles in t.TILES:
                rng = t.random.Random(warps * 10 + tiles)
                wrong = 0
                for trial in range(args.trials):
                    n = args.requests
                    steps = [t.make_step(rng, "shift", geo.block_size, 1 + r % (t.MAX_ACCEPTED - 1)) for r in range(n)]
                    pools = t.Pools(geo, num_rows=n, blocks_per_row=8, seed=trial)
                    try:
                        t.run_postprocess(pools, steps, tiles=tiles, copy_block=1024)
                    except AssertionError as exc:
                        wrong += 1
                        print(f"  {layout}-{name} warps={warps} tiles={tiles} trial {trial}: {str(exc)[:200]}")
                status |= wrong > 0
                rows.append(dict(layout=layout, case=name, warps=warps, tiles=tiles, trials=args.trials, failed=wrong))
                print(f"{layout}-{name:5s} warps={warps:2d} tiles={tiles}: {wrong} of {args.trials} trials wrong")
    if args.json:
        record = dict(date=now(), device=device_name(device), tree=str(tree), versions=versions(), rows=rows)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
