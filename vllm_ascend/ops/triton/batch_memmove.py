# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Batched, overlap-safe memmove over (src_ptrs, dst_ptrs, sizes).

``batch_memcpy_kernel`` walks every pair forwards with no ordering between its
loads and stores: a race when a pair overlaps itself, as the align-mode conv
shift ``state[blk, bias:]`` -> ``state[blk, :width - bias]`` does. Here a pair
with ``dst < src`` overlapping is walked forwards with ``tl.debug_barrier()``
between load and store, ``dst > src`` overlapping backwards with the same
barrier, and other pairs with no barrier, split over ``tiles`` programs. Pairs
are not ordered against each other (the caller splits such batches). The
int -> pointer casts stay outside the loops and no condition chains
``A and B and C`` (triton-ascend limits).
"""

import torch
from vllm.triton_utils import tl, triton

# Bytes per program per loop pass: batch_memcpy's block on Ascend. triton-ascend keeps the block in
# the AI core's unified buffer, where batch_memcpy_kernel already loads and stores one this size.
BLOCK_SIZE = 8192
# triton-ascend flattens the grid into a coreDim that cannot exceed 65535 programs.
MAX_PROGRAMS = 65535


@triton.jit
def _copy_strided(src_ptr, dst_ptr, size, start, step, offsets, BLOCK_SIZE: tl.constexpr):
    # Blocks start, start + step, ... of a non-overlapping pair; no barrier.
    for i in range(start, size, step):
        mask = (i + offsets) < size
        data = tl.load(src_ptr + i + offsets, mask=mask)
        tl.store(dst_ptr + i + offsets, data, mask=mask)


@triton.jit
def _move_forward(src_ptr, dst_ptr, size, offsets, BLOCK_SIZE: tl.constexpr):
    # dst < src: every lane has loaded block i before any lane stores it.
    for i in range(0, size, BLOCK_SIZE):
        mask = (i + offsets) < size
        data = tl.load(src_ptr + i + offsets, mask=mask)
        tl.debug_barrier()
        tl.store(dst_ptr + i + offsets, data, mask=mask)


@triton.jit
def _move_backward(src_ptr, dst_ptr, size, offsets, BLOCK_SIZE: tl.constexpr):
    # dst > src: last block first, so a store only lands on source bytes that
    # have been loaded already.
    num_blocks = (size + BLOCK_SIZE - 1) // BLOCK_SIZE
    for j in range(0, num_blocks):
        i = (num_blocks - 1 - j) * BLOCK_SIZE
        mask = (i + offsets) < size
        data = tl.load(src_ptr + i + offsets, mask=mask)
        tl.debug_barrier()
        tl.store(dst_ptr + i + offsets, data, mask=mask)


@triton.jit
def _move_pair(src_ptr, dst_ptr, size, is_left, is_right, tile, num_tiles, offsets, BLOCK_SIZE: tl.constexpr):
    if is_left:
        if tile == 0:
            _move_forward(src_ptr, dst_ptr, size, offsets, BLOCK_SIZE)
    elif is_right:
        if tile == 0:
            _move_backward(src_ptr, dst_ptr, size, offsets, BLOCK_SIZE)
    else:
        _copy_strided(src_ptr, dst_ptr, size, tile * BLOCK_SIZE, num_tiles * BLOCK_SIZE, offsets, BLOCK_SIZE)


@triton.jit
def batch_memmove_kernel(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE: tl.constexpr):
    """Grid (num_pairs, tiles): program (p, t) handles part of pair p."""
    pair = tl.program_id(0)
    tile = tl.program_id(1)
    num_tiles = tl.num_programs(1)

    src = tl.load(src_ptrs + pair)
    dst = tl.load(dst_ptrs + pair)
    size = tl.load(sizes + pair).to(tl.int64)

    # Overlap kind of this pair, each from one comparison pair (no chained and).
    is_left = (dst < src) & ((dst + size) > src)
    is_right = (src < dst) & ((src + size) > dst)
    is_moving = (src != dst) & (size > 0)

    if is_moving:
        is_aligned = ((src | dst | size) % 16) == 0
        offsets = tl.arange(0, BLOCK_SIZE)
        if is_aligned:
            # Tell the compiler what the branch condition proved. These casts
            # are distinct ops from the unaligned branch's, so the hints do not
            # leak into it.
            size_a = (size // 16) * 16
            src_ptr = tl.multiple_of(src.to(tl.pointer_type(tl.uint8)), 16)
            dst_ptr = tl.multiple_of(dst.to(tl.pointer_type(tl.uint8)), 16)
            _move_pair(src_ptr, dst_ptr, size_a, is_left, is_right, tile, num_tiles, offsets, BLOCK_SIZE)
        else:
            src_ptr = src.to(tl.pointer_type(tl.uint8))
            dst_ptr = dst.to(tl.pointer_type(tl.uint8))
            _move_pair(src_ptr, dst_ptr, size, is_left, is_right, tile, num_tiles, offsets, BLOCK_SIZE)


def batch_memmove(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    *,
    block_size: int = BLOCK_SIZE,
    tiles: int = 1,
) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i, as memmove.

    Same call signature as vLLM's ``batch_memcpy``: 1-D device tensors, int64
    addresses and int32 byte counts, one launch for the whole batch (in chunks of
    MAX_PROGRAMS programs). Only cheap checks run here (no device-to-host
    synchronisation); the addresses must be valid device memory and no pair may
    overlap another pair. ``tiles`` programs share each pair that does not
    overlap itself; one by default, as ``mamba_utils._TEMPORAL_TILES`` on Ascend:
    a step's pairs (requests x layers x states) already outnumber the AI cores.
    """
    tables = (src_ptrs, dst_ptrs, sizes)
    if [(t.dtype, t.dim(), t.shape[0], t.device) for t in tables] != [
        (dtype, 1, src_ptrs.shape[0], src_ptrs.device) for dtype in (torch.int64, torch.int64, torch.int32)
    ]:
        raise ValueError(
            "batch_memmove: src_ptrs and dst_ptrs must be 1-D int64, sizes 1-D int32, of one length and "
            f"device; got {[(t.dtype, tuple(t.shape), str(t.device)) for t in tables]}"
        )
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"batch_memmove: block_size must be a power of two >= 16, got {block_size}")
    if not 1 <= tiles <= MAX_PROGRAMS:
        raise ValueError(f"batch_memmove: tiles must be in [1, {MAX_PROGRAMS}], got {tiles}")
    chunk = MAX_PROGRAMS // tiles
    for start in range(0, src_ptrs.shape[0], chunk):
        rows = slice(start, start + chunk)
        grid = (sizes[rows].shape[0], tiles)
        batch_memmove_kernel[grid](src_ptrs[rows], dst_ptrs[rows], sizes[rows], BLOCK_SIZE=block_size)
