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
"""Vectorised metadata collection and the grouped tensor copy for Mamba state moves.

Align mode moves Mamba states between cache blocks. The safe copy path copies
every pair as ``dst.copy_(src.clone())`` over per-pair tensor views, collected
by a Python loop over requests, layers and states. Both halves are host-bound:
collecting costs microseconds per pair and every pair is two launches.

This module collects in bulk and hands the batch to ``mamba_copy_batch``,
which copies it with the semantics of per-pair memmoves in pair order. It
imports only torch and numpy.

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

**vLLM's copy buffers** (``collect_mamba_copy_meta``, ``do_mamba_copy_block``,
``do_mamba_copy_block_for_layer``): the same rows as vLLM's collector writes,
copied as one batch, or per layer on the layerwise path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from vllm_ascend.worker.mamba_copy_batch import PoolTable, StatePool, copy_rows

OFFSET_KIND = "offset"
INDEX_KIND = "index"

_VLLM_SPEC_MODULE = "vllm.model_executor.layers.mamba.mamba_utils"
_KINDS_BY_NAME = {
    (_VLLM_SPEC_MODULE, "get_conv_copy_spec"): OFFSET_KIND,
    (_VLLM_SPEC_MODULE, "get_temporal_copy_spec"): INDEX_KIND,
}
_registered_kinds: dict[Any, str] = {}


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
