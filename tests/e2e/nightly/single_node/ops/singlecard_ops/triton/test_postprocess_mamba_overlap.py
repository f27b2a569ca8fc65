# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused Mamba postprocess kernel on overlapping (same-block) conv shifts; device-generic.

Runs on `npu`, else `cuda`, else the CPU under the Triton interpreter
(TRITON_INTERPRET=1). Needs no vLLM engine: the kernel is launched directly
with the metadata vLLM's postprocess context builds, in both conv layouts the
kernel has (SD: `(blocks, width, dim)`; DS, `CONV_STATE_DIM_FIRST`:
`(blocks, dim, width)`, copied row by row), where the kernel file has them.

Two oracles:
* a plain-Python model of the kernel's documented decision rule (copy or not,
  src/dst block index, accept-token bias, `num_accepted_tokens_out` reset to 1
  when src == dest);
* numpy memmove of the decided copies, applied request by request to byte
  snapshots of every state pool (the whole pool must match, so bytes outside
  the destinations stay unchanged).

A same-block conv shift copies state[blk, bias:] to state[blk, :width - bias]
(per row in DS): dst < src < dst + size, a left overlap. Only a GPU or NPU run
can fail on a missing left guard (`is_left_overlap` + `tl.debug_barrier()`):
without it the copy races there when rows are long and the shift small, and
`test_long_rows_small_shifts` uses that geometry on a device. The Triton
interpreter runs a program's lanes in lock-step, so a forward copy with
dst < src is correct there and these tests pass on the CPU with or without the
guard; on the CPU they check decisions and copy semantics only. A right
overlap (dst > src) walked forwards would fail everywhere, the interpreter
included, but this kernel never produces one (distinct blocks never overlap,
and a temporal copy onto its own block is an exact overlap).
"""

import dataclasses
import os
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from vllm_ascend.ops.triton.mamba.postprocess import postprocess_mamba_fused_kernel


def _select_device() -> str:
    if hasattr(torch, "npu") and torch.npu.is_available():
        return "npu"
    if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


DEVICE = _select_device()
INTERPRETED = DEVICE == "cpu"
COPY_BLOCK_SIZE = 1024  # what vLLM's run_fused_postprocess passes
MAX_ACCEPTED = 4  # 3 speculative tokens
KERNEL_ARGS = set(postprocess_mamba_fused_kernel.arg_names)
HAS_DS = "CONV_STATE_DIM_FIRST" in KERNEL_ARGS  # the DS conv row path (vllm-ascend 0.27.1rc1 on)
LAYOUTS = ["sd", "ds"] if HAS_DS else ["sd"]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    elif DEVICE == "npu":
        torch.npu.synchronize()


@dataclass(frozen=True)
class Step:
    """Per-request inputs of one postprocess step."""

    num_accepted: int
    state_idx: int  # mamba_state_idx: block index holding the running state
    num_scheduled: int
    num_computed: int
    num_draft: int


@dataclass(frozen=True)
class Decision:
    copy: bool
    src_idx: int
    dest_idx: int
    bias: int
    accepted_out: int


def reference_decision(step: Step, block_size: int) -> Decision:
    """The decision rule of vLLM's postprocess_mamba, which the fused kernel documents it mirrors."""
    running = step.num_computed + step.num_scheduled - step.num_draft
    new_computed = running + step.num_accepted - 1
    aligned = new_computed // block_size * block_size
    if aligned < running:
        return Decision(False, step.state_idx, -1, 0, step.num_accepted)
    bias = aligned - running
    dest_idx = aligned // block_size - 1
    same_block = step.state_idx == dest_idx
    accepted_out = 1 if same_block else step.num_accepted
    copy = not (same_block and bias == 0)
    return Decision(copy, step.state_idx, dest_idx, bias, accepted_out)


def make_step(rng: random.Random, kind: str, block_size: int, bias: int = 0) -> Step:
    """A step whose decision is of the given kind (checked against the reference by the caller)."""
    k = rng.randrange(2, 6)  # the step crosses into block k (index k - 1 is the destination)
    num_draft = rng.randrange(0, MAX_ACCEPTED)
    if kind == "none":  # stays inside a block: no copy
        offset = rng.randrange(1, block_size - MAX_ACCEPTED)
        running, accepted = k * block_size + offset, rng.randrange(1, MAX_ACCEPTED + 1)
        state_idx = k
    else:
        running = k * block_size - bias
        accepted = rng.randrange(bias + 1, MAX_ACCEPTED + 1)
        state_idx = k - 1 if kind in ("shift", "stay") else rng.randrange(0, k - 1)
    num_scheduled = num_draft + 1
    return Step(accepted, state_idx, num_scheduled, running - num_scheduled + num_draft, num_draft)


@dataclass
class Geometry:
    block_size: int
    conv_width: int
    conv_dim: int
    conv_dtype: torch.dtype
    temporal_shape: tuple
    num_layers: int = 2
    num_groups: int = 2
    ds: bool = False  # conv state (blocks, dim, width): CONV_STATE_DIM_FIRST


class Pools:
    """Per-layer conv and temporal pools plus the metadata the fused kernel reads."""

    def __init__(self, geo: Geometry, num_reqs: int, blocks_per_req: int, seed: int):
        self.geo = geo
        gen = torch.Generator().manual_seed(seed)
        num_blocks = num_reqs * blocks_per_req + 3
        self.states = []  # flattened: layer * 2 + (0 conv, 1 temporal)
        for _ in range(geo.num_layers):
            conv_shape = (geo.conv_dim, geo.conv_width) if geo.ds else (geo.conv_width, geo.conv_dim)
            conv = torch.randn(num_blocks, *conv_shape, generator=gen).to(geo.conv_dtype)
            temporal = torch.randn(num_blocks, *geo.temporal_shape, generator=gen)
            self.states += [conv.to(DEVICE), temporal.to(DEVICE)]
        # Each group owns its physical blocks: a shuffled, disjoint set per request.
        rng = random.Random(seed)
        self.tables = []
        for _ in range(geo.num_groups):
            ids = list(range(num_blocks))
            rng.shuffle(ids)
            table = torch.tensor(ids[: num_reqs * blocks_per_req], dtype=torch.int32).view(num_reqs, blocks_per_req)
            self.tables.append(table.to(DEVICE))
        self.group_of_layer = [layer % geo.num_groups for layer in range(geo.num_layers)]

    def metadata(self):
        base, stride, elem, inner, width, group, rows, row_stride = [], [], [], [], [], [], [], []
        for idx, state in enumerate(self.states):
            is_conv = idx % 2 == 0
            base.append(state.data_ptr())
            stride.append(state.stride(0) * state.element_size())
            elem.append(state.element_size())
            group.append(self.group_of_layer[idx // 2])
            if is_conv and self.geo.ds:  # as vLLM's context fills it for CONV_STATE_DIM_FIRST
                inner.append(1)
                width.append(state.size(2))
                rows.append(state.size(1))
                row_stride.append(state.stride(1) * state.element_size())
            else:
                inner.append(state.stride(1) if is_conv else state[0].numel())
                width.append(state.size(1) if is_conv else 0)
                rows.append(0)
                row_stride.append(0)

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=DEVICE)

        return dict(
            block_table_ptrs=t([tb.data_ptr() for tb in self.tables], torch.int64),
            block_table_stride=self.tables[0].stride(0),
            state_base_addrs=t(base, torch.int64),
            state_block_strides=t(stride, torch.int64),
            state_elem_sizes=t(elem, torch.int32),
            state_inner_sizes=t(inner, torch.int64),
            state_conv_widths=t(width, torch.int32),
            state_group_indices=t(group, torch.int32),
            state_dim_row_count=t(rows, torch.int32),
            state_dim_row_stride=t(row_stride, torch.int64),
        )

    def snapshot(self) -> list:
        return [s.cpu().contiguous().view(torch.uint8).numpy().reshape(-1).copy() for s in self.states]

    def oracle(self, before: list, decisions: list) -> list:
        """numpy memmove of every decided copy, request by request."""
        after = [b.copy() for b in before]
        tables = [tb.cpu().numpy() for tb in self.tables]
        for req, dec in enumerate(decisions):
            if not dec.copy:
                continue
            for idx, state in enumerate(self.states):
                table = tables[self.group_of_layer[idx // 2]][req]
                esize = state.element_size()
                block_bytes = state.stride(0) * esize
                dst = int(table[dec.dest_idx]) * block_bytes
                buf = after[idx]
                if idx % 2 == 0 and self.geo.ds:  # DS conv: per dim row, row[bias:] -> row[:width - bias]
                    row_bytes = state.stride(1) * esize
                    src = int(table[dec.src_idx]) * block_bytes + dec.bias * esize
                    size = (state.size(2) - dec.bias) * esize
                    for r in range(state.size(1)):
                        o = r * row_bytes
                        buf[dst + o : dst + o + size] = buf[src + o : src + o + size].copy()
                    continue
                if idx % 2 == 0:  # SD conv: state[src, bias:] -> state[dest, :width - bias]
                    row = state.stride(1) * esize
                    src = int(table[dec.src_idx]) * block_bytes + dec.bias * row
                    size = (state.size(1) - dec.bias) * row
                else:  # temporal: state[table[src + bias]] -> state[table[dest]]
                    src = int(table[dec.src_idx + dec.bias]) * block_bytes
                    size = state[0].numel() * esize
                buf[dst : dst + size] = buf[src : src + size].copy()
        return after


def run_fused(pools: Pools, steps: list, num_warps: int = 4, grid_rows: int | None = None) -> torch.Tensor:
    meta = pools.metadata()

    def col(name):
        return torch.tensor([getattr(s, name) for s in steps], dtype=torch.int32, device=DEVICE)

    accepted = col("num_accepted")
    accepted_out = accepted.clone()  # run_fused_postprocess initialises the output this way
    grid = (grid_rows or len(steps), len(pools.states))
    args = dict(
        num_accepted_tokens_ptr=accepted,
        mamba_state_idx_ptr=col("state_idx"),
        num_scheduled_tokens_ptr=col("num_scheduled"),
        num_computed_tokens_ptr=col("num_computed"),
        num_draft_tokens_ptr=col("num_draft"),
        block_table_ptrs_ptr=meta["block_table_ptrs"],
        block_table_stride_req=meta["block_table_stride"],
        state_base_addrs_ptr=meta["state_base_addrs"],
        state_block_strides_ptr=meta["state_block_strides"],
        state_elem_sizes_ptr=meta["state_elem_sizes"],
        state_inner_sizes_ptr=meta["state_inner_sizes"],
        state_conv_widths_ptr=meta["state_conv_widths"],
        state_group_indices_ptr=meta["state_group_indices"],
        state_dim_row_count_ptr=meta["state_dim_row_count"],
        state_dim_row_stride_ptr=meta["state_dim_row_stride"],
        num_accepted_tokens_out_ptr=accepted_out,
        idx_mapping_ptr=None,
        num_reqs=len(steps),
        block_size=pools.geo.block_size,
        COPY_BLOCK_SIZE=COPY_BLOCK_SIZE,
        CONV_STATE_DIM_FIRST=pools.geo.ds,
    )
    # The kernel's signature differs between releases: pass what this kernel file takes.
    postprocess_mamba_fused_kernel[grid](**{k: v for k, v in args.items() if k in KERNEL_ARGS}, num_warps=num_warps)
    _sync()
    return accepted_out.cpu()


def check(pools: Pools, steps: list, num_warps: int = 4, grid_rows: int | None = None) -> list:
    decisions = [reference_decision(s, pools.geo.block_size) for s in steps]
    before = pools.snapshot()
    accepted_out = run_fused(pools, steps, num_warps=num_warps, grid_rows=grid_rows)
    expected_out = [d.accepted_out for d in decisions]
    assert accepted_out.tolist() == expected_out, "num_accepted_tokens_out differs from the reference rule"
    after = pools.snapshot()
    expected = pools.oracle(before, decisions)
    bad = [i for i, (a, e) in enumerate(zip(after, expected)) if not np.array_equal(a, e)]
    if bad:
        nbytes = {i: int((after[i] != expected[i]).sum()) for i in bad}
        pytest.fail(f"state pools differ from memmove (state index: wrong bytes): {nbytes}")
    return decisions


SMALL = Geometry(block_size=16, conv_width=4, conv_dim=24, conv_dtype=torch.float16, temporal_shape=(4, 8))
SMALL_DS = dataclasses.replace(SMALL, ds=True)
GEOMETRY = {"sd": SMALL, "ds": SMALL_DS}


def test_reference_rule_examples():
    """The Python reference itself, on hand-computed cases (block_size 16)."""
    # running = 30 + 3 - 2 = 31, accepted 3 -> new 33, aligned 32: copy, bias 1, dest block 1.
    assert reference_decision(Step(3, 1, 3, 30, 2), 16) == Decision(True, 1, 1, 1, 1)
    # Same crossing, running state kept in block 0: a move between blocks, count kept.
    assert reference_decision(Step(3, 0, 3, 30, 2), 16) == Decision(True, 0, 1, 1, 3)
    # running = 32 exactly on the boundary, src == dest, bias 0: no copy, count reset to 1.
    assert reference_decision(Step(1, 1, 1, 31, 0), 16) == Decision(False, 1, 1, 0, 1)
    # running = 20, accepted 2 -> new 21 stays in block 1: no copy, count kept.
    assert reference_decision(Step(2, 1, 3, 19, 2), 16) == Decision(False, 1, -1, 0, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", range(3))
def test_same_block_conv_shift_every_bias_matches_memmove_and_reference(seed, layout):
    rng = random.Random(seed)
    kinds = [("shift", b) for b in range(1, SMALL.conv_width)]
    kinds += [("stay", 0), ("none", 0)] + [("move", b) for b in range(0, SMALL.conv_width)]
    kinds += [rng.choice(kinds) for _ in range(6)]
    rng.shuffle(kinds)
    steps = [make_step(rng, kind, SMALL.block_size, bias) for kind, bias in kinds]
    pools = Pools(GEOMETRY[layout], num_reqs=len(steps), blocks_per_req=12, seed=seed)
    decisions = check(pools, steps, grid_rows=len(steps) + 2)  # extra grid rows must do nothing
    # The generated kinds really are what the reference decides (keeps the generator honest).
    for (kind, bias), dec in zip(kinds, decisions):
        if kind == "shift":
            assert dec.copy and dec.src_idx == dec.dest_idx and dec.bias == bias and dec.accepted_out == 1
        elif kind == "stay":
            assert not dec.copy and dec.src_idx == dec.dest_idx and dec.accepted_out == 1
        elif kind == "move":
            assert dec.copy and dec.src_idx != dec.dest_idx and dec.bias == bias
        else:
            assert not dec.copy and dec.dest_idx == -1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", range(2))
def test_random_steps_match_reference(seed, layout):
    """Random per-request numbers (not generated by kind): decisions and copies follow the rule."""
    rng = random.Random(100 + seed)
    bs = SMALL.block_size
    steps = []
    for _ in range(16):
        num_draft = rng.randrange(0, MAX_ACCEPTED)
        running = rng.randrange(bs, 5 * bs)
        accepted = rng.randrange(1, num_draft + 2)
        dest = (running + accepted - 1) // bs - 1
        state_idx = rng.choice([dest, max(0, dest - 1), (running - 1) // bs])
        steps.append(Step(accepted, state_idx, num_draft + 1, running - 1, num_draft))
    pools = Pools(GEOMETRY[layout], num_reqs=len(steps), blocks_per_req=12, seed=seed)
    check(pools, steps)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_warps", [4] if INTERPRETED else [4, 8, 16])
def test_long_rows_small_shifts(num_warps, layout):
    """Same-block conv shifts of 16-48 bytes over ~32 KiB rows (SD: width 2049 x 16 bytes; DS: 8196 x 4 bytes,
    shifts of 4-12 bytes) on every request.

    On a GPU the unguarded kernel corrupts this geometry (lanes drift apart over 32 loop passes);
    the guarded kernel must give memmove results in every trial."""
    if INTERPRETED:
        geo = Geometry(block_size=16, conv_width=129, conv_dim=4, conv_dtype=torch.float32, temporal_shape=(8,))
        num_reqs, trials = 6, 1
    else:
        geo = Geometry(block_size=16, conv_width=2049, conv_dim=4, conv_dtype=torch.float32, temporal_shape=(64,))
        num_reqs, trials = 512, 5
    if layout == "ds":  # long DS rows: width x 4 bytes per row, 2 rows per block
        geo = dataclasses.replace(geo, conv_width=geo.conv_width * 4, conv_dim=2, ds=True)
    rng = random.Random(num_warps)
    for trial in range(trials):
        steps = [make_step(rng, "shift", geo.block_size, 1 + r % (MAX_ACCEPTED - 1)) for r in range(num_reqs)]
        pools = Pools(geo, num_reqs=num_reqs, blocks_per_req=8, seed=trial)
        check(pools, steps, num_warps=num_warps)
