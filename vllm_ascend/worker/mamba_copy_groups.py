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
"""Grouped tensor copies and vectorised metadata collection for Mamba state moves.

Align mode moves Mamba states between cache blocks. The safe copy path copies
every pair as ``dst.copy_(src.clone())`` over per-pair tensor views, collected
by a Python loop over requests, layers and states. Both halves are host-bound:
collecting costs microseconds per pair and every pair is two launches.

This module does the same work in bulk. It imports only torch and numpy.

**Vectorised collection** (``CopyLayout``, ``collect_request``). Per KV-cache
layout, every (layer, state) gets its base address, block stride and, per
accepted-token offset ``k``, the source offset and size its copy function
gives. vLLM's two copy functions are affine in the block id:

* ``get_conv_copy_spec``: source ``state[block_ids[cur], k:]``, i.e. block
  ``block_ids[cur]`` shifted by ``k`` rows ("offset" kind);
* ``get_temporal_copy_spec``: source ``state[block_ids[cur + k]]``, a whole
  block ("index" kind).

The parameters are read from the copy functions themselves (called on probe
block tables and checked on a second probe), so the addresses are exactly the
ones the functions return. Per request, the source and destination address of
every layer and state then come from numpy arithmetic over three block ids.
Copy functions not recognised (or whose probe disagrees, or raises) are called
per pair as before, and their pairs are copied per pair.

**Grouped copies** (``plan_copies``, ``run_copies``, ``copy_rows``). The pairs of
one storage form one group: vLLM views a layer's conv and temporal states into
one raw KV-cache tensor with a per-block page stride, so both states of a
layer are copied together (state tensors in separate allocations: one group
per pool; a storage whose common row would be short, too). The group's row
size is the largest power of two dividing its pairs' offsets from the
storage's start (the pool's base for a pool group) and their sizes, so every
pair is a run of whole rows of the storage seen as a 2-D matrix (conv pairs
of any shift and temporal pairs alike). The group is copied with one gather
and one scatter::

    rows[dst_rows] = rows[src_rows]
    # torch.index_select (gather), then Tensor.index_copy_ (scatter) on NPU,
    # i.e. aclnnIndexSelect and aclnnInplaceIndexCopy under torch_npu;
    # elsewhere the scatter is Tensor.index_put_ (see DEVICE_OP_PAIR)

Storages (or pools) of one shape in one KV-cache group share their relative
rows (their layers share block ids), so every distinct index is uploaded once per step:
one pinned host buffer, one host-to-device copy, sliced per part.

A group of one pair is one slice copy (through a temporary when it overlaps
itself). The gather reads every source before anything is written, so a pair
that overlaps itself (the conv shift inside one block) is a memmove. The
result equals the per-pair memmove in pair order when the pairs of a group do
not interact with any other pair. Before grouping, the planner finds on the
host every pair whose destination overlaps another pair's source or
destination, or whose source overlaps another pair's destination (duplicate
destinations, chains ``a -> b, b -> c``, overlaps between groups): one sort
pass when there is none, O(n log n) searches otherwise. Those pairs, and
pairs the grouping cannot express (unrecognised copy function, an address
outside the pool or not on an element boundary), run as ordered per-pair
copies ``dst.copy_(src.clone())`` in pair order, with the per-pair view's
checks, all checked before the first copy. Every other pair touches memory no
other pair touches, so running the groups first and the ordered pairs after
gives the serial result. Copies run on integer views of the bytes (the widest
unit the row size and alignment allow), so they are bit exact for any dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

OFFSET_KIND = "offset"
INDEX_KIND = "index"

_VLLM_SPEC_MODULE = "vllm.model_executor.layers.mamba.mamba_utils"
_KINDS_BY_NAME = {
    (_VLLM_SPEC_MODULE, "get_conv_copy_spec"): OFFSET_KIND,
    (_VLLM_SPEC_MODULE, "get_temporal_copy_spec"): INDEX_KIND,
}
_registered_kinds: dict[Any, str] = {}

# Copy units: the bytes are moved as integers (complex128 for 16 bytes: index
# copies never compute on the values, so every bit pattern survives).
_UNIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
# torch_npu warns that 64-bit index ops are slow and lists no complex index
# copies for every SoC: at most 32-bit units there.
_MAX_UNIT = {"npu": 4}
# Split a group so that its gathered temporary stays below this size.
MAX_GROUP_BYTES = 256 << 20


def register_copy_func(func: Callable[..., Any], kind: str) -> None:
    """Declare ``func`` as a copy function of ``kind`` (``OFFSET_KIND`` or ``INDEX_KIND``)."""
    if kind not in (OFFSET_KIND, INDEX_KIND):
        raise ValueError(f"unknown copy function kind {kind!r}")
    _registered_kinds[func] = kind


def copy_func_kind(func: Callable[..., Any]) -> str | None:
    kind = _registered_kinds.get(func)
    if kind is None:
        kind = _KINDS_BY_NAME.get((getattr(func, "__module__", None), getattr(func, "__name__", None)))
    return kind


class StatePool:
    """One state tensor: its base address, block stride and byte views of its storage."""

    def __init__(self, state: torch.Tensor):
        self.state = state
        self.device = state.device
        self.base = state.data_ptr()
        self.esize = state.element_size()
        storage_offset = state.storage_offset()
        storage_numel = state.untyped_storage().nbytes() // self.esize
        # The same flat view the per-pair collector builds (_tensor_view_from_data_ptr).
        self.flat = state.as_strided((storage_numel - storage_offset,), (1,), storage_offset=storage_offset)
        self.nbytes = self.flat.numel() * self.esize
        self.num_blocks = int(state.shape[0]) if state.dim() >= 1 else 0
        self.stride = int(state.stride(0)) * self.esize if state.dim() >= 1 else 0
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def whole_storage(self) -> StatePool:
        """A pool over this pool's whole untyped storage, as bytes (the target of a per-storage group)."""
        storage = self.state.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=self.device)
        return StatePool(flat.set_(storage, 0, (storage.nbytes(),), (1,)))

    def max_unit(self) -> int:
        """The widest integer unit (bytes) the pool's base address allows."""
        unit = _MAX_UNIT.get(self.device.type, 16)
        byte_offset = self.flat.storage_offset() * self.esize
        while unit > 1 and (self.base % unit or byte_offset % unit):
            unit //= 2
        return unit

    def rows(self, row_bytes: int, unit: int) -> torch.Tensor:
        """The pool's storage from its base as ``(num_rows, row_bytes // unit)`` integers of ``unit`` bytes."""
        key = (row_bytes, unit)
        rows = self._rows.get(key)
        if rows is None:
            num_rows = self.nbytes // row_bytes
            rows = self.flat.view(torch.uint8).narrow(0, 0, num_rows * row_bytes).view(num_rows, row_bytes)
            if unit > 1:
                rows = rows.view(_UNIT_DTYPES[unit])
            self._rows[key] = rows
        return rows

    def view(self, addr: int, nbytes: int) -> torch.Tensor:
        """The per-pair view of ``nbytes`` at ``addr``, with the per-pair collector's checks."""
        byte_offset = addr - self.base
        if byte_offset < 0 or byte_offset % self.esize != 0 or nbytes % self.esize != 0:
            raise RuntimeError("Invalid Mamba state copy pointer.")
        start, count = byte_offset // self.esize, nbytes // self.esize
        if start + count > self.flat.numel():
            raise RuntimeError("Mamba state copy range exceeds tensor storage.")
        return self.flat.narrow(0, start, count)


class CopyPlan:
    """Groups (one gather + scatter each, or one direct copy) and the pairs copied one by one."""

    __slots__ = (
        "groups",
        "ordered",
        "num_pairs",
        "grouped_pairs",
        "index_host",
        "index_sizes",
        "targets",
        "one_device",
    )

    def __init__(self, groups, ordered, num_pairs, grouped_pairs, index_host, index_sizes, targets, one_device=True):
        # groups: (target, row_bytes, unit, part, src_row, dst_row, rows): ``target`` indexes
        # ``targets`` (the pools, then whole storages shared by pools); ``part`` >= 0 is
        # the position of the group's source rows in the split index (its destination rows
        # are ``len(index_sizes) // 2`` parts later); ``part`` < 0 is a single pair: rows
        # [src_row, src_row + rows) ->
        # [dst_row, dst_row + rows), copied directly (through a temporary if they overlap).
        self.groups = groups
        self.ordered = ordered
        self.num_pairs = num_pairs
        self.grouped_pairs = grouped_pairs
        self.index_host = index_host
        self.index_sizes = index_sizes
        self.targets = targets
        self.one_device = one_device


def _count_overlaps(starts_sorted, ends_sorted, lo, hi):
    """Per query [lo, hi): how many of the (non-empty) sorted intervals intersect it."""
    return np.searchsorted(starts_sorted, hi, side="left") - np.searchsorted(ends_sorted, lo, side="right")


def _all_disjoint(starts: np.ndarray, ends: np.ndarray) -> bool:
    """Whether non-empty intervals are pairwise disjoint: sorted starts and ends interleave."""
    if starts.size < 2:
        return True
    starts, ends = np.sort(starts), np.sort(ends)
    return bool((starts[1:] >= ends[:-1]).all())


def find_hazards(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """True for every pair that interacts with another pair of the batch.

    A pair interacts when its destination overlaps another pair's destination
    or source, or its source overlaps another pair's destination. Two pairs
    reading the same source do not interact. Empty pairs never do.
    """
    live = nbytes > 0
    s0, d0 = src, dst
    s1, d1 = src + nbytes, dst + nbytes
    self_overlap = (s0 < d1) & (d0 < s1) & live
    # Fast path (the usual batch): all ranges disjoint, a pair's own source and
    # destination merged into one range when they overlap. Two sorts, no search.
    if not self_overlap.any():
        if live.all():
            starts, ends = np.concatenate((s0, d0)), np.concatenate((s1, d1))
        else:
            starts, ends = np.concatenate((s0[live], d0[live])), np.concatenate((s1[live], d1[live]))
    else:
        two = live & ~self_overlap
        starts = np.concatenate((np.where(self_overlap, np.minimum(s0, d0), s0)[live], d0[two]))
        ends = np.concatenate((np.where(self_overlap, np.maximum(s1, d1), s1)[live], d1[two]))
    if _all_disjoint(starts, ends):
        return np.zeros(len(nbytes), dtype=bool)
    d_starts, d_ends = np.sort(d0[live]), np.sort(d1[live])
    s_starts, s_ends = np.sort(s0[live]), np.sort(s1[live])
    dst_dst = _count_overlaps(d_starts, d_ends, d0, d1) - 1
    src_dst = _count_overlaps(d_starts, d_ends, s0, s1) - self_overlap
    dst_src = _count_overlaps(s_starts, s_ends, d0, d1) - self_overlap
    return live & ((dst_dst > 0) | (src_dst > 0) | (dst_src > 0))


class PoolTable(list):
    """A list of ``StatePool`` that caches the per-pool arrays the planner needs."""

    _arrays: tuple | None = None
    _arrays_len = -1

    def arrays(self):
        if self._arrays is None or self._arrays_len != len(self):
            self._arrays = _pool_arrays(self)
            self._arrays_len = len(self)
        return self._arrays


def _pool_arrays(pools: Sequence[StatePool]):
    """Per-pool arrays, and the copy targets: the pools, then one whole-storage pool per shared storage.

    ``storage[i]`` is the target id of pool ``i``'s storage when other pools
    (of the same device) share it, else -1.
    """
    base = np.array([p.base for p in pools], dtype=np.int64)
    nbytes = np.array([p.nbytes for p in pools], dtype=np.int64)
    esize = np.array([p.esize for p in pools], dtype=np.int64)
    one_device = len({str(p.device) for p in pools}) <= 1
    cluster, cluster_base = _clusters(base, nbytes)
    by_storage: dict[tuple, list[int]] = {}
    for i, p in enumerate(pools):
        storage_of = p.state.untyped_storage()
        by_storage.setdefault((str(p.device), storage_of.data_ptr(), storage_of.nbytes()), []).append(i)
    targets = list(pools)
    storage = np.full(len(pools), -1, dtype=np.int64)
    for members in by_storage.values():
        if len(members) > 1:
            storage[members] = len(targets)
            targets.append(pools[members[0]].whole_storage())
    t_base = np.array([t.base for t in targets], dtype=np.int64)
    max_unit = np.array([t.max_unit() for t in targets], dtype=np.int64)
    return base, nbytes, esize, one_device, cluster, cluster_base, storage, targets, t_base, max_unit


def _clusters(base: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pools whose storage ranges overlap (e.g. conv and temporal views of one raw tensor) form a cluster.

    Returns each pool's cluster id and each cluster's lowest address. Memory
    of different clusters is disjoint, so pairs of different clusters never
    interact.
    """
    cluster = np.zeros(len(base), dtype=np.int64)
    starts: list[int] = []
    end = None
    for i in np.argsort(base, kind="stable").tolist():
        b, e = int(base[i]), int(base[i] + nbytes[i])
        if end is None or b >= end:
            starts.append(b)
            end = e
        else:
            end = max(end, e)
        cluster[i] = len(starts) - 1
    return cluster, np.array(starts, dtype=np.int64)


_HASH_WEIGHTS: dict[int, np.ndarray] = {}


def _unique_rows(mat: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(inverse, first): ``mat[first[inverse[i]]]`` equals ``mat[i]``; ``first`` lists one row per distinct row."""
    if (mat == mat[0]).all():
        return np.zeros(len(mat), dtype=np.int64), [0]
    # Rows keyed by a hash (int64 arithmetic wraps), then checked exactly.
    weights = _HASH_WEIGHTS.get(mat.shape[1])
    if weights is None:
        rng = np.random.default_rng(mat.shape[1])
        weights = _HASH_WEIGHTS[mat.shape[1]] = rng.integers(1, 2**62, size=mat.shape[1], dtype=np.int64)
    rep: dict[int, int] = {}
    first: list[int] = []
    inverse = np.empty(len(mat), dtype=np.int64)
    for i, key in enumerate((mat * weights).sum(axis=1).tolist()):
        r = rep.get(key)
        if r is None:
            r = rep[key] = len(first)
            first.append(i)
        inverse[i] = r
    if not (mat == mat[np.array(first)[inverse]]).all():  # a hash collision: compare the bytes
        by_bytes: dict[bytes, int] = {}
        first = []
        for i in range(len(mat)):
            r = by_bytes.setdefault(mat[i].tobytes(), len(first))
            if r == len(first):
                first.append(i)
            inverse[i] = r
    return inverse, first


def _hazards_by_cluster(cluster, cluster_base, src, dst, nbytes, inside) -> np.ndarray:
    """``find_hazards`` over the pairs marked ``inside`` (each inside its pool's storage), cluster by cluster.

    Pairs are compared in addresses relative to their cluster, and clusters
    with the same relative pairs (the layers of a KV-cache group share block
    ids) are checked once.
    """
    hazard = np.zeros(len(nbytes), dtype=bool)
    idx = np.flatnonzero(inside)
    if idx.size < 2:
        return hazard
    keys = cluster[idx]
    if len(cluster_base) < 2**16:
        keys = keys.astype(np.uint16)  # radix sort
    idx = idx[np.argsort(keys, kind="stable")]
    c = cluster[idx]
    offset = cluster_base[c]
    rel_s, rel_d, size = src[idx] - offset, dst[idx] - offset, nbytes[idx]
    edges = np.flatnonzero(c[1:] != c[:-1]) + 1
    m = int(edges[0]) if edges.size else idx.size
    if m >= 2 and idx.size == m * (edges.size + 1) and (edges == np.arange(1, edges.size + 1) * m).all():
        # Every cluster has m pairs (the usual batch): dedupe their relative pairs as matrix rows.
        inverse, first = _unique_rows(
            np.concatenate((rel_s.reshape(-1, m), rel_d.reshape(-1, m), size.reshape(-1, m)), 1)
        )
        found = np.stack(
            [find_hazards(rel_s[f * m : f * m + m], rel_d[f * m : f * m + m], size[f * m : f * m + m]) for f in first]
        )
        if found.any():
            hazard[idx] = found[inverse].reshape(-1)
        return hazard
    bounds = [0, *edges.tolist(), idx.size]
    seen: dict[bytes, np.ndarray | None] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a < 2:
            continue
        key = rel_s[a:b].tobytes() + rel_d[a:b].tobytes() + size[a:b].tobytes()
        if key in seen:
            found = seen[key]
        else:
            found = find_hazards(rel_s[a:b], rel_d[a:b], size[a:b])
            found = seen[key] = found if found.any() else None
        if found is not None:
            hazard[idx[a:b]] = found
    return hazard


# A pair of a group is copied as rows of the group's row size: at most this many rows a pair.
MAX_ROWS_PER_PAIR = 256
# Pools sharing a storage are copied as one group when their common row is at least this long.
MIN_STORAGE_ROW_BYTES = 256


def plan_copies(
    pools: Sequence[StatePool],
    pool_ids: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    nbytes: np.ndarray,
    groupable: np.ndarray | None = None,
    *,
    check_hazards: bool = True,
    max_group_bytes: int = MAX_GROUP_BYTES,
) -> CopyPlan:
    """Split a batch of byte copies into one group per storage (or pool) and ordered per-pair copies.

    ``pool_ids[i]`` names the pool (index into ``pools``) pair ``i`` lives in;
    ``src``/``dst`` are absolute addresses, ``nbytes`` sizes. ``groupable``
    (optional) marks pairs that may be grouped at all. ``check_hazards=False``
    skips the interaction check: only for tests that prove it is needed.

    A group's pairs are copied as rows of ``row_bytes``, the greatest common
    divisor of their offsets from the group's base and their sizes, so the
    conv pairs of every shift and the temporal pairs form one group (and
    pairs that cross block boundaries are fine). Pools that share a storage
    (conv and temporal views of one raw KV-cache tensor) form one group based
    at the storage's start, unless its row would be shorter than
    ``MIN_STORAGE_ROW_BYTES`` or a pair longer than ``MAX_ROWS_PER_PAIR`` rows:
    then each of its pools is a group.
    """
    n = len(nbytes)
    pool_ids = np.asarray(pool_ids, dtype=np.int64)
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    live = nbytes > 0
    arrays = pools.arrays() if isinstance(pools, PoolTable) else _pool_arrays(pools)
    base, pool_bytes, esize, one_device, cluster, cluster_base, storage, targets, t_base, max_unit = arrays
    p_base, p_bytes, p_esize = base[pool_ids], pool_bytes[pool_ids], esize[pool_ids]
    rel_s, rel_d = src - p_base, dst - p_base
    # The per-pair view's checks: inside the pool's storage, whole elements
    # (element sizes are powers of two). A live pair failing them raises
    # before any copy (run_copies builds its per-pair view first).
    inside = live & (np.minimum(rel_s, rel_d) >= 0) & (np.maximum(rel_s, rel_d) + nbytes <= p_bytes)
    ok = inside & (((rel_s | rel_d | nbytes) & (p_esize - 1)) == 0)
    if groupable is not None:
        ok &= np.asarray(groupable, dtype=bool)
    if check_hazards and n > 1:
        ok &= ~_hazards_by_cluster(cluster[pool_ids], cluster_base, src, dst, nbytes, inside)
    sel = np.flatnonzero(ok)
    groups: list[tuple[int, int, int, int, int, int, int]] = []
    empty = np.zeros(0, dtype=np.int64)
    if sel.size == 0:
        return CopyPlan(groups, np.flatnonzero(live), n, 0, empty, [], targets)
    # Group key (a target): the pair's shared storage where its row is long enough, else its pool.
    target = pool_ids[sel]
    shared = storage[target]
    if (shared >= 0).any():
        on = shared >= 0
        t, s_n = shared[on], nbytes[sel][on]
        mixed = np.zeros(len(targets), dtype=np.int64)
        np.bitwise_or.at(mixed, t, (src[sel][on] - t_base[t]) | (dst[sel][on] - t_base[t]) | s_n)
        longest = np.zeros(len(targets), dtype=np.int64)
        np.maximum.at(longest, t, s_n)
        row = mixed & -mixed
        good = (row >= MIN_STORAGE_ROW_BYTES) & (longest <= row * MAX_ROWS_PER_PAIR)
        target[on] = np.where(good[t], t, target[on])
    g_base = t_base[target]
    keys = target
    if len(targets) < 2**16:
        keys = keys.astype(np.uint16)  # a stable sort of 16-bit keys is a radix sort
    order = np.argsort(keys, kind="stable")
    sel, g_pool = sel[order], target[order]
    g_s, g_d, g_n = src[sel] - g_base[order], dst[sel] - g_base[order], nbytes[sel]
    starts = np.concatenate(([0], np.flatnonzero(g_pool[1:] != g_pool[:-1]) + 1))
    counts = np.diff(np.concatenate((starts, [sel.size])))
    # Row size: the largest power of two dividing every offset and size of the pool's pairs.
    mixed = np.bitwise_or.reduceat(g_s | g_d | g_n, starts)
    row_bytes = mixed & -mixed
    row_shift = np.repeat(np.log2(row_bytes).astype(np.int64), counts)  # powers of two: shift, not divide
    pair_rows = g_n >> row_shift
    too_many = np.maximum.reduceat(pair_rows, starts) > MAX_ROWS_PER_PAIR
    if too_many.any():
        # Rows too small for these pools: copy their pairs one by one instead.
        keep = ~np.repeat(too_many, counts)
        ok[sel[~keep]] = False
        sel, g_pool, g_s, g_d, g_n, pair_rows, row_shift = (
            x[keep] for x in (sel, g_pool, g_s, g_d, g_n, pair_rows, row_shift)
        )
        row_bytes, starts, counts = row_bytes[~too_many], starts[~too_many], counts[~too_many]
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    ordered = np.flatnonzero(live & ~ok)
    if sel.size == 0:
        return CopyPlan(groups, ordered, n, 0, empty, [], targets)
    src_row, dst_row = g_s >> row_shift, g_d >> row_shift
    unit = np.minimum(max_unit[g_pool[starts]], row_bytes)
    g_rows = np.add.reduceat(pair_rows, starts)
    # Index parts: the row indices of a part are uploaded once and shared by every
    # group with the same pairs in rows (the layers of a KV-cache group share block
    # ids, so storages or pools of one shape have the same relative rows). Groups
    # are deduped on their pairs, and only one group of each kind is expanded to rows.
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    group_part = np.full(len(starts), -1, dtype=np.int64)
    whole = (counts > 1) & (g_rows * row_bytes <= max_group_bytes)
    for width in np.unique(counts[whole]).tolist():
        these = np.flatnonzero(whole & (counts == width))
        at = starts[these][:, None] + np.arange(width)
        inverse, rep = _unique_rows(np.concatenate((src_row[at], dst_row[at], pair_rows[at]), 1))
        group_part[these] = inverse + len(parts)
        parts += [_expand(src_row[at[r]], dst_row[at[r]], pair_rows[at[r]]) for r in rep]
    part_of: dict[bytes, int] = {}
    g_list = zip(
        g_pool[starts].tolist(),
        row_bytes.tolist(),
        unit.tolist(),
        counts.tolist(),
        starts.tolist(),
        g_rows.tolist(),
        group_part.tolist(),
    )
    for pid, rbytes, u, count, a, size, part in g_list:
        if part >= 0:
            groups.append((pid, rbytes, u, part, 0, 0, size))
            continue
        if count == 1:
            groups.append((pid, rbytes, u, -1, int(src_row[a]), int(dst_row[a]), size))
            continue
        s_rows, d_rows = _expand(src_row[a : a + count], dst_row[a : a + count], pair_rows[a : a + count])
        step_rows = max(1, max_group_bytes // rbytes)
        for c in range(0, size, step_rows):
            key = s_rows[c : c + step_rows].tobytes() + d_rows[c : c + step_rows].tobytes()
            part = part_of.get(key)
            if part is None:
                part = part_of[key] = len(parts)
                parts.append((s_rows[c : c + step_rows], d_rows[c : c + step_rows]))
            groups.append((pid, rbytes, u, part, 0, 0, min(step_rows, size - c)))
    # Source rows of every part, then destination rows: one transfer, one split.
    index_host = np.concatenate([s for s, _ in parts] + [d for _, d in parts]) if parts else empty
    sizes = [len(s) for s, _ in parts] * 2
    return CopyPlan(groups, ordered, n, int(sel.size), index_host, sizes, targets, one_device)


def _expand(src_row: np.ndarray, dst_row: np.ndarray, pair_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair's rows, pair order kept, rows in address order."""
    total = int(pair_rows.sum())
    if total == pair_rows.size:  # one row a pair (the usual case)
        return src_row, dst_row
    step = np.arange(total) - np.repeat(np.cumsum(pair_rows) - pair_rows, pair_rows)
    return np.repeat(src_row, pair_rows) + step, np.repeat(dst_row, pair_rows) + step


def _device_index(index_host: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(index_host)
    if device.type == "cpu":
        return host
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    # Pinned blocks come from the caching host allocator, which keeps a block
    # until the copies that read it have completed: no reuse hazard.
    return pinned.to(device, non_blocking=True)


def _copy_index_put(view: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
    # aten::index_select gathers every source row first, aten::index_put_ scatters.
    view.index_put_((dst_index,), torch.index_select(view, 0, src_index))


def _copy_index_copy(view: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
    # aten::index_select, then aten::index_copy_ (aclnnIndexSelect / aclnnInplaceIndexCopy on Ascend).
    view.index_copy_(0, dst_index, torch.index_select(view, 0, src_index))


# The gather/scatter pair a device type uses (default: index_select + index_copy_, the
# fastest pair on the H200 too; index_put_ kept for comparison).
OP_PAIRS = {"index_put": _copy_index_put, "index_copy": _copy_index_copy}
DEVICE_OP_PAIR: dict[str, str] = {}
DEFAULT_OP_PAIR = "index_copy"


def op_pair_for(device: torch.device):
    return OP_PAIRS[DEVICE_OP_PAIR.get(device.type, DEFAULT_OP_PAIR)]


def run_copies(
    pools: Sequence[StatePool],
    plan: CopyPlan,
    pool_ids: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    nbytes: np.ndarray,
) -> None:
    """Run a plan: the groups, then the ordered pairs in pair order."""
    # Build (and check) every per-pair view before the first copy.
    ordered = plan.ordered
    pairs = [
        (pools[p].view(s, b), pools[p].view(d, b))
        for p, s, d, b in zip(
            pool_ids[ordered].tolist(), src[ordered].tolist(), dst[ordered].tolist(), nbytes[ordered].tolist()
        )
    ]
    index, half = (), len(plan.index_sizes) // 2
    copy = _copy_index_copy
    targets = plan.targets
    if half:
        device = targets[plan.groups[0][0]].device
        copy = op_pair_for(device)
        index = torch.split(_device_index(plan.index_host, device), plan.index_sizes)
    one_device = plan.one_device
    for pid, row_bytes, unit, part, src_row, dst_row, rows in plan.groups:
        pool = targets[pid]
        view = pool._rows.get((row_bytes, unit))
        if view is None:
            view = pool.rows(row_bytes, unit)
        if part < 0:
            source = view.narrow(0, src_row, rows)
            if abs(src_row - dst_row) < rows:
                source = source.clone()
            view.narrow(0, dst_row, rows).copy_(source)
        elif one_device:
            # Gather every source row first, then scatter: memmove per pair.
            copy(view, index[part], index[part + half])
        else:
            copy(view, index[part].to(view.device), index[part + half].to(view.device))
    for src_view, dst_view in pairs:
        dst_view.copy_(src_view.clone())


def copy_rows(
    pools: Sequence[StatePool],
    pool_ids: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    nbytes: np.ndarray,
    groupable: np.ndarray | None = None,
    *,
    check_hazards: bool = True,
) -> CopyPlan:
    """Copy a batch with the semantics of per-pair memmoves in pair order."""
    pool_ids = np.asarray(pool_ids, dtype=np.int64)
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    plan = plan_copies(pools, pool_ids, src, dst, nbytes, groupable, check_hazards=check_hazards)
    run_copies(pools, plan, pool_ids, src, dst, nbytes)
    return plan


# --------------------------------------------------------------------------
# Vectorised collection
# --------------------------------------------------------------------------


class _GroupLayout:
    """The (layer, state) rows of one KV-cache group, in the per-pair collector's order."""

    def __init__(self, layout: CopyLayout, entries):
        states, funcs, pool_ids, layer_ids = [], [], [], []
        for layer_id, states_of_layer, funcs_of_layer in entries:
            for state, func in zip(states_of_layer, funcs_of_layer):
                states.append(state)
                funcs.append(func)
                pool_ids.append(layout.pool_id(state))
                layer_ids.append(layer_id)
        self.states = states
        self.funcs = funcs
        self.kinds = [copy_func_kind(f) for f in funcs]
        self.size = len(states)
        self.pool_ids = np.array(pool_ids, dtype=np.int64)
        self.layer_ids = np.array(layer_ids, dtype=np.int64)
        pools = layout.pools
        self.base = np.array([pools[p].base for p in pool_ids], dtype=np.int64)
        self.stride = np.array([pools[p].stride for p in pool_ids], dtype=np.int64)
        is_index = np.array([k == INDEX_KIND for k in self.kinds], dtype=bool)
        self.stride_cur = np.where(is_index, 0, self.stride)
        self.stride_k = np.where(is_index, self.stride, 0)
        self.has_cur = bool((~is_index).any())
        self.has_k = bool(is_index.any())
        self.min_blocks = min((pools[p].num_blocks for p in pool_ids), default=0)
        self._specs: dict[int, tuple] = {}
        self._tmp = np.empty(self.size, dtype=np.int64)

    def spec(self, k: int):
        """(base + source offset, nbytes, groupable, dynamic row indices) for accepted-token offset k."""
        spec = self._specs.get(k)
        if spec is None:
            spec = self._specs[k] = self._calibrate(k)
        return spec

    def _calibrate(self, k: int):
        off = np.zeros(self.size, dtype=np.int64)
        nbytes = np.zeros(self.size, dtype=np.int64)
        ok = np.zeros(self.size, dtype=bool)
        dynamic = []
        for i, (state, func, kind) in enumerate(zip(self.states, self.funcs, self.kinds)):
            probe = _probe(state, func, kind, k)
            if probe is None:
                dynamic.append(i)
                continue
            off[i], nbytes[i] = probe
            ok[i] = True
        return self.base + off, nbytes, ok, dynamic


def _probe(state, func, kind, k):
    """(source offset from block 0, nbytes) if ``func`` is the affine ``kind``, else None.

    Three probe tables of length k + 2: all block 0; only the entry the kind
    reads set to block 1; every other entry set to block 1. The function must
    move by one block stride exactly in the second one.
    """
    if kind is None or state.dim() < 1 or state.shape[0] < 2:
        return None
    base, esize = state.data_ptr(), state.element_size()
    stride = state.stride(0) * esize
    used = 0 if kind == OFFSET_KIND else k
    only_used = [0] * (k + 2)
    only_used[used] = 1
    all_but_used = [1] * (k + 2)
    all_but_used[used] = 0
    try:
        first = func(state, [0] * (k + 2), 0, k + 1)
        second = func(state, only_used, 0, k + 1)
        third = func(state, all_but_used, 0, k + 1)
    except Exception:
        return None
    off = first.start_addr - base
    if (
        second.start_addr - base != off + stride
        or third.start_addr - base != off
        or not first.num_elements == second.num_elements == third.num_elements
    ):
        return None
    return off, first.num_elements * esize


class CopyLayout:
    """Per-layer base addresses, strides and copy-spec parameters of one KV-cache layout.

    ``groups[g]`` lists ``(layer_name, states, copy_funcs)`` of KV-cache group
    ``g`` in the collector's order. Build it once per layout.
    """

    def __init__(self, groups: dict[int, Sequence[tuple[str, Sequence[torch.Tensor], Sequence[Callable]]]]):
        self.pools = PoolTable()
        self._pool_index: dict[tuple, int] = {}
        self.layer_names: list[str] = []
        layer_index: dict[str, int] = {}
        self.groups: dict[int, _GroupLayout] = {}
        for gid, entries in groups.items():
            rows = []
            for layer_name, states, funcs in entries:
                if layer_name not in layer_index:
                    layer_index[layer_name] = len(self.layer_names)
                    self.layer_names.append(layer_name)
                rows.append((layer_index[layer_name], list(states), list(funcs)))
            self.groups[gid] = _GroupLayout(self, rows)

    def pool_id(self, state: torch.Tensor) -> int:
        key = _state_key(state)
        pid = self._pool_index.get(key)
        if pid is None:
            pid = self._pool_index[key] = len(self.pools)
            self.pools.append(StatePool(state))
        return pid


def _state_key(state: torch.Tensor) -> tuple:
    return (state.data_ptr(), tuple(state.shape), tuple(state.stride()), state.dtype, state.device)


class CopyRows:
    """Per-pair metadata of one batch: the pointer tables plus pool, layer and groupable flags.

    ``src``, ``dst`` and ``sizes`` may be the pointer buffers' numpy views
    (they are written in place, exactly as the per-pair collector writes them).
    """

    def __init__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray):
        self.src, self.dst, self.sizes = src, dst, sizes
        cap = len(sizes)
        self.pool = np.zeros(cap, dtype=np.int64)
        self.layer = np.zeros(cap, dtype=np.int64)
        self.groupable = np.zeros(cap, dtype=bool)

    def batch(self, n: int, rows: np.ndarray | slice | None = None):
        """(pool_ids, src, dst, nbytes, groupable) of the first n rows (or of ``rows``)."""
        sel = slice(0, n) if rows is None else rows
        return (
            self.pool[sel],
            self.src[sel].astype(np.int64, copy=False),
            self.dst[sel].astype(np.int64, copy=False),
            self.sizes[sel].astype(np.int64, copy=False),
            self.groupable[sel],
        )


def collect_request(
    layout: CopyLayout,
    group_id: int,
    block_ids: Sequence[int],
    src_block_idx: int,
    dest_block_idx: int,
    accept_token_bias: int,
    rows: CopyRows,
    offset: int,
) -> int:
    """Write one request's pairs of one KV-cache group at ``offset``; return the new offset.

    Gives exactly the per-pair collector's rows: for every layer and state,
    ``copy_spec = func(state, block_ids, src_block_idx, accept_token_bias + 1)``,
    source ``copy_spec.start_addr``, destination ``state[block_ids[dest_block_idx]].data_ptr()``,
    size ``copy_spec.num_elements * state.element_size()``.
    """
    g = layout.groups[group_id]
    m = g.size
    end = offset + m
    k = accept_token_bias
    dest_id = block_ids[dest_block_idx]
    cur_id = block_ids[src_block_idx] if g.has_cur else 0
    k_id = block_ids[src_block_idx + k] if g.has_k else 0
    if not (0 <= dest_id < g.min_blocks and 0 <= cur_id < g.min_blocks and 0 <= k_id < g.min_blocks):
        # Negative or out-of-range block ids: let torch indexing decide, per pair.
        _collect_dynamic(g, range(m), block_ids, src_block_idx, dest_id, k, rows, offset)
        return end
    base_off, nbytes, ok, dynamic = g.spec(k)
    src_out = rows.src[offset:end]
    tmp = g._tmp
    if src_out.dtype == np.int64:
        np.multiply(g.stride_cur, cur_id, out=src_out)
        np.multiply(g.stride_k, k_id, out=tmp)
        src_out += tmp
        src_out += base_off
        np.multiply(g.stride, dest_id, out=rows.dst[offset:end])
        rows.dst[offset:end] += g.base
    else:
        src_out[:] = base_off + g.stride_cur * cur_id + g.stride_k * k_id
        rows.dst[offset:end] = g.base + g.stride * dest_id
    rows.sizes[offset:end] = nbytes
    rows.pool[offset:end] = g.pool_ids
    rows.layer[offset:end] = g.layer_ids
    rows.groupable[offset:end] = ok
    if dynamic:
        _collect_dynamic(g, dynamic, block_ids, src_block_idx, dest_id, k, rows, offset)
    return end


def _collect_dynamic(g, indices, block_ids, src_block_idx, dest_id, k, rows, offset):
    for i in indices:
        state = g.states[i]
        spec = g.funcs[i](state, block_ids, src_block_idx, k + 1)
        j = offset + i
        rows.src[j] = spec.start_addr
        rows.dst[j] = state[dest_id].data_ptr()
        rows.sizes[j] = spec.num_elements * state.element_size()
        rows.pool[j] = g.pool_ids[i]
        rows.layer[j] = g.layer_ids[i]
        rows.groupable[j] = False


def layer_major(rows: CopyRows, n: int, layer_names: Sequence[str]):
    """Rows of each layer, layers in order of first appearance (the per-layer collector's order).

    Returns ``(order, slices)``: ``order`` permutes the first n rows into
    layer-major order (pair order kept inside a layer); ``slices`` maps a
    layer name to its ``(start, end)`` in that order.
    """
    layer = rows.layer[:n]
    if n == 0:
        return np.zeros(0, dtype=np.int64), {}
    uniq, first = np.unique(layer, return_index=True)
    rank = np.empty(int(uniq.max()) + 1, dtype=np.int64)
    rank[uniq[np.argsort(first)]] = np.arange(uniq.size)
    keys = rank[layer]
    order = np.argsort(keys, kind="stable")
    counts = np.bincount(keys, minlength=uniq.size)
    ends = np.cumsum(counts)
    slices = {}
    for r, lid in enumerate(uniq[np.argsort(first)].tolist()):
        slices[layer_names[lid]] = (int(ends[r] - counts[r]), int(ends[r]))
    return order, slices


# --------------------------------------------------------------------------
# vLLM's MambaCopyBuffers (duck-typed; this module does not import vLLM)
# --------------------------------------------------------------------------

_STATE_ATTR = "_mamba_copy_groups"
_PENDING: tuple = ((), (), ())


class _StepState:
    """The layout, the rows of the current step and their per-layer order, kept on the copy buffers."""

    __slots__ = ("key", "layout", "rows", "pool_ends", "count", "layer_rows", "grouped")

    def __init__(self, key, layout: CopyLayout, capacity: int):
        self.key = key
        self.layout = layout
        self.rows = CopyRows(
            np.zeros(capacity, dtype=np.int64), np.zeros(capacity, dtype=np.int64), np.zeros(capacity, dtype=np.int64)
        )
        self.pool_ends = {}
        for group in layout.groups.values():
            for state in group.states:
                storage = state.untyped_storage()
                self.pool_ends[state.data_ptr()] = storage.data_ptr() + storage.nbytes()
        self.count = 0
        self.layer_rows: dict[str, np.ndarray] | None = None
        self.grouped = True


def _layout_entries(kv_cache_config, mamba_state_copy_funcs, mamba_group_ids, forward_context, funcs_for_layer):
    groups, key = {}, []
    for gid in mamba_group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        entries = []
        for name in group.layer_names:
            states = forward_context[name].kv_cache
            funcs = funcs_for_layer(group, name, mamba_state_copy_funcs)
            entries.append((name, states, funcs))
            key.append((gid, name, tuple((id(s), s.data_ptr()) for s in states), tuple(map(id, funcs))))
        groups[gid] = entries
    return groups, tuple(key)


def collect_mamba_copy_meta(
    copy_bufs,
    kv_cache_config,
    mamba_state_copy_funcs,
    mamba_group_ids,
    src_block_idx: int,
    dest_block_idx: int,
    accept_token_bias: int,
    req_state,
    forward_context,
    funcs_for_layer,
    *,
    grouped: bool = True,
) -> None:
    """vLLM's ``collect_mamba_copy_meta``, vectorised.

    Writes the same rows into ``copy_bufs``' pointer and size tables as the
    per-pair collector (pair order: group, layer, state), records the state
    pools for the host-side checks, names every layer in
    ``_layer_copy_metadata`` (``layer_tables`` fills them) and keeps the pairs'
    pool ids for the grouped copy. ``funcs_for_layer(kv_cache_group,
    layer_name, mamba_state_copy_funcs)`` returns a layer's copy functions.
    ``grouped=False``: the pointer kernels copy these rows, not this module.
    """
    if src_block_idx == dest_block_idx and accept_token_bias == 0:
        return
    offset = copy_bufs.offset
    state: _StepState | None = getattr(copy_bufs, _STATE_ATTR, None)
    if offset == 0 or state is None:
        groups, key = _layout_entries(
            kv_cache_config, mamba_state_copy_funcs, mamba_group_ids, forward_context, funcs_for_layer
        )
        capacity = len(copy_bufs.sizes.np)
        if state is None or state.key != key or len(state.rows.sizes) != capacity:
            state = _StepState(key, CopyLayout(groups), capacity)
            setattr(copy_bufs, _STATE_ATTR, state)
        state.layer_rows = None
        state.grouped = grouped
        pools = getattr(copy_bufs, "_mamba_copy_pools", None)
        if pools is not None:
            pools.update(state.pool_ends)
        layer_meta = getattr(copy_bufs, "_layer_copy_metadata", None)
        if layer_meta is not None:
            # Filled with the real per-layer tables by layer_tables(), before they are staged.
            for name in state.layout.layer_names:
                layer_meta.setdefault(name, _PENDING)
    rows = state.rows
    start = offset
    for gid in mamba_group_ids:
        offset = collect_request(
            state.layout, gid, req_state.block_ids[gid], src_block_idx, dest_block_idx, accept_token_bias, rows, offset
        )
    copy_bufs.src_ptrs.np[start:offset] = rows.src[start:offset]
    copy_bufs.dst_ptrs.np[start:offset] = rows.dst[start:offset]
    copy_bufs.sizes.np[start:offset] = rows.sizes[start:offset]
    copy_bufs.offset = state.count = offset


def _rows_of_layers(state: _StepState) -> dict[str, np.ndarray]:
    if state.layer_rows is None:
        order, slices = layer_major(state.rows, state.count, state.layout.layer_names)
        state.layer_rows = {name: order[a:b] for name, (a, b) in slices.items()}
    return state.layer_rows


def layer_tables(copy_bufs) -> None:
    """Fill ``copy_bufs._layer_copy_metadata`` with each layer's (src, dst, sizes) tables, in pair order."""
    state: _StepState | None = getattr(copy_bufs, _STATE_ATTR, None)
    layer_meta = getattr(copy_bufs, "_layer_copy_metadata", None)
    if state is None or not layer_meta or state.count == 0:
        return
    rows = state.rows
    for name, index in _rows_of_layers(state).items():
        if layer_meta.get(name) is _PENDING:
            layer_meta[name] = (rows.src[index], rows.dst[index], rows.sizes[index])


def _collected(copy_bufs, n: int) -> _StepState:
    state: _StepState | None = getattr(copy_bufs, _STATE_ATTR, None)
    if state is None or state.count != n:
        raise RuntimeError("Mamba tensor copy metadata is incomplete.")
    return state


def do_mamba_copy_block(copy_bufs) -> None:
    """vLLM's ``do_mamba_copy_block`` for the tensor-copy path: the step's pairs, grouped."""
    n = copy_bufs.offset
    if n == 0:
        return
    state = _collected(copy_bufs, n)
    copy_rows(state.layout.pools, *state.rows.batch(n))
    state.count = 0


def do_mamba_copy_block_for_layer(copy_bufs, layer_name: str) -> None:
    """One layer's pairs of the step (layerwise KV load), grouped."""
    state: _StepState | None = getattr(copy_bufs, _STATE_ATTR, None)
    if state is None or state.count == 0:
        return
    index = _rows_of_layers(state).get(layer_name)
    if index is not None and index.size:
        copy_rows(state.layout.pools, *state.rows.batch(state.count, rows=index))


def has_rows(copy_bufs) -> bool:
    """Whether the current step's pairs were collected here for the grouped copy."""
    state: _StepState | None = getattr(copy_bufs, _STATE_ATTR, None)
    return state is not None and state.grouped and state.count > 0
