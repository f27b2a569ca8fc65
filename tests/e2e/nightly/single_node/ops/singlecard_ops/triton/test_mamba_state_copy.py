# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import pytest
import torch

from vllm_ascend.ops.triton.mamba.postprocess import postprocess_mamba_fused_kernel

pytestmark = pytest.mark.skipif(not torch.npu.is_available(), reason="NPU required")

BLOCK_SIZE = 16
CONV_WIDTH = 4
NUM_COLS = 6  # the speculative tokens' temporal states follow the running state's column
COPY_BLOCK_SIZE = 32  # rows, tokens and temporal states span several copy blocks
# Per layer: the conv element type and dim (tokens of 400, 804 and 203 bytes).
LAYERS = [(torch.float16, 200), (torch.float32, 201), (torch.uint8, 203)]
TEMPORAL_SHAPE = (3, 45)  # 270 bytes in fp16: every fourth block is 8-byte aligned
# (running state column, tokens in the running state, accepted tokens) per request. All but the
# last align at 48 tokens (column 2): shifts by 1-3 inside column 2, moves from columns 0 and 1,
# a stay with no shift; the last one copies nothing.
REQUESTS = [(2, 47, 2), (2, 46, 3), (2, 45, 4), (0, 46, 4), (1, 48, 1), (2, 48, 1), (3, 50, 2)]


def _states(num_blocks, device, conv_dim_first):
    states = []
    for dtype, dim in LAYERS:
        shape = (num_blocks, dim, CONV_WIDTH) if conv_dim_first else (num_blocks, CONV_WIDTH, dim)
        states.append(torch.randint(0, 100, shape, device=device).to(dtype))
        states.append(torch.randn((num_blocks, *TEMPORAL_SHAPE), device=device).to(torch.float16))
    return states


def _meta(states, device, conv_dim_first):
    def tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    convs = states[0::2]
    return (
        tensor([s.data_ptr() for s in states]),
        tensor([s.stride(0) * s.element_size() for s in states]),
        tensor([s.element_size() for s in states], torch.int32),
        tensor([v for c, t in zip(convs, states[1::2]) for v in (1 if conv_dim_first else c.size(2), t[0].numel())]),
        tensor([CONV_WIDTH, 0] * len(convs), torch.int32),
        tensor([0] * len(states), torch.int32),
        tensor([v for c in convs for v in (c.size(1) if conv_dim_first else 0, 0)], torch.int32),
        tensor([v for c in convs for v in (c.stride(1) * c.element_size() if conv_dim_first else 0, 0)]),
    )


def _reference(states, block_table, mapping, conv_dim_first):
    """postprocess_mamba's rule, and torch copies of a snapshot: (states, accepted tokens out)."""
    before, after = [s.cpu().clone() for s in states], [s.cpu().clone() for s in states]
    accepted_out = [-1] * len(REQUESTS)
    for row, req in enumerate(mapping):
        if req < 0:
            continue
        src, running, accepted = REQUESTS[req]
        aligned = (running + accepted - 1) // BLOCK_SIZE * BLOCK_SIZE
        if aligned < running:
            continue
        bias, dst = aligned - running, aligned // BLOCK_SIZE - 1
        if src == dst:
            accepted_out[req] = 1
            if bias == 0:
                continue
        src_block, dst_block = int(block_table[row, src]), int(block_table[row, dst])
        for conv, temporal in zip(range(0, len(states), 2), range(1, len(states), 2)):
            if conv_dim_first:
                after[conv][dst_block, :, : CONV_WIDTH - bias] = before[conv][src_block, :, bias:]
            else:
                after[conv][dst_block, : CONV_WIDTH - bias] = before[conv][src_block, bias:]
            after[temporal][dst_block] = before[temporal][int(block_table[row, src + bias])]
    return after, torch.tensor(accepted_out, dtype=torch.int32)


@pytest.mark.parametrize("precomputed", [False, True], ids=["counts", "precomputed"])
@pytest.mark.parametrize("has_idx_mapping", [False, True], ids=["req-rows", "idx-mapping"])
@pytest.mark.parametrize("temporal_tiles", [1, 4], ids=["tiles1", "tiles4"])
@pytest.mark.parametrize("conv_dim_first", [False, True], ids=["sd", "ds"])
def test_postprocess_shifts_conv_state_in_place(conv_dim_first, temporal_tiles, has_idx_mapping, precomputed):
    device = torch.device("npu:0")
    torch.manual_seed(0)
    num_rows = len(REQUESTS) + 1
    mapping = [3, 0, 6, -1, 1, 5, 2, 4] if has_idx_mapping else list(range(len(REQUESTS)))
    num_blocks = num_rows * NUM_COLS + 1
    block_table = torch.randperm(num_blocks, dtype=torch.int32)[: num_rows * NUM_COLS].view(num_rows, NUM_COLS)
    states = _states(num_blocks, device, conv_dim_first)
    expected, expected_out = _reference(states, block_table, mapping, conv_dim_first)

    def tensor(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    src_cols, running, accepted = zip(*REQUESTS)
    new_computed = [r + a - 1 for r, a in zip(running, accepted)]
    block_table = block_table.to(device)
    accepted_out = tensor([-1] * len(REQUESTS))
    postprocess_mamba_fused_kernel[(len(mapping), len(states), temporal_tiles)](
        tensor(accepted),
        tensor(src_cols),
        None if precomputed else tensor([4] * len(REQUESTS)),
        tensor(new_computed if precomputed else [r - 1 for r in running]),
        None if precomputed else tensor([3] * len(REQUESTS)),
        torch.tensor([block_table.data_ptr()], dtype=torch.int64, device=device),
        block_table.stride(0),
        *_meta(states, device, conv_dim_first),
        accepted_out,
        tensor(mapping) if has_idx_mapping else None,
        len(mapping),
        block_size=BLOCK_SIZE,
        COPY_BLOCK_SIZE=COPY_BLOCK_SIZE,
        CONV_STATE_DIM_FIRST=conv_dim_first,
        HAS_IDX_MAPPING=has_idx_mapping,
        PRECOMPUTED_NEW_COMPUTED=precomputed,
        TEMPORAL_TILES=temporal_tiles,
    )
    torch.npu.synchronize()
    for actual, reference in zip(states, expected):
        torch.testing.assert_close(actual.cpu(), reference, rtol=0, atol=0)
    assert torch.equal(accepted_out.cpu(), expected_out)
