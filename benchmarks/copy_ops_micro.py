"""Host and device cost of the torch ops a grouped Mamba state copy can be built from.

    python benchmarks/copy_ops_micro.py --json out.json      # CUDA or NPU

The step of benchmarks/copy_paths.py (its per_layer layout: 36 raw tensors, per request a conv state of
3 x 16 KiB moved to a new block and a 2 MiB temporal state), broken into its parts: building
(source, destination) views, one multi-tensor copy over prebuilt views (and the kernels it
launches), and the per-storage row-index ops with prebuilt indices, each with its host time per
call and the device time of the whole step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.copy_paths import CONV_DIM, CONV_ROWS, LAYERS, TEMPORAL_SHAPE, make_pools  # noqa: E402


def timed(torch, device, fn, reps=30):
    """(median device ms, median host ms) of fn() after two warm-ups."""
    fn(), fn()
    common.synchronize(device)
    dev, host = [], []
    mod = getattr(torch, device) if device != "cpu" else None
    for _ in range(reps):
        start, end = (mod.Event(enable_timing=True), mod.Event(enable_timing=True)) if mod else (None, None)
        start and start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if mod:
            end.record()
            end.synchronize()
        dev.append(start.elapsed_time(end) if mod else host[-1])
    return statistics.median(dev), statistics.median(host)


def kernels_launched(torch, fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key[:60]: e.count for e in prof.key_averages() if e.device_type.name == "CUDA"}


def measure(torch, device, requests, records):
    """The parts of one step of `requests` requests."""
    blocks = 2 * requests + 2
    pools = make_pools(torch, device, blocks, LAYERS, CONV_ROWS, CONV_DIM, TEMPORAL_SHAPE, "per_layer")
    row = CONV_DIM * 2
    page = pools[0][0].stride(0) * 2
    flats = [
        torch.empty(0, dtype=torch.uint8, device=device).set_(c.untyped_storage()).view(torch.int64) for c, _ in pools
    ]
    rows = [f[: f.numel() // (row // 8) * (row // 8)].view(-1, row // 8) for f in flats]
    conv, tbytes = CONV_ROWS * row, TEMPORAL_SHAPE[0] * TEMPORAL_SHAPE[1] * TEMPORAL_SHAPE[2] * 4
    spans = []  # (src, dst, length) in int64 elements
    for r in range(requests):
        s, d, k = 2 * r * page, (2 * r + 1) * page, 1 + r % 2
        spans += [
            ((s + k * row) // 8, d // 8, (conv - k * row) // 8),
            ((s + conv) // 8, (d + conv) // 8, tbytes // 8),
        ]

    def views():
        return [(f[a : a + n], f[b : b + n]) for f in flats for a, b, n in spans]

    pairs = views()
    srcs, dsts = [p[0] for p in pairs], [p[1] for p in pairs]
    src_rows = torch.cat([torch.arange(a, a + n, device=device) for a, _, n in spans]) * 8 // row
    dst_rows = torch.cat([torch.arange(b, b + n, device=device) for _, b, n in spans]) * 8 // row
    src_rows, dst_rows = src_rows.unique_consecutive(), dst_rows.unique_consecutive()
    buf = torch.empty(src_rows.numel(), row // 8, dtype=torch.int64, device=device)

    def rec(name, fn, calls, **extra):
        dev, host = timed(torch, device, fn)
        out = {"requests": requests, "what": name, "device_ms": dev, "host_ms": host, "calls": calls,
               "host_us_per_call": 1e3 * host / calls, **extra}  # fmt: skip
        records.append(out)
        print(f"req={requests:>3} {name:>36}: device {dev:7.3f} ms, host {host:7.3f} ms, "
              f"{out['host_us_per_call']:6.2f} us per call ({calls} calls) {extra or ''}", flush=True)  # fmt: skip

    rec("build views (slicing)", views, 2 * len(pairs))
    rec(
        "build views (narrow)",
        lambda: [(f.narrow(0, a, n), f.narrow(0, b, n)) for f in flats for a, b, n in spans],
        2 * len(pairs),
    )
    # one split_with_sizes per storage and side (the spans of each side are disjoint here), gaps included
    cuts = []
    for side in (0, 1):
        ends, sizes = 0, []
        for span in sorted(spans, key=lambda x: x[side]):
            sizes += [span[side] - ends, span[2]]
            ends = span[side] + span[2]
        cuts.append(sizes + [flats[0].numel() - ends])
    rec(
        "build views (split_with_sizes)",
        lambda: [f.split_with_sizes(c)[1::2] for f in flats for c in cuts],
        2 * len(flats),
    )
    n_k = kernels_launched(torch, lambda: torch._foreach_copy_(dsts, srcs)) if device == "cuda" else None
    rec("_foreach_copy_ over prebuilt views", lambda: torch._foreach_copy_(dsts, srcs), 1, kernels=n_k)
    rec("copy_ per pair over prebuilt views", lambda: [d.copy_(s) for s, d in pairs], len(pairs))
    rec("views + _foreach_copy_", lambda: torch._foreach_copy_(*zip(*[(d, s) for s, d in views()])), 1)
    rec(
        "index_select(out=) per storage",
        lambda: [torch.index_select(r, 0, src_rows, out=buf) for r in rows],
        LAYERS,
    )
    rec("index_select (alloc) per storage", lambda: [r.index_select(0, src_rows) for r in rows], LAYERS)
    rec("index_copy_ per storage", lambda: [r.index_copy_(0, dst_rows, buf) for r in rows], LAYERS)
    rec("index_put_ per storage", lambda: [r.index_put_((dst_rows,), buf) for r in rows], LAYERS)
    rec(
        "aten.index_copy_ per storage",
        lambda: [torch.ops.aten.index_copy_(r, 0, dst_rows, buf) for r in rows],
        LAYERS,
    )
    rec("empty per storage", lambda: [torch.empty(buf.shape, dtype=buf.dtype, device=device) for _ in rows], LAYERS)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", default="1,8,64")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    common.setup_kernels()
    import torch

    device = common.select_device()
    records = []
    for requests in [int(r) for r in args.requests.split(",")]:
        measure(torch, device, requests, records)
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
