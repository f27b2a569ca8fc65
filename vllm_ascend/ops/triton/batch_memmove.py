# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Batched memmove over (src_ptrs, dst_ptrs, sizes) for Mamba state moves, on ``batch_memcpy_kernel``.

``batch_memcpy_kernel`` copies each pair in one program, walking it forwards, and orders a block's
loads before its stores when the destination starts below an overlapping source (vLLM's
left-overlap guard). That covers every Mamba move: the conv-state shift moves left inside its
block; every other move is between distinct blocks. What one launch cannot do is order pairs
against each other, nor walk a pair backwards: the caller refuses a pair whose destination
overlaps its own source from above (``validate_copy_batch``) and marks in ``ordered`` the pairs
that interact with another pair (``conflicting_pairs``); those run one launch each, after the
others, in pair order. The result equals a memmove of every pair in pair order.
"""

import numpy as np
import torch

from vllm_ascend.ops.triton.batch_memcpy import batch_memcpy_kernel

# Bytes per loop pass: the block vllm-ascend launches batch_memcpy_kernel with.
BLOCK_SIZE = 8192
# triton-ascend flattens the grid into a coreDim that cannot exceed 65535 programs.
MAX_PROGRAMS = 65535


def _launch(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor) -> None:
    """One program a pair, in launches of at most MAX_PROGRAMS programs."""
    for start in range(0, sizes.shape[0], MAX_PROGRAMS):
        rows = slice(start, start + MAX_PROGRAMS)
        grid = (sizes[rows].shape[0],)
        batch_memcpy_kernel[grid](src_ptrs[rows], dst_ptrs[rows], sizes[rows], BLOCK_SIZE=BLOCK_SIZE)


def batch_memmove(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    ordered: np.ndarray | None = None,
) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i, as memmove in pair order.

    The tables are vLLM's ``batch_memcpy`` ones (1-D device tensors, int64 addresses, int32 byte
    counts), checked on the host before staging (``validate_copy_batch``). ``ordered`` (host bool
    mask, default none) marks the pairs that must run one by one, in pair order, after the others.
    """
    if ordered is None or not ordered.any():
        _launch(src_ptrs, dst_ptrs, sizes)
        return
    for rows in (np.flatnonzero(~ordered), *np.flatnonzero(ordered)[:, None]):
        if rows.size:
            index = torch.from_numpy(rows).to(src_ptrs.device)
            _launch(*(table.index_select(0, index) for table in (src_ptrs, dst_ptrs, sizes)))
