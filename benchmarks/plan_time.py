"""Where the host time of a grouped Mamba state copy goes, piece by piece.

    python benchmarks/plan_time.py --device cuda --json out.json     # CUDA or NPU
    python benchmarks/plan_time.py --device cpu --smoke              # CPU, small states

One step of benchmarks/copy_paths.py (its `backing` layout by default) copied by the tree's
`mamba_copy_groups`, with the module's own functions wrapped in timers: each runs once a step,
as in production, with the caches as cold as a step leaves them (a tight loop over one of them
would be several times faster). The device is synchronized between steps, so a step's device time
(events around the call) is its host plan, during which the device waits, plus its kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.copy_paths import CONV_DIM, CONV_ROWS, LAYERS, TEMPORAL_SHAPE, Batch, time_batch  # noqa: E402

WARMUP_STEPS = 5
# The module's functions a step calls (the plan's pieces, then the copies).
PIECES = ("_plan", "_interacting", "_rows", "_direct", "_row_index", "_copy_direct", "_copy_indexed")


def wrap_pieces(module, seconds: dict) -> None:
    """Time every call of the module's PIECES into seconds[name] (a list per name)."""
    for name in PIECES:
        real = getattr(module, name)

        def timed(*args, _real=real, _name=name):
            start = time.perf_counter()
            result = _real(*args)
            seconds[_name].append(time.perf_counter() - start)
            return result

        setattr(module, name, timed)


def measure(torch, device, module, specs, seconds, requests, layout, reps, smoke):
    """One layout and batch size: device and host ms a step, and each piece's ms a step."""
    shapes = (3, 256, (4, 16, 16)) if smoke else (CONV_ROWS, CONV_DIM, TEMPORAL_SHAPE)
    batch = Batch(torch, device, requests, LAYERS, *shapes, layout=layout)
    step = batch.grouped_step(module, specs)
    for _ in range(WARMUP_STEPS):
        step()
    seconds.clear()
    host_ms = []
    step_ms, _ = time_batch(torch, device, lambda _: step(), None, reps, 0, host_ms)
    pieces = {name: statistics.median(seconds[name]) * 1e3 for name in PIECES if seconds[name]}
    return {
        "layout": layout,
        "requests": requests,
        "step_ms": step_ms,
        "host_ms": statistics.median(host_ms),
        "pieces_ms": pieces,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tree", help="kernel tree(s), os.pathsep-separated (default: repo overlay + build/fork)")
    parser.add_argument("--requests", default="1,8,64")
    parser.add_argument("--layout", default="backing")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="small states (CPU)")
    parser.add_argument("--json", default=None, help="write records here")
    args = parser.parse_args(argv)
    kernels = common.setup_kernels(args.tree)
    import torch

    device = common.select_device(args.device)
    module, specs = kernels["copy_groups"], kernels["copy_specs"]
    seconds = collections.defaultdict(list)
    wrap_pieces(module, seconds)
    records = []
    for requests in map(int, args.requests.split(",")):
        record = measure(torch, device, module, specs, seconds, requests, args.layout, args.reps, args.smoke)
        records.append(record)
        pieces = ", ".join(f"{name} {ms:.3f}" for name, ms in record["pieces_ms"].items())
        print(
            f"{args.layout} req={requests:3d}: step {record['step_ms']:.3f} ms on the device,"
            f" host {record['host_ms']:.3f} ms; ms a step: {pieces}"
        )
    meta = {"device": common.device_name(device), "versions": common.versions(), "date": common.now()}
    print(meta)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
