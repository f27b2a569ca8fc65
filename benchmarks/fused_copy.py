"""Speed of the fused Mamba postprocess / precopy kernels' copies, one kernel file against another.

    python benchmarks/fused_copy.py --tree build/fork --compare main=PATH/postprocess.py \
        --compare base=build/base-0.30.0rc2/vllm_ascend/ops/triton/mamba/postprocess.py \
        --precopy-base build/base-0.30.0rc2/vllm_ascend/ops/triton/v2/mamba/precopy.py --json out.json

GDN-like state pools (36 layers; per block a conv state of 3 tokens x 8192 bf16 in the SD
`(width, dim)` or DS `(dim, width)` layout, and a 2 MiB fp32 temporal state). Scenarios, every
request alike: `shift` (the running state stays in its block: conv shifted in place by 1-2 tokens,
temporal copied from the accepted column) and `move` (the state moves to the next block). Median
device time of one launch over --iters launches, CUDA events. Correctness is the op tests' job
(the series' cases in tests/e2e/.../test_postprocess_mamba.py and test_precopy.py); this only times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, device_name, now, select_device, synchronize, versions  # noqa: E402
from tools.kernel_harness import loader  # noqa: E402

LAYERS, CONV_WIDTH, CONV_DIM, TEMPORAL = 36, 3, 8192, (32, 128, 128)  # temporal: 2 MiB fp32
BLOCK_SIZE, BLOCKS_PER_REQ = 16, 4
DEVICE = "cuda"


def build(num_reqs: int, ds: bool):
    import torch

    blocks = num_reqs * BLOCKS_PER_REQ + 1
    conv_shape = (blocks, CONV_DIM, CONV_WIDTH) if ds else (blocks, CONV_WIDTH, CONV_DIM)
    states = []
    for _ in range(LAYERS):
        states += [torch.ones(conv_shape, dtype=torch.bfloat16, device=DEVICE),
                   torch.ones((blocks, *TEMPORAL), dtype=torch.float32, device=DEVICE)]  # fmt: skip
    table = torch.arange(num_reqs * BLOCKS_PER_REQ, dtype=torch.int32, device=DEVICE).view(num_reqs, -1) + 1

    def t(values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    conv = [i % 2 == 0 for i in range(len(states))]
    meta = dict(
        block_table_ptrs_ptr=t([table.data_ptr()], torch.int64),
        block_table_stride_req=table.stride(0),
        state_base_addrs_ptr=t([s.data_ptr() for s in states], torch.int64),
        state_block_strides_ptr=t([s.stride(0) * s.element_size() for s in states], torch.int64),
        state_elem_sizes_ptr=t([s.element_size() for s in states]),
        state_inner_sizes_ptr=t(
            [(1 if ds else CONV_DIM) if c else s[0].numel() for s, c in zip(states, conv)], torch.int64
        ),
        state_conv_widths_ptr=t([CONV_WIDTH if c else 0 for c in conv]),
        state_group_indices_ptr=t([0] * len(states)),
        state_dim_row_count_ptr=t([CONV_DIM if c and ds else 0 for c in conv]),
        state_dim_row_stride_ptr=t([CONV_WIDTH * 2 if c and ds else 0 for c in conv], torch.int64),
    )
    return states + [table], meta  # the table must outlive the launches (only its address is passed)


def postprocess_args(num_reqs: int, scenario: str) -> dict:
    import torch

    # running state at 2 * BLOCK_SIZE - bias, accepted bias + 1: crosses into block 2 (column 1) with bias 1-2.
    bias = [1 + r % 2 for r in range(num_reqs)]
    state_idx = [1 if scenario == "shift" else 0] * num_reqs

    def t(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    return dict(
        num_accepted_tokens_ptr=t([b + 1 for b in bias]),
        mamba_state_idx_ptr=t(state_idx),
        num_scheduled_tokens_ptr=t([4] * num_reqs),
        num_computed_tokens_ptr=t([2 * BLOCK_SIZE - b - 1 for b in bias]),
        num_draft_tokens_ptr=t([3] * num_reqs),
        num_accepted_tokens_out_ptr=t([b + 1 for b in bias]),
        idx_mapping_ptr=None,
        num_reqs=num_reqs,
        block_size=BLOCK_SIZE,
    )


def precopy_args(num_reqs: int) -> dict:
    import torch

    def t(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    return dict(
        mamba_state_idx_ptr=t([1] * num_reqs),
        src_col_ptr=t([0] * num_reqs),
        token_bias_ptr=t([1 + r % 2 for r in range(num_reqs)]),
        idx_mapping_ptr=None,
        num_reqs=num_reqs,
        HAS_IDX_MAPPING=False,
    )


def time_ms(launch, iters: int) -> float:
    import torch

    for _ in range(3):
        launch()
    synchronize("cuda")
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default=str(ROOT / "build" / "fork"), help="the fork tree (its kernels are `fork`)")
    p.add_argument("--compare", action="append", default=[], metavar="NAME=POSTPROCESS_PY")
    p.add_argument("--precopy-base", help="an unpatched precopy.py to time against the fork's")
    p.add_argument("--requests", default="1,8,64")
    p.add_argument("--tiles", default="1,16")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    loader.setup(loader.split_roots(args.tree))
    assert select_device() == DEVICE, "times CUDA launches only"
    from vllm_ascend.ops.triton.mamba import postprocess
    from vllm_ascend.ops.triton.v2.mamba import precopy

    post = {"fork": postprocess.postprocess_mamba_fused_kernel}
    for spec in args.compare:
        name, _, path = spec.partition("=")
        post[name] = loader.load_file(Path(path), f"_bench_{name}").postprocess_mamba_fused_kernel
    pre = {"fork": precopy.precopy_mamba_align_fused_kernel}
    if args.precopy_base:
        pre["base"] = loader.load_file(Path(args.precopy_base), "_bench_precopy_base").precopy_mamba_align_fused_kernel
    rows = []

    def measure(kernel_name, impls, grid, kargs, **key):
        for name, kernel in impls.items():
            ms = time_ms(lambda: kernel[grid](**kargs), args.iters)  # noqa: B023 (called at once)
            rows.append(dict(kernel=kernel_name, impl=name, **key, ms=ms))
            print(f"{kernel_name:11s} {name:6s} " + " ".join(f"{k}={v}" for k, v in key.items()) + f" {ms:8.3f} ms")

    for layout in ("sd", "ds"):
        for n in map(int, args.requests.split(",")):
            states, meta = build(n, layout == "ds")
            consts = dict(COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=layout == "ds")
            for tiles in map(int, args.tiles.split(",")):
                grid = (n, len(states) - 1, tiles)
                key = dict(layout=layout, requests=n, tiles=tiles)
                for scenario in ("shift", "move"):
                    kargs = {**postprocess_args(n, scenario), **meta, **consts, "TEMPORAL_TILES": tiles}
                    measure("postprocess", post, grid, kargs, **key, scenario=scenario)
                kargs = {**precopy_args(n), **meta, **consts, "TEMPORAL_TILES": tiles}
                measure("precopy", pre, grid, kargs, **key, scenario="move")
            del states, meta
    if args.json:
        record = dict(date=now(), device=device_name("cuda"), versions=versions(), rows=rows)
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
