# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Mamba state-block copy shared by the fused postprocess and V2 precopy kernels.

As vLLM 0.30's shared copy body: conv states are copied by tile 0 only; a conv
copy between two blocks (or with no shift) is one vectorised copy, and only a
shift inside one block (dst < src < dst + size) goes token by token, from low
to high: step t loads token t + bias and stores token t, so the store that
overwrites a token (step t) follows the step that loaded it (t - bias).

That order needs no barrier where one program's loads and stores keep program
order between dependent accesses. On Ascend a program runs on one AI core: a
load moves a block from global memory to UB (MTE2), a store from UB to global
memory (MTE3), and the compiler synchronises the two pipes. A store waits for
the load whose data it writes (step t), which the MTE2 queue issues after the
load of step t - bias. Pointer casts stay out of the loops and no condition
chains `and` (triton-ascend's front end rejects both).
"""

from vllm.triton_utils import tl, triton


@triton.jit
def _copy_tiled(src, dst, n, tile_idx, COPY_BLOCK_SIZE: tl.constexpr, TILES: tl.constexpr):
    # Tile `tile_idx` of TILES copies its COPY_BLOCK_SIZE-aligned slice of
    # elements [0, n), one block after another from low to high.
    n = n.to(tl.int64)
    per_tile = tl.cdiv(tl.cdiv(n, TILES), COPY_BLOCK_SIZE) * COPY_BLOCK_SIZE
    start = per_tile * tile_idx
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
    # Regions that do not overlap: a u64 body split across the tiles, tile 0
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
def _copy_tokens(src, dst, token_len, num_tokens, COPY_BLOCK_SIZE: tl.constexpr):
    # Token t of `src` to token t of `dst`, t from low to high: a left shift in
    # place loads each token before the later step that overwrites it.
    for token in range(0, num_tokens):
        _copy_tiled(src + token * token_len, dst + token * token_len, token_len, 0, COPY_BLOCK_SIZE, 1)


@triton.jit
def _copy_dim_rows(src, dst, row_count, row_stride, row_len, COPY_BLOCK_SIZE: tl.constexpr):
    # Elements [0, row_len) of every row (`row_stride` elements apart), each
    # lane one row, its elements from low to high (as _copy_tokens).
    offsets = tl.arange(0, COPY_BLOCK_SIZE)
    for first_row in range(0, row_count, COPY_BLOCK_SIZE):
        mask = (first_row + offsets) < row_count
        rows = (first_row + offsets).to(tl.int64) * row_stride
        for e in range(0, row_len):
            tl.store(dst + rows + e, tl.load(src + rows + e, mask=mask), mask=mask)


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
    dst_block_id = tl.load(block_table + dst_col).to(tl.int64)
    dst_addr = base + dst_block_id * block_stride
    inner_bytes = tl.load(state_inner_sizes_ptr + state_idx) * elem_size

    if conv_width == 0:
        src_addr = base + tl.load(block_table + src_col + token_bias).to(tl.int64) * block_stride
        _copy_temporal_state(src_addr, dst_addr, inner_bytes, tile_idx, COPY_BLOCK_SIZE, TEMPORAL_TILES)
        return
    # Conv states are small: tile 0 copies them (another tile would shift again).
    if tile_idx > 0:
        return
    src_block_id = tl.load(block_table + src_col).to(tl.int64)
    src_addr = base + src_block_id * block_stride
    num_tokens = (conv_width - token_bias).to(tl.int64)
    if CONV_STATE_DIM_FIRST:
        # DS (blocks, dim, width): whole elements, one dim row per lane.
        row_count = tl.load(state_dim_row_count_ptr + state_idx)
        row_stride = tl.load(state_dim_row_stride_ptr + state_idx)
        src_addr += token_bias.to(tl.int64) * elem_size
        if elem_size == 2:
            src16 = src_addr.to(tl.pointer_type(tl.uint16))
            dst16 = dst_addr.to(tl.pointer_type(tl.uint16))
            _copy_dim_rows(src16, dst16, row_count, row_stride // 2, num_tokens, COPY_BLOCK_SIZE)
        elif elem_size == 4:
            src32 = src_addr.to(tl.pointer_type(tl.uint32))
            dst32 = dst_addr.to(tl.pointer_type(tl.uint32))
            _copy_dim_rows(src32, dst32, row_count, row_stride // 4, num_tokens, COPY_BLOCK_SIZE)
        else:  # other element sizes: their bytes, in order
            src8 = src_addr.to(tl.pointer_type(tl.uint8))
            dst8 = dst_addr.to(tl.pointer_type(tl.uint8))
            _copy_dim_rows(src8, dst8, row_count, row_stride, num_tokens * elem_size, COPY_BLOCK_SIZE)
        return
    # SD (blocks, width, dim): tokens are contiguous, inner_bytes each.
    src_addr += token_bias.to(tl.int64) * inner_bytes
    if (src_block_id != dst_block_id) | (token_bias == 0):
        # Different blocks never overlap, nor does an unshifted copy: one vectorised copy.
        _copy_temporal_state(src_addr, dst_addr, num_tokens * inner_bytes, tile_idx, COPY_BLOCK_SIZE, 1)
    elif ((src_addr | dst_addr | inner_bytes) & 7) == 0:
        # A shift inside one block: token by token, upwards, whole u64 words where aligned.
        src64 = src_addr.to(tl.pointer_type(tl.uint64))
        dst64 = dst_addr.to(tl.pointer_type(tl.uint64))
        _copy_tokens(src64, dst64, inner_bytes // 8, num_tokens, COPY_BLOCK_SIZE)
    else:
        src8 = src_addr.to(tl.pointer_type(tl.uint8))
        dst8 = dst_addr.to(tl.pointer_type(tl.uint8))
        _copy_tokens(src8, dst8, inner_bytes, num_tokens, COPY_BLOCK_SIZE)
