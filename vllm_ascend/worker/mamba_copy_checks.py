#
# Copyright (c) 2026 Huawei Technologies Co., Ltd. All Rights Reserved.
# This file is a part of the vllm-ascend project.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
"""Host-side checks of Mamba state copy metadata before a pointer kernel launch.

A pointer kernel (``batch_memcpy_kernel``, ``batch_memmove_kernel``) trusts its
``(src_ptrs, dst_ptrs, sizes)`` tables: a bad address does not raise inside a
kernel, it corrupts device memory (or kills the Triton interpreter). The tables
are on the host before they are staged, so two things are checked there:

* ``validate_copy_batch``: equal lengths, sizes in ``[0, 2**31)``, no address
  ``<= 0``, and, when the state pools are known, every source and destination
  range inside one pool. A violation raises ``MambaCopyValidationError`` naming
  the pair.
* ``plan_ordered_launches``: the programs of one launch run in no defined order,
  so a batch in which one pair's destination overlaps another pair's source or
  destination has no safe order inside one launch. Such batches are split into
  ordered launches (each pair in the launch after the last earlier pair it
  conflicts with), which equals a serial memmove in pair order, the semantics of
  the tensor-copy path. Hazard-free batches (the normal case; several pairs
  reading one shared block is read-read) stay one launch. The check is
  O(n log n): sort the destinations, binary-search the sources.
"""

import numpy as np

_MAX_SIZE = 2**31  # sizes are int32 on the device


class MambaCopyValidationError(ValueError):
    pass


def validate_copy_batch(src_ptrs, dst_ptrs, sizes, pools: dict[int, int] | None = None) -> None:
    """Refuse bad copy metadata. ``pools`` maps a state pool's first byte address to its end."""
    src = np.asarray(src_ptrs, dtype=np.int64)
    dst = np.asarray(dst_ptrs, dtype=np.int64)
    size = np.asarray(sizes, dtype=np.int64)
    if not (src.shape == dst.shape == size.shape) or src.ndim != 1:
        raise MambaCopyValidationError(
            f"Mamba state copy metadata of different lengths: src_ptrs {src.shape}, "
            f"dst_ptrs {dst.shape}, sizes {size.shape}"
        )
    checks = [
        ("size outside [0, 2**31)", (size < 0) | (size >= _MAX_SIZE)),
        ("source address <= 0", src <= 0),
        ("destination address <= 0", dst <= 0),
    ]
    if pools:
        starts = np.array(sorted(pools), dtype=np.int64)
        ends = np.array([pools[s] for s in starts.tolist()], dtype=np.int64)
        for what, ptr in (("source", src), ("destination", dst)):
            pool = np.searchsorted(starts, ptr, side="right") - 1
            inside = (pool >= 0) & (ptr + size <= ends[np.maximum(pool, 0)])
            checks.append((f"{what} range outside every state pool", ~inside))
    for what, bad in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise MambaCopyValidationError(
                f"Invalid Mamba state copy {i} of {src.size}: {what} "
                f"(src=0x{int(src[i]):x}, dst=0x{int(dst[i]):x}, size={int(size[i])})"
            )


def _conflict_predecessors(src: list[int], dst: list[int], sizes: list[int]) -> list[list[int]]:
    """For each pair, the earlier pairs it conflicts with (a sweep over sorted intervals).

    Two pairs conflict when a destination of one overlaps the source or the
    destination of the other. Only reached for batches known to hold a hazard.
    """
    intervals = []
    for i, (s, d, z) in enumerate(zip(src, dst, sizes)):
        if z > 0:
            intervals.append((s, s + z, i, False))
            intervals.append((d, d + z, i, True))
    intervals.sort()
    preds: list[list[int]] = [[] for _ in src]
    active: list[tuple[int, int, bool]] = []
    for start, end, pair, is_dst in intervals:
        active = [a for a in active if a[0] > start]
        for _, other, other_is_dst in active:
            if other != pair and (is_dst or other_is_dst):
                first, last = min(pair, other), max(pair, other)
                preds[last].append(first)
        active.append((end, pair, is_dst))
    return preds


def plan_ordered_launches(src_ptrs, dst_ptrs, sizes) -> list[np.ndarray] | None:
    """``None`` if the batch is safe as one launch, else the pair indices of each ordered launch."""
    src = np.asarray(src_ptrs, dtype=np.int64)
    dst = np.asarray(dst_ptrs, dtype=np.int64)
    size = np.asarray(sizes, dtype=np.int64)
    live = np.nonzero(size > 0)[0]
    if live.size < 2:
        return None
    s, d, z = src[live], dst[live], size[live]
    order = np.argsort(d, kind="stable")
    d_start = d[order]
    d_end = d_start + z[order]
    if np.any(d_start[1:] < np.maximum.accumulate(d_end)[:-1]):
        hazard = True  # two destinations overlap
    else:
        # Destinations are disjoint and sorted, so their ends are sorted too.
        first = np.searchsorted(d_end, s, side="right")  # first destination ending after s
        stop = np.searchsorted(d_start, s + z, side="left")  # destinations starting before s + z
        count = stop - first
        own = (count == 1) & (order[np.minimum(first, live.size - 1)] == np.arange(live.size))
        hazard = bool(np.any((count > 0) & ~own))
    if not hazard:
        return None

    preds = _conflict_predecessors(src.tolist(), dst.tolist(), size.tolist())
    level = [0] * len(preds)
    for i, before in enumerate(preds):
        for j in before:
            level[i] = max(level[i], level[j] + 1)
    levels = np.asarray(level, dtype=np.int64)
    return [np.nonzero(levels == k)[0] for k in range(int(levels.max()) + 1)]
