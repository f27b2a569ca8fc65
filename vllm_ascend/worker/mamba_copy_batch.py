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
"""Copy a batch of Mamba state byte ranges with the semantics of per-pair memmoves in pair order.

The grouped copy of ``mamba_copy_groups`` (which collects the pairs). It
imports only torch and numpy. A pair is (pool, source address, destination
address, size); the batch is planned on the host and copied three ways:

**Groups** (one gather and one scatter). The pairs of one storage form one
group: vLLM views a layer's conv and temporal states into one raw KV-cache
tensor with a per-block page stride, so both states of a layer are copied
together (state tensors in separate allocations: one group per pool; a
storage whose common row would be short, too). The group's row size is the
largest power of two dividing its pairs' offsets from the storage's start
(the pool's base for a pool group) and their sizes, so every pair is a run of
whole rows of the storage seen as a 2-D matrix (conv pairs of any shift and
temporal pairs alike)::

    rows[dst_rows] = rows[src_rows]
    # torch.index_select (gather), then Tensor.index_copy_ (scatter),
    # i.e. aclnnIndexSelect and aclnnInplaceIndexCopy under torch_npu

The gather reads every source before anything is written, so a pair that
overlaps itself (the conv shift inside one block) is a memmove. Storages (or
pools) of one shape in one KV-cache group share their relative rows (their
layers share block ids), so every distinct index is uploaded once per step:
one pinned host buffer, one host-to-device copy, sliced per part. A group of
one pair not copied directly is one slice copy (through a temporary when it
overlaps itself).

**Direct pairs** (one multi-tensor copy). A group of at most
``DIRECT_MAX_PAIRS`` pairs, none overlapping itself, needs no gather: all such
pairs of the batch are copied in one pass by one ``torch._foreach_copy_``
(``aclnnForeachCopy`` under torch_npu). At one or two requests a step this
replaces two launches per storage by one for the batch.

**Ordered pairs.** Before grouping, the planner finds on the host every pair
whose destination overlaps another pair's source or destination, or whose
source overlaps another pair's destination (duplicate destinations, chains
``a -> b, b -> c``, overlaps between groups): one sort pass when there is
none, O(n log n) searches otherwise. Those pairs, and pairs the grouping
cannot express (unrecognised copy function, an address outside the pool or
not on an element boundary), run as ordered per-pair copies
``dst.copy_(src.clone())`` in pair order, with the per-pair view's checks,
all checked before the first copy. Every other pair touches memory no other
pair touches, so running the groups and direct pairs first and the ordered
pairs after gives the serial result. Copies run on integer views of the bytes
(the widest unit the row size and alignment allow), so they are bit exact for
any dtype.

**Planning once per kind of storage.** In a large batch every layer's storage
usually sees the same pairs at the same offsets: the planner plans one
storage of each kind (same geometry, same relative pairs) and copies its plan
to the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Copy units: the bytes are moved as integers (complex128 for 16 bytes: index
# copies never compute on the values, so every bit pattern survives).
_UNIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
# torch_npu warns that 64-bit index ops are slow and lists no complex index
# copies for every SoC: at most 32-bit units there.
_MAX_UNIT = {"npu": 4}
# Split a group so that its gathered temporary stays below this size.
MAX_GROUP_BYTES = 256 << 20
# Groups of at most this many pairs skip the gather and scatter: their pairs are copied in one
# pass, all of them by one multi-tensor copy (torch._foreach_copy_), in integer units of at most
# 8 bytes (aclnnForeachCopy, its NPU kernel, lists no complex type).
DIRECT_MAX_PAIRS = 4
_DIRECT_MAX_UNIT = 8


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
    """Groups (one gather + scatter each, or one slice copy), the direct pairs and the pairs copied one by one."""

    __slots__ = (
        "groups",
        "direct",
        "ordered",
        "num_pairs",
        "grouped_pairs",
        "index_host",
        "index_sizes",
        "targets",
        "one_device",
    )

    def __init__(
        self, groups, ordered, num_pairs, grouped_pairs, index_host, index_sizes, targets, one_device=True, direct=None
    ):
        # groups: (target, row_bytes, unit, part, src_row, dst_row, rows): ``target`` indexes
        # ``targets`` (the pools, then whole storages shared by pools); ``part`` >= 0 is
        # the position of the group's source rows in the split index (its destination rows
        # are ``len(index_sizes) // 2`` parts later); ``part`` < 0 is a single pair: rows
        # [src_row, src_row + rows) ->
        # [dst_row, dst_row + rows), copied directly (through a temporary if they overlap).
        self.groups = groups
        # direct: None, or (unit, target ids, source offsets, destination offsets, lengths) of the
        # pairs copied by one multi-tensor copy, in units of ``unit`` bytes from the target's start.
        self.direct = direct
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

    _arrays: PoolArrays | None = None
    _arrays_len = -1

    def arrays(self) -> PoolArrays:
        if self._arrays is None or self._arrays_len != len(self):
            self._arrays = PoolArrays(self)
            self._arrays_len = len(self)
        return self._arrays


class PoolArrays:
    """Per-pool arrays, the copy targets (the pools, then one whole-storage pool per shared storage)
    and where each target stands in its cluster.

    ``storage[i]`` is the target id of pool ``i``'s storage when other pools
    (of the same device) share it, else -1. A pool's range runs to the end of
    its storage, so the pools of one storage are one cluster and no target
    spans two. Clusters of one geometry (``cluster_kind``) have their targets
    at the same positions: ``target_at[c, target_pos[t]]`` is the target of
    cluster ``c`` that stands where target ``t`` stands in its own cluster.
    """

    def __init__(self, pools: Sequence[StatePool]):
        self.base = np.array([p.base for p in pools], dtype=np.int64)
        self.nbytes = np.array([p.nbytes for p in pools], dtype=np.int64)
        self.esize = np.array([p.esize for p in pools], dtype=np.int64)
        self.one_device = len({str(p.device) for p in pools}) <= 1
        self.cluster, self.cluster_base = _clusters(self.base, self.nbytes)
        by_storage: dict[tuple, list[int]] = {}
        for i, p in enumerate(pools):
            storage_of = p.state.untyped_storage()
            by_storage.setdefault((str(p.device), storage_of.data_ptr(), storage_of.nbytes()), []).append(i)
        self.targets = list(pools)
        self.storage = np.full(len(pools), -1, dtype=np.int64)
        for members in by_storage.values():
            if len(members) > 1:
                self.storage[members] = len(self.targets)
                self.targets.append(pools[members[0]].whole_storage())
        self.t_base = np.array([t.base for t in self.targets], dtype=np.int64)
        self.max_unit = np.array([t.max_unit() for t in self.targets], dtype=np.int64)
        self._positions(pools)

    def _positions(self, pools: Sequence[StatePool]) -> None:
        # A cluster's pools by (offset, size, element size), then its storages by offset.
        n_targets = len(self.targets)
        self.target_cluster = np.zeros(n_targets, dtype=np.int64)
        self.target_cluster[: len(pools)] = self.cluster
        for i, t in enumerate(self.storage.tolist()):
            if t >= 0:
                self.target_cluster[t] = self.cluster[i]
        members: list[list[int]] = [[] for _ in self.cluster_base]
        for t, c in enumerate(self.target_cluster.tolist()):
            members[c].append(t)
        self.target_pos = np.zeros(n_targets, dtype=np.int64)
        self.target_at = np.full((len(members), max(map(len, members), default=0)), -1, dtype=np.int64)
        self.cluster_kind = np.zeros(len(members), dtype=np.int64)
        kinds: dict[tuple, int] = {}
        for c, ts in enumerate(members):
            geometry = {t: self._geometry(t, int(self.cluster_base[c]), len(pools)) for t in ts}
            ts.sort(key=lambda t: (t >= len(pools), geometry[t]))
            self.target_pos[ts] = np.arange(len(ts))
            self.target_at[c, : len(ts)] = ts
            self.cluster_kind[c] = kinds.setdefault(tuple(geometry[t] for t in ts), len(kinds))
        self.pool_pos = self.target_pos[: len(pools)]

    def _geometry(self, t: int, cluster_base: int, num_pools: int) -> tuple:
        """What the planner reads of target ``t``, relative to its cluster's base."""
        target = self.targets[t]
        if t >= num_pools:
            return (int(self.t_base[t]) - cluster_base, target.nbytes, int(self.max_unit[t]), str(target.device))
        shared = int(self.storage[t])
        storage_at = -1 if shared < 0 else int(self.t_base[shared]) - cluster_base
        return (
            target.base - cluster_base,
            target.nbytes,
            target.esize,
            storage_at,
            int(self.max_unit[t]),
            str(target.device),
        )


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


def _unique_rows(mat: np.ndarray) -> tuple[np.ndarray, Sequence[int]]:
    """(inverse, first): ``mat[first[inverse[i]]]`` equals ``mat[i]``; ``first`` lists one row per distinct row."""
    if (mat == mat[0]).all():
        return np.zeros(len(mat), dtype=np.int64), [0]
    # Rows keyed by a hash (int64 arithmetic wraps), then checked exactly.
    weights = _HASH_WEIGHTS.get(mat.shape[1])
    if weights is None:
        rng = np.random.default_rng(mat.shape[1])
        weights = _HASH_WEIGHTS[mat.shape[1]] = rng.integers(1, 2**62, size=mat.shape[1], dtype=np.int64)
    _, first, inverse = np.unique((mat * weights).sum(axis=1), return_index=True, return_inverse=True)
    if not (mat == mat[first[inverse]]).all():  # a hash collision: compare the bytes
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
    with the same relative pairs are checked once. (A batch whose clusters
    repeat one another does not come here: ``_replicated_plan`` plans one.)
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


# Batches of at least this many pairs are planned once per kind of cluster (see _replicated_plan).
REPLICATE_MIN_PAIRS = 1024
# Batches of at least this many pairs are checked for interactions cluster by cluster.
CLUSTER_HAZARD_MIN_PAIRS = 1024
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
    """Split a batch of byte copies into groups (one per storage or pool), direct pairs and ordered pairs.

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
    then each of its pools is a group. The pairs of a group of at most
    ``DIRECT_MAX_PAIRS`` pairs, none overlapping itself, are direct pairs
    instead. From ``REPLICATE_MIN_PAIRS`` pairs on, clusters that repeat one
    another are planned once (``_replicated_plan``).
    """
    pool_ids = np.asarray(pool_ids, dtype=np.int64)
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    if groupable is not None:
        groupable = np.asarray(groupable, dtype=bool)
    arrays = pools.arrays() if isinstance(pools, PoolTable) else PoolArrays(pools)
    batch = (pool_ids, src, dst, nbytes, groupable)
    if len(nbytes) >= REPLICATE_MIN_PAIRS and len(arrays.cluster_base) > 1:
        plan = _replicated_plan(arrays, batch, check_hazards, max_group_bytes)
        if plan is not None:
            return plan
    return _plan_pairs(arrays, batch, check_hazards, max_group_bytes)


def _replicated_plan(arrays: PoolArrays, batch, check_hazards: bool, max_group_bytes: int) -> CopyPlan | None:
    """Plan one cluster of each kind and copy its plan to the others, or None when no two clusters repeat.

    The layers of a KV-cache group share block ids, so every layer's storage
    (a cluster) usually sees the same pairs at the same offsets: clusters of
    one geometry with the same relative pairs get the same groups, rows and
    fallbacks, each on its own targets.
    """
    pool_ids, src, dst, nbytes, groupable = batch
    n = len(nbytes)
    cluster = arrays.cluster[pool_ids]
    counts = np.bincount(cluster, minlength=len(arrays.cluster_base))
    used = np.flatnonzero(counts)
    m = int(counts[used[0]])
    if used.size < 2 or (counts[used] != m).any():
        return None
    keys = cluster.astype(np.uint16) if len(arrays.cluster_base) < 2**16 else cluster
    order = np.argsort(keys, kind="stable").reshape(used.size, m)  # row r: cluster used[r]'s pairs, in order
    base = arrays.cluster_base[used][:, None]
    flags = np.ones((used.size, m), dtype=np.int64) if groupable is None else groupable[order]
    pattern = (src[order] - base, dst[order] - base, nbytes[order], arrays.pool_pos[pool_ids[order]], flags)
    inverse, first = _unique_rows(np.concatenate((*pattern, arrays.cluster_kind[used][:, None]), 1))
    first = np.asarray(first)
    if first.size == used.size:
        return None
    chosen = np.sort(order[first].reshape(-1))
    plan = _plan_pairs(arrays, tuple(None if x is None else x[chosen] for x in batch), check_hazards, max_group_bytes)
    # Row k of `first` stands for the clusters `members[k]`: its targets' copies stand at the same positions.
    kind_of = np.full(len(arrays.cluster_base), -1, dtype=np.int64)
    kind_of[used[first]] = np.arange(first.size)
    members = [used[inverse == k] for k in range(first.size)]

    def copies(chosen_targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(target ids, index into the argument) of every cluster's copy of each chosen target."""
        kinds = kind_of[arrays.target_cluster[chosen_targets]]
        ids, which = [], []
        for k in range(first.size):
            at = np.flatnonzero(kinds == k)
            if at.size:
                ids.append(arrays.target_at[members[k]][:, arrays.target_pos[chosen_targets[at]]].reshape(-1))
                which.append(np.tile(at, members[k].size))
        return np.concatenate(ids), np.concatenate(which)

    groups = plan.groups
    if groups:
        ids, which = copies(np.array([g[0] for g in groups], dtype=np.int64))
        groups = [(t, *groups[w][1:]) for t, w in zip(ids.tolist(), which.tolist())]
    direct = plan.direct
    if direct is not None:
        size, d_ids, d_src, d_dst, d_len = direct
        ids, which = copies(np.array(d_ids, dtype=np.int64))
        direct = (size, ids.tolist(), *(np.array(x)[which].tolist() for x in (d_src, d_dst, d_len)))
    ordered = plan.ordered
    if ordered.size:
        # A chosen pair at column c of its cluster stands for column c of every cluster of its kind.
        where = np.empty(n, dtype=np.int64)
        where[order.reshape(-1)] = np.arange(n)
        row, col = np.divmod(where[chosen[ordered]], m)
        rows_of = [np.flatnonzero(inverse == k) for k in range(first.size)]
        ordered = np.sort(np.concatenate([order[rows_of[inverse[r]], c] for r, c in zip(row.tolist(), col.tolist())]))
    grouped = int(np.count_nonzero(nbytes > 0)) - ordered.size
    return CopyPlan(
        groups, ordered, n, grouped, plan.index_host, plan.index_sizes, plan.targets, plan.one_device, direct
    )


def _plan_pairs(arrays: PoolArrays, batch, check_hazards: bool, max_group_bytes: int) -> CopyPlan:
    """``plan_copies`` over every pair of the batch."""
    pool_ids, src, dst, nbytes, groupable = batch
    n = len(nbytes)
    live = nbytes > 0
    storage, targets, t_base, max_unit = arrays.storage, arrays.targets, arrays.t_base, arrays.max_unit
    p_base, p_bytes, p_esize = arrays.base[pool_ids], arrays.nbytes[pool_ids], arrays.esize[pool_ids]
    rel_s, rel_d = src - p_base, dst - p_base
    # The per-pair view's checks: inside the pool's storage, whole elements
    # (element sizes are powers of two). A live pair failing them raises
    # before any copy (run_copies builds its per-pair view first).
    inside = live & (np.minimum(rel_s, rel_d) >= 0) & (np.maximum(rel_s, rel_d) + nbytes <= p_bytes)
    ok = inside & (((rel_s | rel_d | nbytes) & (p_esize - 1)) == 0)
    if groupable is not None:
        ok &= groupable
    if check_hazards and n > 1:
        if n < CLUSTER_HAZARD_MIN_PAIRS:
            # Few pairs: one pass over the absolute addresses is cheaper than deduplicating
            # clusters. Live pairs outside their pool only make others fall back: they raise.
            ok &= ~find_hazards(src, dst, nbytes)
        else:
            ok &= ~_hazards_by_cluster(arrays.cluster[pool_ids], arrays.cluster_base, src, dst, nbytes, inside)
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
    direct = None
    # Small groups whose pairs do not overlap themselves need no gather (the gather is what makes
    # a self-overlapping pair a memmove): their pairs join the one multi-tensor copy.
    small = (counts <= DIRECT_MAX_PAIRS) & ~np.logical_or.reduceat(np.abs(src_row - dst_row) < pair_rows, starts)
    if small.any():
        direct = _direct_pairs(np.repeat(small, counts), g_pool, g_s, g_d, g_n, max_unit)
        if small.all():
            return CopyPlan(groups, ordered, n, int(sel.size), empty, [], targets, arrays.one_device, direct)
        starts, counts, row_bytes, unit, g_rows = (x[~small] for x in (starts, counts, row_bytes, unit, g_rows))
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
        if these.size == 1:
            inverse, rep = np.zeros(1, dtype=np.int64), [0]
        else:
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
    return CopyPlan(groups, ordered, n, int(sel.size), index_host, sizes, targets, arrays.one_device, direct)


def _direct_pairs(on, g_pool, g_s, g_d, g_n, max_unit) -> tuple:
    """The pairs marked ``on`` as ``CopyPlan.direct``: one integer unit dividing every offset and size."""
    t, s, d, size = g_pool[on], g_s[on], g_d[on], g_n[on]
    mixed = int(np.bitwise_or.reduce(s | d | size))
    unit = min(mixed & -mixed, int(max_unit[t].min()), _DIRECT_MAX_UNIT)
    shift = unit.bit_length() - 1
    return unit, t.tolist(), (s >> shift).tolist(), (d >> shift).tolist(), (size >> shift).tolist()


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
    # numpy's copy: torch's CPU copy_ of a few hundred KiB cost ~1.9 ms on the H200's host.
    np.copyto(pinned.numpy(), index_host)
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
    """Run a plan: the direct pairs and the groups, then the ordered pairs in pair order."""
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
    if plan.direct is not None:
        # Every direct pair touches memory no other pair touches and none overlaps itself: one
        # pass, one multi-tensor copy (per-pair copies where the backend has no fused kernel).
        unit, ids, src_units, dst_units, lengths = plan.direct
        views = {t: targets[t].rows(unit, unit) for t in set(ids)}
        torch._foreach_copy_(
            [views[t][d : d + k] for t, d, k in zip(ids, dst_units, lengths)],
            [views[t][s : s + k] for t, s, k in zip(ids, src_units, lengths)],
        )
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


def copy_rows(pools: Sequence[StatePool], pool_ids, src, dst, nbytes, groupable=None, **options) -> CopyPlan:
    """Copy a batch with the semantics of per-pair memmoves in pair order: ``plan_copies``, then ``run_copies``."""
    pairs = [np.asarray(x, dtype=np.int64) for x in (pool_ids, src, dst, nbytes)]
    plan = plan_copies(pools, *pairs, groupable, **options)
    run_copies(pools, plan, *pairs)
    return plan
