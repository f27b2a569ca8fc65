# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Mamba state-block copy shared by the fused postprocess and V2 precopy kernels.

As vLLM 0.30's shared copy body: conv states are copied by tile 0 only, and an
in-place conv shift (dst < src < dst + size) needs no barrier, since each lane
reads a byte before it overwrites it. Pointer casts stay out of the loops and
no condition chains `and` (triton-ascend's front end rejects both).
"""

from vllm.triton_utils import tl, triton


@triton.jit
def _copy_tiled(src, dst, n, tile_idx, COPY_BLOCK_SIZE: tl.constexpr, TILES: tl.constexpr):
    # Tile `tile_idx` of TILES copies its COPY_BLOCK_SIZE-aligned slice of
    # elements [0, n). Lane k always copies the elements at i + k: the same
    # lane reads and later writes a byte (lane ownership).
    per_tile = tl.cdiv(tl.cdiv(n, TILES), COPY_BLOCK_SIZE) * COPY_BLOCK_SIZE
    start = tile_idx.to(tl.int64) * per_tile
    end = tl.minimum(start + per_tile, n)
    offsets = tl.arange(0, COPY_BLOCK_SIZE)
    for i in range(start, end, COPY_BLOCK_SIZE):
        mask = (i + offsets) < end
        tl.store(dst + i + offsets, tl.load(src + i + offsets, mask=mask), mask=mask)


@triton.jit
def _copy_temporal_state(
    src_addr,
    dst_addr,
    copy_size,
    tile_idx,
    COPY_BLOCK_SIZE: tl.constexpr,
    TEMPORAL_TILES: tl.constexpr,
):
    # Temporal states do not overlap: a u64 body split across the tiles, tile 0
    # copying the 0-7 byte tail; a byte copy when an address is not 8-byte aligned.
    src_u8 = src_addr.to(tl.pointer_type(tl.uint8))
    dst_u8 = dst_addr.to(tl.pointer_type(tl.uint8))
    if ((src_addr | dst_addr) & 7) == 0:
        src_u64 = src_addr.to(tl.pointer_type(tl.uint64))
        dst_u64 = dst_addr.to(tl.pointer_type(tl.uint64))
        _copy_tiled(src_u64, dst_u64, copy_size // 8, tile_idx, COPY_BLOCK_SIZE, TEMPORAL_TILES)
        if tile_idx == 0:
            tail = copy_size // 8 * 8 + tl.arange(0, 8)
            tl.store(dst_u8 + tail, tl.load(src_u8 + tail, mask=tail < copy_size), mask=tail < copy_size)
    else:
        _copy_tiled(src_u8, dst_u8, copy_size, tile_idx, COPY_BLOCK_SIZE, TEMPORAL_TILES)


@triton.jit
def copy_mamba_state_block(
    state_idx,
    bt_row_idx,
    src_col,
    dst_col,
    token_bias,
    block_table_ptrs_ptr,
    block_table_stride_req,
    state_base_addrs_ptr,
    state_block_strides_ptr,
    state_elem_sizes_ptr,
    state_inner_sizes_ptr,
    state_conv_widths_ptr,
    state_group_indices_ptr,
    state_dim_row_count_ptr,
    state_dim_row_stride_ptr,
    tile_idx,
    COPY_BLOCK_SIZE: tl.constexpr,
    CONV_STATE_DIM_FIRST: tl.constexpr,
    TEMPORAL_TILES: tl.constexpr,
):
    """Copy one request's (layer, state) block from block column `src_col` to `dst_col`.

    Conv (conv_width > 0): `state[bt[src_col], bias:] -> state[bt[dst_col], :width - bias]`,
    per dim row with CONV_STATE_DIM_FIRST. Temporal: `state[bt[src_col + bias]] -> state[bt[dst_col]]`.
    """
    base = tl.load(state_base_addrs_ptr + state_idx)
    block_stride = tl.load(state_block_strides_ptr + state_idx)
    elem_size = tl.load(state_elem_sizes_ptr + state_idx)
    conv_width = tl.load(state_conv_widths_ptr + state_idx)
    group_idx = tl.load(state_group_indices_ptr + state_idx).to(tl.int64)
    block_table = tl.load(block_table_ptrs_ptr + group_idx).to(tl.pointer_type(tl.int32))
    block_table += bt_row_idx * block_table_stride_req
    # int64 block ids: block_id * block_stride can exceed 2**31 bytes.
    dst_addr = base + tl.load(block_table + dst_col).to(tl.int64) * block_stride
    inner_bytes = tl.load(state_inner_sizes_ptr + state_idx) * elem_size

    if conv_width == 0:
        src_addr = base + tl.load(block_table + src_col + token_bias).to(tl.int64) * block_stride
        _copy_temporal_state(src_addr, dst_addr, inner_bytes, tile_idx, COPY_BLOCK_SIZE, TEMPORAL_TILES)
        return
    # Conv states are small: tile 0 copies them (another tile would shift again).
    if tile_idx > 0:
        return
    src = (base + tl.load(block_table + src_col).to(tl.int64) * block_stride).to(tl.pointer_type(tl.uint8))
    dst = dst_addr.to(tl.pointer_type(tl.uint8))
    if CONV_STATE_DIM_FIRST:
        # DS (blocks, dim, width): one lane per dim row, walking its bytes upwards.
        row_count = tl.load(state_dim_row_count_ptr + state_idx)
        row_stride = tl.load(state_dim_row_stride_ptr + state_idx)
        src += token_bias.to(tl.int64) * elem_size
        offsets = tl.arange(0, COPY_BLOCK_SIZE)
        for first_row in range(0, row_count, COPY_BLOCK_SIZE):
            mask = (first_row + offsets) < row_count
            rows = (first_row + offsets).to(tl.int64) * row_stride
            for b in range(0, (conv_width - token_bias).to(tl.int64) * elem_size):
                tl.store(dst + rows + b, tl.load(src + rows + b, mask=mask), mask=mask)
    else:
        # SD (blocks, width, dim): token by token upwards, inner_bytes a token.
        src += token_bias.to(tl.int64) * inner_bytes
        for token in range(0, conv_width - token_bias):
            _copy_tiled(src + token * inner_bytes, dst + token * inner_bytes, inner_bytes, tile_idx, COPY_BLOCK_SIZE, 1)
