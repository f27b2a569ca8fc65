# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Mamba state copy shared by the fused postprocess and V2 precopy kernels.

The kernels are launched directly (no engine) with the metadata vLLM's
postprocess context builds, in both conv layouts (SD: `(blocks, width, dim)`;
DS, CONV_STATE_DIM_FIRST: `(blocks, dim, width)`), and checked against two
oracles: a plain-Python model of the postprocess decision rule, and numpy
memmove of the decided copies applied request by request to byte snapshots of
every pool (so bytes outside the destinations must stay).

A same-block conv shift copies state[blk, bias:] to state[blk, :width - bias]
in place. With TEMPORAL_TILES > 1, a kernel that copies conv states in every
tile program shifts the DS rows once per tile
(`test_postprocess_matches_reference[ds-tiles4-*]`). Rows, tokens and temporal
states here span several copy blocks, so block order and masks are checked
too. The kernels support several releases' signatures: cases a kernel has no
arguments for (DS rows, tiles, index mapping, the V2 precopy kernel) are left
out.
"""

import random
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from vllm_ascend.ops.triton.mamba.postprocess import postprocess_mamba_fused_kernel

try:
    from vllm_ascend.ops.triton.v2.mamba.precopy import precopy_mamba_align_fused_kernel
except ImportError:  # releases without the V2 model runner
    precopy_mamba_align_fused_kernel = None

pytestmark = pytest.mark.skipif(not hasattr(torch, "npu") or not torch.npu.is_available(), reason="NPU required")

DEVICE = "npu"
SMALL_COPY_BLOCK = 32  # rows and temporal states span several copy blocks
MAX_ACCEPTED = 4  # 3 speculative tokens
KERNEL_ARGS = set(postprocess_mamba_fused_kernel.arg_names)
LAYOUTS = ["sd", "ds"] if "CONV_STATE_DIM_FIRST" in KERNEL_ARGS else ["sd"]
TILES = [1, 4] if "TEMPORAL_TILES" in KERNEL_ARGS else [1]
V2_FLAGS = [False, True] if "HAS_IDX_MAPPING" in KERNEL_ARGS else [False]


def _tensor(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


@dataclass(frozen=True)
class Step:
    """Per-request inputs of one postprocess step."""

    num_accepted: int
    state_idx: int  # mamba_state_idx: block column holding the running state
    num_scheduled: int
    num_computed: int
    num_draft: int


@dataclass(frozen=True)
class Copy:
    """`state[bt[src], bias:] -> state[bt[dest], :width - bias]` (conv), `state[bt[src + bias]] -> state[bt[dest]]`."""

    src: int
    dest: int
    bias: int


def reference_decision(step: Step, block_size: int) -> tuple[Copy | None, int]:
    """vLLM's postprocess_mamba rule, which the fused kernel mirrors: (copy or None, num_accepted_tokens out)."""
    running = step.num_computed + step.num_scheduled - step.num_draft
    aligned = (running + step.num_accepted - 1) // block_size * block_size
    if aligned < running:
        return None, step.num_accepted
    bias, dest = aligned - running, aligned // block_size - 1
    if step.state_idx != dest:
        return Copy(step.state_idx, dest, bias), step.num_accepted
    return (Copy(dest, dest, bias) if bias else None), 1


def make_step(rng: random.Random, kind: str, block_size: int, bias: int = 0) -> Step:
    """A step whose decision is of the given kind (the tests check it against the reference)."""
    k = rng.randrange(2, 6)  # the step crosses into block k (column k - 1 is the destination)
    num_draft = rng.randrange(0, MAX_ACCEPTED)
    if kind == "none":  # stays inside a block: no copy
        running, accepted = k * block_size + rng.randrange(1, block_size - MAX_ACCEPTED), rng.randrange(1, 5)
        state_idx = k
    else:
        running, accepted = k * block_size - bias, rng.randrange(bias + 1, MAX_ACCEPTED + 1)
        state_idx = k - 1 if kind in ("shift", "stay") else rng.randrange(0, k - 1)
    return Step(accepted, state_idx, num_draft + 1, running - 1, num_draft)


@dataclass(frozen=True)
class Geometry:
    block_size: int = 16
    conv_width: int = 4
    conv_dim: int = 40
    conv_dtype: torch.dtype = torch.float16
    temporal_shape: tuple = (3, 45)  # 270 bytes in fp16: block addresses alternate u64 and byte copies
    temporal_dtype: torch.dtype = torch.float16
    num_layers: int = 2
    num_groups: int = 2
    ds: bool = False  # conv state (blocks, dim, width): CONV_STATE_DIM_FIRST


class Pools:
    """Per-layer conv and temporal pools, per-group block tables, and the metadata the kernels read."""

    def __init__(self, geo: Geometry, num_rows: int, blocks_per_row: int, seed: int):
        self.geo = geo
        gen = torch.Generator().manual_seed(seed)
        num_blocks = num_rows * blocks_per_row + 3
        conv_shape = (geo.conv_dim, geo.conv_width) if geo.ds else (geo.conv_width, geo.conv_dim)
        self.states = []  # flattened: layer * 2 + (0 conv, 1 temporal)
        for _ in range(geo.num_layers):
            self.states.append(torch.randn(num_blocks, *conv_shape, generator=gen).to(geo.conv_dtype).to(DEVICE))
            temporal = torch.randn(num_blocks, *geo.temporal_shape, generator=gen)
            self.states.append(temporal.to(geo.temporal_dtype).to(DEVICE))
        rng = random.Random(seed)  # each group owns its blocks: a shuffled, disjoint set per table row
        self.tables = []
        for _ in range(geo.num_groups):
            ids = rng.sample(range(num_blocks), num_rows * blocks_per_row)
            self.tables.append(_tensor(ids).view(num_rows, blocks_per_row))
        self.group_of_state = [(i // 2) % geo.num_groups for i in range(len(self.states))]

    def metadata(self) -> dict:
        meta = dict(base=[], stride=[], elem=[], inner=[], width=[], rows=[], row_stride=[])
        for idx, state in enumerate(self.states):
            conv, esize = idx % 2 == 0, state.element_size()
            ds = conv and self.geo.ds  # as vLLM's context fills it for CONV_STATE_DIM_FIRST
            meta["base"].append(state.data_ptr())
            meta["stride"].append(state.stride(0) * esize)
            meta["elem"].append(esize)
            meta["inner"].append(1 if ds else state.stride(1) if conv else state[0].numel())
            meta["width"].append(state.size(2) if ds else state.size(1) if conv else 0)
            meta["rows"].append(state.size(1) if ds else 0)
            meta["row_stride"].append(state.stride(1) * esize if ds else 0)
        i64 = torch.int64
        return dict(
            block_table_ptrs_ptr=_tensor([t.data_ptr() for t in self.tables], i64),
            block_table_stride_req=self.tables[0].stride(0),
            state_base_addrs_ptr=_tensor(meta["base"], i64),
            state_block_strides_ptr=_tensor(meta["stride"], i64),
            state_elem_sizes_ptr=_tensor(meta["elem"]),
            state_inner_sizes_ptr=_tensor(meta["inner"], i64),
            state_conv_widths_ptr=_tensor(meta["width"]),
            state_group_indices_ptr=_tensor(self.group_of_state),
            state_dim_row_count_ptr=_tensor(meta["rows"]),
            state_dim_row_stride_ptr=_tensor(meta["row_stride"], i64),
        )

    def snapshot(self) -> list:
        return [s.cpu().contiguous().view(torch.uint8).numpy().reshape(-1).copy() for s in self.states]

    def expected(self, before: list, copies: dict) -> list:
        """numpy memmove of every copy ({block-table row: Copy}), row by row."""
        after = [b.copy() for b in before]
        tables = [t.cpu().numpy() for t in self.tables]
        for row, c in sorted(copies.items()):
            for idx, state in enumerate(self.states):
                table, esize, buf = tables[self.group_of_state[idx]][row], state.element_size(), after[idx]
                block = state.stride(0) * esize
                dst = int(table[c.dest]) * block
                if idx % 2:  # temporal
                    src, size = int(table[c.src + c.bias]) * block, state[0].numel() * esize
                elif self.geo.ds:  # every dim row: row[bias:] -> row[:width - bias]
                    rows = buf.reshape(-1, state.stride(1) * esize)  # a view: one dim row a line
                    src_row, dst_row, shift = (
                        int(table[c.src]) * block // rows.shape[1],
                        dst // rows.shape[1],
                        c.bias * esize,
                    )
                    n, size = state.size(1), (state.size(2) - c.bias) * esize
                    rows[dst_row : dst_row + n, :size] = rows[src_row : src_row + n, shift : shift + size].copy()
                    continue
                else:
                    token = state.stride(1) * esize
                    src, size = int(table[c.src]) * block + c.bias * token, (state.size(1) - c.bias) * token
                buf[dst : dst + size] = buf[src : src + size].copy()
        return after


def _check_pools(pools: Pools, before: list, copies: dict) -> None:
    after, expected = pools.snapshot(), pools.expected(before, copies)
    wrong = {i: int((a != e).sum()) for i, (a, e) in enumerate(zip(after, expected)) if not np.array_equal(a, e)}
    assert not wrong, f"state pools differ from memmove (state index: wrong bytes): {wrong}"


def _slots(num_rows: int, mapping: bool, rng: random.Random) -> list:
    """Request slot of each batch row: itself, or (HAS_IDX_MAPPING) shuffled sparse slots, the last row -1 (skip)."""
    if not mapping:
        return list(range(num_rows))
    slots = rng.sample(range(2 * num_rows), num_rows)
    return slots[:-1] + [-1]


def _per_slot(slots: list, values: list, fill: int) -> torch.Tensor:
    out = [fill] * max(max(slots) + 1, 1)
    for slot, value in zip(slots, values):
        if slot >= 0:
            out[slot] = value
    return _tensor(out)


def run_postprocess(
    pools,
    steps,
    *,
    tiles=1,
    mapping=False,
    precomputed=False,
    grid_extra=0,
    copy_block=SMALL_COPY_BLOCK,
    seed=0,
):
    """Launch the fused postprocess kernel (step b on batch row b) and check decisions and every pool byte."""
    rng = random.Random(seed)
    slots = _slots(len(steps), mapping, rng)
    decisions = [reference_decision(s, pools.geo.block_size) for s in steps]
    running = [s.num_computed + s.num_scheduled - s.num_draft for s in steps]
    if precomputed:  # num_computed_tokens holds the post-step count; the other counts must not be read
        computed = [r + s.num_accepted - 1 for r, s in zip(running, steps)]
        scheduled = draft = [10**6] * len(steps)
    else:
        computed, scheduled, draft = (
            [getattr(s, f) for s in steps] for f in ("num_computed", "num_scheduled", "num_draft")
        )
    accepted = _per_slot(slots, [s.num_accepted for s in steps], 1)
    accepted_out = accepted.clone()  # run_fused_postprocess initialises the output this way
    args = dict(
        num_accepted_tokens_ptr=accepted,
        mamba_state_idx_ptr=_per_slot(slots, [s.state_idx for s in steps], 0),
        num_scheduled_tokens_ptr=_per_slot(slots, scheduled, 0),
        num_computed_tokens_ptr=_per_slot(slots, computed, 0),
        num_draft_tokens_ptr=_per_slot(slots, draft, 0),
        num_accepted_tokens_out_ptr=accepted_out,
        idx_mapping_ptr=_tensor(slots) if mapping else None,
        num_reqs=len(steps),
        block_size=pools.geo.block_size,
        COPY_BLOCK_SIZE=copy_block,
        CONV_STATE_DIM_FIRST=pools.geo.ds,
        HAS_IDX_MAPPING=mapping,
        PRECOMPUTED_NEW_COMPUTED=precomputed,
        TEMPORAL_TILES=tiles,
        **pools.metadata(),
    )
    before = pools.snapshot()
    grid = (len(steps) + grid_extra, len(pools.states), tiles)
    # The signature differs between releases: pass what this kernel takes.
    postprocess_mamba_fused_kernel[grid](**{k: v for k, v in args.items() if k in KERNEL_ARGS})
    torch.npu.synchronize()
    expected_out = accepted.cpu().tolist()
    for slot, (_, out) in zip(slots, decisions):
        if slot >= 0:
            expected_out[slot] = out
    assert accepted_out.cpu().tolist() == expected_out, "num_accepted_tokens_out differs from the reference rule"
    _check_pools(pools, before, {b: c for b, (slot, (c, _)) in enumerate(zip(slots, decisions)) if slot >= 0 and c})
    return decisions


def run_precopy(pools, moves, *, tiles=1, mapping=False, seed=0):
    """Launch the V2 precopy kernel (move b = (src_col, dst_col, bias) on batch row b) and check every pool byte."""
    slots = _slots(len(moves), mapping, random.Random(seed))
    before = pools.snapshot()
    grid = (len(moves), len(pools.states), tiles)
    precopy_mamba_align_fused_kernel[grid](
        mamba_state_idx_ptr=_per_slot(slots, [m[1] for m in moves], 0),
        src_col_ptr=_per_slot(slots, [m[0] for m in moves], -1),
        token_bias_ptr=_per_slot(slots, [m[2] for m in moves], 0),
        idx_mapping_ptr=_tensor(slots) if mapping else None,
        num_reqs=len(moves),
        COPY_BLOCK_SIZE=SMALL_COPY_BLOCK,
        CONV_STATE_DIM_FIRST=pools.geo.ds,
        HAS_IDX_MAPPING=mapping,
        TEMPORAL_TILES=tiles,
        **pools.metadata(),
    )
    torch.npu.synchronize()
    copies = {b: Copy(*m) for b, (slot, m) in enumerate(zip(slots, moves)) if slot >= 0 and m[0] >= 0 and m[0] != m[1]}
    _check_pools(pools, before, copies)


def test_reference_rule_examples():
    """The Python reference itself, on hand-computed cases (block_size 16)."""
    # running = 30 + 3 - 2 = 31, accepted 3 -> new 33, aligned 32: shift by 1 inside block column 1.
    assert reference_decision(Step(3, 1, 3, 30, 2), 16) == (Copy(1, 1, 1), 1)
    # Same crossing, running state kept in column 0: a move between blocks, count kept.
    assert reference_decision(Step(3, 0, 3, 30, 2), 16) == (Copy(0, 1, 1), 3)
    # running = 32 exactly on the boundary, src == dest, bias 0: no copy, count reset to 1.
    assert reference_decision(Step(1, 1, 1, 31, 0), 16) == (None, 1)
    # running = 20, accepted 2 -> new 21 stays in block 1: no copy, count kept.
    assert reference_decision(Step(2, 1, 3, 19, 2), 16) == (None, 2)


@pytest.mark.parametrize("precomputed", V2_FLAGS, ids=lambda v: f"precomputed{int(v)}")
@pytest.mark.parametrize("mapping", V2_FLAGS, ids=lambda v: f"mapping{int(v)}")
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"tiles{t}")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_postprocess_matches_reference(layout, tiles, mapping, precomputed):
    """Every kind of step (shifts by 1..width-1 in place, stays, moves with every bias, no copy) in one batch."""
    geo = Geometry(ds=layout == "ds")
    seed = 16 * (layout == "ds") + 4 * tiles + 2 * mapping + precomputed
    rng = random.Random(seed)
    kinds = [("shift", b) for b in range(1, geo.conv_width)] + [("move", b) for b in range(geo.conv_width)]
    kinds += [("stay", 0), ("none", 0)]
    rng.shuffle(kinds)
    steps = [make_step(rng, kind, geo.block_size, bias) for kind, bias in kinds]
    pools = Pools(geo, num_rows=len(steps), blocks_per_row=8, seed=seed)
    decisions = run_postprocess(
        pools, steps, tiles=tiles, mapping=mapping, precomputed=precomputed, grid_extra=2, seed=seed
    )
    for (kind, bias), (c, out) in zip(kinds, decisions):  # the generator really makes these kinds
        assert {
            "shift": c is not None and c.src == c.dest and c.bias == bias and out == 1,
            "move": c is not None and c.src != c.dest and c.bias == bias,
            "stay": c is None and out == 1,
            "none": c is None,
        }[kind], (kind, bias, c, out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_postprocess_random_steps(layout):
    """Random per-request counts (not generated by kind): decisions and copies follow the rule."""
    rng, bs = random.Random(7), 16
    steps = []
    for _ in range(16):
        num_draft = rng.randrange(0, MAX_ACCEPTED)
        running, accepted = rng.randrange(bs, 5 * bs), rng.randrange(1, num_draft + 2)
        dest = (running + accepted - 1) // bs - 1
        state_idx = rng.choice([dest, max(0, dest - 1), (running - 1) // bs])
        steps.append(Step(accepted, state_idx, num_draft + 1, running - 1, num_draft))
    pools = Pools(Geometry(ds=layout == "ds"), num_rows=len(steps), blocks_per_row=8, seed=3)
    run_postprocess(pools, steps, tiles=TILES[-1])


if precopy_mamba_align_fused_kernel is not None:  # releases without the V2 model runner have no precopy

    @pytest.mark.parametrize("mapping", [False, True], ids=lambda v: f"mapping{int(v)}")
    @pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"tiles{t}")
    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_precopy_matches_reference(layout, tiles, mapping):
        """Moves into the new column with every bias, fresh states (src -1) and same-column skips."""
        geo = Geometry(ds=layout == "ds")
        moves = [(k - 1, k, bias) for k in (1, 4) for bias in range(geo.conv_width)]
        moves += [(2, 5, 1), (-1, 3, 0), (-1, 2, 2), (4, 4, 0), (4, 4, 2)]
        random.Random(tiles).shuffle(moves)
        pools = Pools(geo, num_rows=len(moves), blocks_per_row=8, seed=tiles + 2 * mapping)
        run_precopy(pools, moves, tiles=tiles, mapping=mapping, seed=5)


LONG_SHIFTS = {  # many tokens (SD) or long dim rows (DS) for a shift by 1..3 tokens
    "sd": Geometry(conv_width=129, conv_dim=4, conv_dtype=torch.float32),
    "ds": Geometry(conv_width=260, conv_dim=2, conv_dtype=torch.float32, ds=True),
}


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"tiles{t}")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_block_shifts_over_long_rows(layout, tiles):
    """Every request shifts its conv state in place by 1..3 tokens, over rows longer than one copy block."""
    geo = replace(LONG_SHIFTS[layout], temporal_shape=(8,), temporal_dtype=torch.float32)
    rng = random.Random(tiles)
    steps = [make_step(rng, "shift", geo.block_size, 1 + r % (MAX_ACCEPTED - 1)) for r in range(4)]
    run_postprocess(Pools(geo, num_rows=len(steps), blocks_per_row=8, seed=tiles), steps, tiles=tiles)
