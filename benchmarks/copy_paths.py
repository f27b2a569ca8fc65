"""Benchmark the Mamba state copy paths on GDN/KDA-like align-mode batches.

    python benchmarks/copy_paths.py                      # CUDA or NPU: full run
    python benchmarks/copy_paths.py --smoke              # CPU, Triton interpreter, tiny shapes
    python benchmarks/copy_paths.py --plot-only benchmarks/results/h200_run4/copy_paths.json

Backends (one batch = every copy of one align-mode step):
  unguarded    the tree's batch_memcpy_kernel, BLOCK 8192, one program per pair (the `triton` value;
               on the fork it carries the left-overlap guard, so the name is the base's)
  left_guard   upstream-vLLM-style: the same kernel plus a barrier when dst < src overlaps, BLOCK 1024
  memmove      the kernel batch_memmove launches (batch_memcpy_kernel of the tree, one program a pair),
               one launch, with this benchmark's GPU block (benchmarks/common.py: MEMMOVE_BLOCK)
  torch        the shipped default: grouped tensor copies (vllm_ascend/worker/mamba_copy_groups.py,
               imported from the tree): every request recorded as the collector records it (a few
               block ids; the step recorded outside the timed call, as torch_clone's pairs are built
               outside it), then copied by the strategy the module picks for the step's size
  torch_direct   the same module, every step copied directly: one multi-tensor copy of
               (source, destination) views, self-overlapping sources staged first
  torch_indexed  the same module, every step by row indices per storage: index_select into a
               buffer of at most GATHER_BYTES, then index_copy_, chunk by chunk
  torch_uncapped the row-index path without the cap (one gather per storage, as before the cap)
  torch_<name>   --compare-groups NAME=PATH: another mamba_copy_groups.py (e.g. an earlier version)
  torch_clone  per pair dst.copy_(src.clone()) (the per-pair reference: the default before grouping)
  torch_copy   per pair dst.copy_(src) (no temporary; not overlap-safe)
Extra rows: unguarded_b1024; with --sweep memmove_b<B>_w<W> (block/warps) and memmove_product
(vllm-ascend's launcher batch_memmove with its own defaults).

Shapes per layer (36 GDN layers in 3 KV-cache groups of 12, as Qwen3-Next's 36 linear-attention layers
beside 12 full-attention ones): one conv state of 3 rows x 16 KiB (bf16, dim 8192) and one 2 MiB fp32
temporal state. Pages of [conv state | temporal state], the states strided views with the page stride
(`_adjust_kv_layout`). Memory layouts (`layout` in each record):
  backing   what vllm-ascend 0.30.0rc2's model runner builds for hybrid attention/Mamba models with
            vLLM's layer-compact KV-cache layouts (LBNHC, vLLM's default): one allocation, every layer
            a slice of it (`_allocate_kv_cache_tensors`, "Materialize slices of one backing tensor"),
            the KV-cache groups aliased from its first byte, so layer j of every group is region j
  shared    vllm-ascend 0.23.0.post1: one raw int8 tensor per KV-cache tensor, shared by layer j of
            every group (12 tensors)
  per_layer one raw int8 tensor per layer (0.30.0rc2's private layer buffers, where the one-allocation
            path does not apply, e.g. block-outermost layouts); what runs 9-11 called `vllm`
  separate  every state its own contiguous allocation (72 pools)
A layer's group and place: layer i is in group i % 3 at region i // 3; a request has its own blocks in
each group, so aliased layers never share a block, as vLLM's block pool guarantees.
Each request crosses a block boundary: its conv state moves to a new
block shifted by 1-2 tokens (state[src, bias:] -> state[dst, :3 - bias]) and its temporal state
moves to a new block. The device-to-device bandwidth of one large torch copy is measured in the
same run as the ceiling. gbps counts read + write bytes (2 x bytes / time), like d2d_gbps.

Every record has `median_ms` (device time: events around one batch, launch gaps included) and
`host_ms` (median wall time of the call itself on the host, without waiting for the device). The
backends of one case are timed round robin, one call each per round in a shuffled order, so that a
drift in the host's speed (up to 2x between hosts, and within one) falls on all of them alike, and
so does running right after another backend (colder host caches: up to 25% slower in run 13).

The host-side cost of collecting the copy metadata is measured on the CPU with CPU tensors:
per-pair loops emulating upstream's collectors (pointer buffers, tensor pairs) and the fork's
grouped path's recording of a step (`mamba_copy_groups.record`, the real code) over the same layout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402

LAYERS = 36
GROUPS = 3  # KV-cache groups of the Mamba layers: layer i is in group i % GROUPS
LAYOUTS = ("backing", "shared", "per_layer", "separate")
CONV_ROWS, CONV_DIM = 3, 8192  # bf16 -> 16 KiB rows
TEMPORAL_SHAPE = (16, 128, 256)  # fp32 -> 2 MiB


def left_guard_kernel_factory():
    from vllm.triton_utils import tl, triton

    @triton.jit
    def left_guard_memcpy_kernel(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE: tl.constexpr):
        # Upstream vLLM's guard: barrier between load and store when dst < src overlaps.
        pid = tl.program_id(0)
        src = tl.load(src_ptrs + pid)
        dst = tl.load(dst_ptrs + pid)
        size = tl.load(sizes + pid).to(tl.int64)
        is_left_overlap = (dst < src) & ((dst + size) > src)
        src_ptr = src.to(tl.pointer_type(tl.uint8))
        dst_ptr = dst.to(tl.pointer_type(tl.uint8))
        offsets = tl.arange(0, BLOCK_SIZE)
        for i in range(0, size, BLOCK_SIZE):
            mask = (i + offsets) < size
            data = tl.load(src_ptr + i + offsets, mask=mask)
            if is_left_overlap:
                tl.debug_barrier()
            tl.store(dst_ptr + i + offsets, data, mask=mask)

    return left_guard_memcpy_kernel


def make_pools(torch, device, blocks, layers, conv_rows, conv_dim, temporal_shape, layout, alloc=None):
    """Per layer (conv, temporal) state tensors of `blocks` blocks in the given memory layout."""
    alloc = alloc or torch.empty
    pools = []
    t_numel = int(np.prod(temporal_shape))
    conv_bytes = conv_rows * conv_dim * 2
    page = conv_bytes + t_numel * 4  # vLLM pads it to the attention page in hybrid models
    regions = -(-layers // GROUPS)
    backing = alloc(regions * blocks * page, dtype=torch.int8, device=device) if layout == "backing" else None
    shared = (
        [alloc(blocks * page, dtype=torch.int8, device=device) for _ in range(regions)] if layout == "shared" else []
    )
    for i in range(layers):
        if layout == "separate":
            conv = alloc(blocks, conv_rows, conv_dim, dtype=torch.bfloat16, device=device)
            temporal = alloc(blocks, *temporal_shape, dtype=torch.float32, device=device)
        else:
            region = i // GROUPS
            if layout == "backing":
                raw = backing[region * blocks * page : (region + 1) * blocks * page]
            else:
                raw = shared[region] if layout == "shared" else alloc(blocks * page, dtype=torch.int8, device=device)
            start = raw.storage_offset()
            conv = raw.view(torch.bfloat16).as_strided(
                (blocks, conv_rows, conv_dim), (page // 2, conv_dim, 1), start // 2
            )
            t_stride = [t_numel // temporal_shape[0]]
            for d in temporal_shape[1:]:
                t_stride.append(t_stride[-1] // d)
            temporal = raw.view(torch.float32).as_strided(
                (blocks, *temporal_shape), (page // 4, *t_stride), (start + conv_bytes) // 4
            )
        pools.append((conv, temporal))
    return pools


class Batch:
    """Pools for `layers` layers and the copy pairs of `requests` requests crossing a block boundary."""

    def __init__(self, torch, device, requests, layers, conv_rows, conv_dim, temporal_shape, seed=0, layout="backing"):
        self.torch = torch
        blocks = 2 * requests * GROUPS + 2
        torch.manual_seed(seed)
        self.pools = make_pools(torch, device, blocks, layers, conv_rows, conv_dim, temporal_shape, layout)
        for conv, temporal in self.pools:
            conv.view(torch.int16).random_(-(2**15), 2**15)  # filled on the device
            temporal.normal_()
        # Request r moves, in group g, from block 2 * (r * GROUPS + g) to the next one; bias = accepted
        # tokens - 1, one per request, all layers.
        self.views = []  # (src_view, dst_view)
        for layer, (conv, temporal) in enumerate(self.pools):
            for req in range(requests):
                src_blk = 2 * (req * GROUPS + layer % GROUPS)
                bias = 1 + req % 2
                self.views.append((conv[src_blk, bias:], conv[src_blk + 1, : conv_rows - bias]))
                self.views.append((temporal[src_blk], temporal[src_blk + 1]))
        # What the collector is called with per request: block table per group, source and destination index,
        # bias (conv from block_ids[0] shifted by bias rows, temporal from block_ids[bias], both into block_ids[3]).
        self.requests = [
            ([[2 * (r * GROUPS + g)] * 3 + [2 * (r * GROUPS + g) + 1] for g in range(GROUPS)], 0, 3, 1 + r % 2)
            for r in range(requests)
        ]
        self.src_ptrs = torch.tensor([s.data_ptr() for s, _ in self.views], dtype=torch.int64, device=device)
        self.dst_ptrs = torch.tensor([d.data_ptr() for _, d in self.views], dtype=torch.int64, device=device)
        sizes = [s.numel() * s.element_size() for s, _ in self.views]
        self.sizes = torch.tensor(sizes, dtype=torch.int32, device=device)
        self.bytes = sum(sizes)
        self.pairs = len(sizes)
        self.copy_rows = None

    def grouped_step(self, mcg, specs):
        """The step's copy, its requests recorded once as the collector records them.

        Like the per-pair rows, whose tensor pairs the collector builds outside the timed call, the
        recording is left out of the copy's time; `host_grouped_record` measures it."""
        layers = [(f"layer.{i}", i % GROUPS, list(p), (specs.get_conv_copy_spec, specs.get_temporal_copy_spec))
                  for i, p in enumerate(self.pools)]  # fmt: skip
        bufs = types.SimpleNamespace()
        for tables, src_idx, dest_idx, bias in self.requests:
            assert mcg.record(
                bufs,
                lambda: layers,
                list(range(GROUPS)),
                src_idx,
                dest_idx,
                bias,
                types.SimpleNamespace(block_ids=tables),
            )
        recorded = bufs._mamba_copy_requests

        def step():
            bufs._mamba_copy_requests = list(recorded)  # a new step: its hazard check and row indices are redone
            mcg.copy(bufs)

        return step

    def reference(self):
        return [(s.clone(), d) for s, d in self.views]


def split_pair(item: str) -> tuple[str, str]:
    """NAME=PATH of --compare-groups."""
    name, path = item.split("=", 1)
    return name, path


def copy_groups_variant(path, name, **constants):
    """A private copy of a mamba_copy_groups module (its own constants), loaded from `path`."""
    spec = importlib.util.spec_from_file_location(f"_copy_groups_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key, value in constants.items():
        setattr(module, key, value)
    return module


def make_backends(kernels, torch, smoke: bool, sweep: bool, compare_groups=()):
    memcpy = kernels["batch_memcpy_kernel"]
    memmove = kernels["batch_memmove"]
    left_guard = left_guard_kernel_factory()

    def pointer(kernel, block):
        def run(b):
            kernel[(b.pairs,)](b.src_ptrs, b.dst_ptrs, b.sizes, BLOCK_SIZE=block)

        return run

    def memmove_cfg(block, warps=None):
        def run(b):
            memmove(b.src_ptrs, b.dst_ptrs, b.sizes, block_size=block, num_warps=warps)

        return run

    mcg, specs = kernels["copy_groups"], kernels["copy_specs"]

    def grouped(module, name):
        def run(b):
            steps = b.__dict__.setdefault("steps", {})
            if name not in steps:
                steps[name] = b.grouped_step(module, specs)
            steps[name]()

        return run

    variants = {
        "torch_direct": {"DIRECT_PAIRS_PER_FAMILY": 1 << 62},
        "torch_indexed": {"DIRECT_PAIRS_PER_FAMILY": 0},
        "torch_uncapped": {"DIRECT_PAIRS_PER_FAMILY": 0, "GATHER_BYTES": 1 << 62},
        "torch_cap256": {"GATHER_BYTES": 256 << 20},
    }
    groups = {
        "torch": (grouped(mcg, "torch"), {"path": "mamba_copy_groups.record + copy"}),
        **{
            name: (grouped(copy_groups_variant(mcg.__file__, name, **consts), name), consts)
            for name, consts in variants.items()
        },
        **{
            f"torch_{name}": (grouped(copy_groups_variant(path, name), f"torch_{name}"), {"path": path})
            for name, path in map(split_pair, compare_groups)
        },
    }

    def torch_clone(b):
        for s, d in b.views:
            d.copy_(s.clone())

    def torch_copy(b):
        for s, d in b.views:
            d.copy_(s)

    mm = kernels["memmove_module"]
    backends = {
        "unguarded": (pointer(memcpy, 8192), {"block": 8192}),
        "left_guard": (pointer(left_guard, 1024), {"block": 1024}),
        "memmove": (memmove_cfg(common.MEMMOVE_BLOCK), {"block": common.MEMMOVE_BLOCK}),
        **groups,
        "torch_clone": (torch_clone, {}),
        "torch_copy": (torch_copy, {}),
        "unguarded_b1024": (pointer(memcpy, 1024), {"block": 1024}),
    }
    if sweep and not smoke:
        # vllm-ascend's launcher as the product calls it (its Ascend defaults), beside the GPU sweep
        backends["memmove_product"] = (
            lambda b: mm.batch_memmove(b.src_ptrs, b.dst_ptrs, b.sizes),
            {"block": mm.BLOCK_SIZE},
        )
        for block, warps in ((8192, 4), (16384, 4), (32768, 4), (16384, 2), (8192, 8)):
            backends[f"memmove_b{block}_w{warps}"] = (memmove_cfg(block, warps), {"block": block, "num_warps": warps})
    return backends


def time_batch(torch, device, fn, batch, reps, warmup, host_times=None):
    """Median device ms per call (events; wall time on the CPU). `host_times` collects the call's host ms."""
    for _ in range(warmup):
        fn(batch)
    common.synchronize(device)
    times = []
    host = [] if host_times is None else host_times
    if device in ("cuda", "npu"):
        mod = getattr(torch, device)
        for _ in range(reps):
            start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn(batch)
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(batch)
            times.append((time.perf_counter() - t0) * 1e3)
            host.append(times[-1])
    return statistics.median(times), times


def time_back_to_back(torch, device, fn, batch, reps, count=10):
    """Median ms per batch over `count` launches queued back to back (no host launch gaps)."""

    def many(b):
        for _ in range(count):
            fn(b)

    median_ms, _ = time_batch(torch, device, many, batch, reps, 1)
    return median_ms / count


def measure_d2d(torch, device, nbytes, reps):
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.random_(0, 255) if device != "cpu" else src.fill_(1)

    def fn(_):
        dst.copy_(src)

    median_ms, _ = time_batch(torch, device, fn, None, reps, 3)
    return 2 * nbytes / (median_ms * 1e-3) / 1e9, median_ms


def check_backend(torch, fn, batch) -> bool:
    """One run against torch's own copy of the sources (no overlap in this batch)."""
    ref = batch.reference()
    for _, d in batch.views:
        d.zero_()
    fn(batch)
    common.synchronize(batch.src_ptrs.device.type)
    return all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for s, d in ref)


def host_cost(torch, requests=64, layers=36, reps=3, kernels=None, layout="separate", compare_groups=()):
    """us per pair spent collecting copy metadata on the host, CPU tensors, collector-like loops; and the host
    time of a grouped step (record + copy) on small CPU states, per grouped module."""
    blocks = 2 * requests * GROUPS + 2
    # torch.empty: pages are never touched, only addresses are computed.
    pools = make_pools(torch, "cpu", blocks, layers, CONV_ROWS, CONV_DIM, TEMPORAL_SHAPE, layout)
    block_ids = [[2 * r, 2 * r + 1] for r in range(requests)]
    n = requests * layers * 2
    src_np = np.zeros(n, dtype=np.int64)
    dst_np = np.zeros(n, dtype=np.int64)
    sizes_np = np.zeros(n, dtype=np.int32)

    def conv_spec(state, ids, idx, bias):
        view = state[ids[idx], bias:]
        return view.data_ptr(), view.numel()

    def temporal_spec(state, ids, idx, bias):
        view = state[ids[idx + bias]]
        return view.data_ptr(), view.numel()

    specs = (conv_spec, temporal_spec)

    def per_pair():
        """The per-pair collector's loop: (index, state, block ids, source address, numel) per pair."""
        off = 0
        for r in range(requests):
            ids = block_ids[r]
            for layer in range(layers):
                for state, spec in zip(pools[layer], specs):
                    addr, numel = spec(state, ids, 0, 0 if spec is temporal_spec else 1)
                    yield off, state, ids, addr, numel
                    off += 1

    def pointer_path():
        off = -1
        for off, state, ids, addr, numel in per_pair():
            src_np[off] = addr
            dst_np[off] = state[ids[1]].data_ptr()
            sizes_np[off] = numel * state.element_size()
        return off + 1

    def tensor_pair_path():
        pairs = []
        off = -1
        for off, state, ids, addr, numel in per_pair():
            esize = state.element_size()
            start = state.storage_offset()  # the collector's flat view from the state's start
            flat = state.as_strided((state.untyped_storage().nbytes() // esize - start,), (1,), start)
            src = flat.narrow(0, (addr - state.data_ptr()) // esize, numel)
            dst = flat.narrow(0, (state[ids[1]].data_ptr() - state.data_ptr()) // esize, numel)
            pairs.append((src, dst))
            sizes_np[off] = numel * esize
        return off + 1

    # Per-layer numpy address arithmetic: vectorized per layer (sketch, no copy functions).
    bases = np.array([[p.data_ptr() for p in layer] for layer in pools], dtype=np.int64)
    strides = np.array([[p.stride(0) * p.element_size() for p in layer] for layer in pools], dtype=np.int64)
    conv_row = CONV_DIM * 2

    def numpy_path():
        ids = np.array(block_ids, dtype=np.int64)
        src = bases[None, :, :] + ids[:, 0, None, None] * strides[None, :, :]
        src[:, :, 0] += conv_row
        dst = bases[None, :, :] + ids[:, 1, None, None] * strides[None, :, :]
        src_np[:] = src.reshape(-1)
        dst_np[:] = dst.reshape(-1)
        return src.size

    # The real collectors over the same layout, with vLLM's two copy functions (or models of them):
    # upstream's per-pair loop, and the grouped path's record() of the step.
    out_extra = {}
    if kernels is not None:
        mcg, vllm_specs = kernels["copy_groups"], kernels["copy_specs"]
        funcs = (vllm_specs.get_conv_copy_spec, vllm_specs.get_temporal_copy_spec)
        tables = [[2 * r, 2 * r + 1, 2 * r + 1] for r in range(requests)]
        biases = [r % 2 for r in range(requests)]

        def per_pair_collector():
            off = 0
            for r in range(requests):
                ids = tables[r]
                dest = ids[1]
                for layer in range(layers):
                    for state, func in zip(pools[layer], funcs):
                        spec = func(state, ids, 0, biases[r] + 1)
                        src_np[off] = spec.start_addr
                        dst_np[off] = state[dest].data_ptr()
                        sizes_np[off] = spec.num_elements * state.element_size()
                        off += 1
            return off

        named = [(f"layer.{i}", i % GROUPS, list(pools[i]), funcs) for i in range(layers)]
        bufs = types.SimpleNamespace()

        def grouped_record():
            bufs._mamba_copy_requests = []  # a new step (copy() forgets the step's requests)
            for r in range(requests):
                req = types.SimpleNamespace(block_ids=[[b * GROUPS + g for b in tables[r]] for g in range(GROUPS)])
                mcg.record(bufs, lambda: named, list(range(GROUPS)), 0, 1, biases[r], req)
            return n

        out_extra = {"per_pair_collector": per_pair_collector, "grouped_record": grouped_record}
        # A whole step (record, plan, copy) of each grouped module on small states (conv 3 x 512 B, temporal
        # 4 KiB): what the module costs the host beside the bytes it moves (one chunk: the cap is not reached).
        small = make_pools(torch, "cpu", blocks, layers, 3, 256, (4, 16, 16), layout)
        small_named = [(f"layer.{i}", i % GROUPS, list(small[i]), funcs) for i in range(layers)]
        modules = {
            "torch": mcg,
            **{f"torch_{k}": copy_groups_variant(v, k) for k, v in map(split_pair, compare_groups)},
        }
        for label, module in modules.items():

            def grouped_step(module=module, bufs=types.SimpleNamespace()):  # noqa: B008 (one namespace per module)
                bufs._mamba_copy_requests = []
                for r in range(requests):
                    req = types.SimpleNamespace(block_ids=[[b * GROUPS + g for b in tables[r]] for g in range(GROUPS)])
                    module.record(bufs, lambda: small_named, list(range(GROUPS)), 0, 1, biases[r], req)
                module.copy(bufs)
                return n

            grouped_step()  # the layout, found once
            out_extra[f"grouped_step_{label}"] = grouped_step

    out = {}
    for name, fn in (
        ("pointer_buffers", pointer_path),
        ("tensor_pairs", tensor_pair_path),
        ("numpy_vectorized", numpy_path),
        *out_extra.items(),
    ):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            count = fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = {"us_per_pair": best / count * 1e6, "ms_per_step": best * 1e3, "pairs": count}
    return out


def run(args):
    kernels = common.setup_kernels(args.tree)
    import torch

    device = common.select_device(args.device)
    smoke = args.smoke or device == "cpu"
    layers = 2 if smoke else LAYERS
    conv_rows, conv_dim = (3, 256) if smoke else (CONV_ROWS, CONV_DIM)
    temporal_shape = (4, 16, 16) if smoke else TEMPORAL_SHAPE
    requests_list = [1, 2] if smoke else [int(r) for r in args.requests.split(",")]
    reps = 3 if smoke else args.reps
    meta = {"device": common.device_name(device), "versions": common.versions(), "date": common.now()}
    d2d_bytes = (1 << 20) if smoke else args.d2d_mib << 20
    d2d_gbps, d2d_ms = measure_d2d(torch, device, d2d_bytes, reps)
    print(f"d2d: {d2d_gbps:.1f} GB/s (read+write) over {d2d_bytes >> 20} MiB, {d2d_ms:.3f} ms", flush=True)
    backends = make_backends(kernels, torch, smoke, args.sweep, args.compare_groups)
    if args.backends:
        backends = {k: v for k, v in backends.items() if k in args.backends.split(",")}
    records = []
    cases = [(layout, requests) for layout in args.layouts.split(",") for requests in requests_list]
    for layout, requests in cases:
        batch = Batch(torch, device, requests, layers, conv_rows, conv_dim, temporal_shape, layout=layout)
        correct = {name: check_backend(torch, fn, batch) for name, (fn, _) in backends.items()}
        timed = {name: ([], []) for name in backends}  # device and host ms of each call
        order = list(backends)
        for rep in range(reps):  # round robin: a host's speed drifts, and every backend sees the same drift
            random.Random(rep).shuffle(order)  # and each runs first (its caches cold after another) as often
            for name in order:
                fn = backends[name][0]
                timed[name][0].extend(time_batch(torch, device, fn, batch, 1, 2 if rep == 0 else 0, timed[name][1])[1])
        for name, (fn, cfg) in backends.items():
            ok, times = correct[name], timed[name][0]
            median_ms, host_ms = (statistics.median(x) for x in timed[name])
            gbps = 2 * batch.bytes / (median_ms * 1e-3) / 1e9
            b2b = {}
            if device != "cpu" and not name.startswith("torch_"):
                b2b_ms = time_back_to_back(torch, device, fn, batch, max(3, reps // 3))
                b2b_gbps = 2 * batch.bytes / (b2b_ms * 1e-3) / 1e9
                b2b = {"median_ms_b2b": b2b_ms, "gbps_b2b": b2b_gbps, "pct_of_d2d_b2b": 100 * b2b_gbps / d2d_gbps}
            rec = {
                "backend": name,
                "layout": layout,
                "requests": requests,
                "pairs": batch.pairs,
                "bytes": batch.bytes,
                "median_ms": median_ms,
                "host_ms": host_ms,
                "min_ms": min(times),
                "gbps": gbps,
                "d2d_gbps": d2d_gbps,
                "pct_of_d2d": 100 * gbps / d2d_gbps,
                **b2b,
                "correct": ok,
                "config": cfg,
                "layers": layers,
                **meta,
            }
            records.append(rec)
            print(
                f"{name:>20} {layout:>8} req={requests:>3} pairs={batch.pairs:>5} {batch.bytes / 1e6:8.1f} MB "
                f"{median_ms:9.3f} ms (host {host_ms:7.3f}) {gbps:8.1f} GB/s {rec['pct_of_d2d']:5.1f}% d2d correct={ok}"
                + (f" | back-to-back {b2b['median_ms_b2b']:.3f} ms {b2b['pct_of_d2d_b2b']:5.1f}% d2d" if b2b else ""),
                flush=True,
            )
        del batch
        if device == "cuda":
            torch.cuda.empty_cache()
    if not args.no_host:
        host_meta = {"device": "host cpu", "versions": meta["versions"], "date": meta["date"]}
        records += host_records(
            torch, kernels, args.layouts, host_meta, 2 if smoke else 64, layers, compare_groups=args.compare_groups
        )
    return records


def host_records(torch, kernels, layouts, meta, requests=64, layers=LAYERS, reps=3, compare_groups=()):
    records = []
    for layout in layouts.split(","):
        for name, vals in host_cost(torch, requests, layers, reps, kernels, layout, compare_groups).items():
            records.append({"backend": f"host_{name}", "kind": "host", "layout": layout, **vals, **meta})
            print(
                f"host {name:>20} {layout:>8}: {vals['us_per_pair']:.2f} us/pair, {vals['ms_per_step']:.2f} ms/step "
                f"({vals['pairs']} pairs)",
                flush=True,
            )
    return records


def plot(records, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dev = [r for r in records if r.get("kind") != "host"]
    if not dev:
        return
    fig, ax = plt.subplots(figsize=(9, 6))
    names = ["unguarded", "unguarded_b1024", "left_guard", "memmove", "torch", "torch_clone", "torch_copy"]
    colors = {}
    for layout, style in zip((*LAYOUTS, "vllm"), ("-", "-.", "--", ":", "--")):  # "vllm": runs 9-11's per_layer
        for name in names:
            rows = sorted(
                (r for r in dev if r["backend"] == name and r.get("layout", "separate") == layout),
                key=lambda r: r["requests"],
            )
            if rows:
                line = ax.plot(
                    [r["requests"] for r in rows],
                    [r["gbps"] for r in rows],
                    style,
                    marker="o",
                    color=colors.get(name),
                    label=f"{name} ({layout})",
                )
                colors[name] = line[0].get_color()
    d2d = dev[0]["d2d_gbps"]
    ax.axhline(d2d, color="k", linestyle="--", label=f"D2D copy ceiling ({d2d:.0f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests per batch (36 layers x (conv 3x16 KiB + temporal 2 MiB))")
    ax.set_ylabel("GB/s (read + write)")
    ax.set_title(f"Mamba state copy paths on {dev[0]['device']} by KV-cache layout")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tree", help="kernel tree(s), os.pathsep-separated (default: repo overlay + build/fork)")
    parser.add_argument("--requests", default="1,8,64")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--d2d-mib", type=int, default=1024)
    parser.add_argument("--backends", help="comma-separated subset")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="memory layouts, comma-separated")
    parser.add_argument("--sweep", action="store_true", help="also time memmove block/warp variants")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument(
        "--compare-groups", action="append", default=[], metavar="NAME=PATH", help="time another mamba_copy_groups.py"
    )
    parser.add_argument("--no-host", action="store_true", help="skip the host-side collector cost")
    parser.add_argument("--host-only", action="store_true", help="only the host-side collector cost (64 requests)")
    parser.add_argument("--json", default=None, help="write records here")
    parser.add_argument("--png", default=None, help="write the plot here")
    parser.add_argument("--plot-only", help="read records from this JSON and only plot")
    args = parser.parse_args(argv)
    if args.plot_only:
        records = json.loads(Path(args.plot_only).read_text())
        plot(records, args.png or str(Path(args.plot_only).with_suffix(".png")))
        return 0
    if args.host_only:
        kernels = common.setup_kernels(args.tree)
        import torch

        meta = {"device": "host cpu", "versions": common.versions(), "date": common.now()}
        records = []
        for requests in [int(r) for r in args.requests.split(",")]:
            records += host_records(
                torch, kernels, args.layouts, meta, requests, reps=5, compare_groups=args.compare_groups
            )
    else:
        records = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    if args.png:
        try:
            plot(records, args.png)
        except ImportError:
            print("matplotlib missing: plot later with --plot-only", file=sys.stderr)
    bad = [r for r in records if r.get("correct") is False and r["backend"] != "torch_copy"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
