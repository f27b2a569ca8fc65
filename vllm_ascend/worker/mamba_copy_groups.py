# SPDX-License-Identifier: Apache-2.0
"""Grouped tensor copies for align-mode Mamba state moves (the ``torch`` copy backend).

Per request and KV-cache group the collector knows a destination block and, per
state, a source block and a shift: vLLM's ``get_conv_copy_spec`` reads block
``block_ids[cur]`` from row ``bias`` on, ``get_temporal_copy_spec`` the whole
block ``block_ids[cur + bias]``, and every layer of the group shares those block
ids. So a step is recorded as a few block ids per request, and copied per
storage (a layer's raw KV-cache tensor, or a state pool of its own), seen as
rows. Requests whose blocks interact (``conflicting_pairs`` on block ids: a
chain, a shared destination) are copied per pair, in pair order. The others
touch disjoint blocks, and the states of one block are disjoint, so only a
conv state shifted inside its own block overlaps itself. They are copied

* directly, in small steps: one multi-tensor copy of (source, destination)
  views of the whole step, the self-overlapping sources staged first;
* in large steps, per storage, by row indices: ``index_select`` of source rows
  into a buffer, then ``index_copy_`` into the destination rows, in chunks of at
  most ``GATHER_BYTES``. Every row of a chunk is read before any is written, and
  a self-overlapping pair only shifts towards lower rows, so later chunks read
  rows that earlier chunks have not written.

The temporaries (staging and gather buffers) stay under ``GATHER_BYTES``
whatever the batch: they are allocated after vLLM has sized the KV cache.
"""

import math

import numpy as np
import torch
from vllm.model_executor.layers.mamba import mamba_utils as vllm_mamba

from vllm_ascend.worker.mamba_copy_checks import conflicting_pairs

GATHER_BYTES = 64 << 20  # the most bytes of temporaries one copy holds
DIRECT_PAIRS_PER_STORAGE = 4  # larger steps take the row-index path, whose host cost does not grow with the batch
_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _kind(func, state: torch.Tensor) -> str | None:
    if state.dim() < 2 or not state[0].is_contiguous():
        return None
    if func is vllm_mamba.get_temporal_copy_spec:
        return "temporal"
    dim_first = getattr(vllm_mamba, "is_conv_state_dim_first", lambda: False)()
    return "conv" if func is vllm_mamba.get_conv_copy_spec and not dim_first else None


def _storages(layers):
    """The storages' keys (group, row bytes, geometry, rows) with their counts, and per layer and storage
    (layer, key index, rows view, flat view); None for a layout the grouped copy does not know."""
    out = []
    for name, group, states, funcs in layers:
        by_storage: dict[int, list] = {}
        for state, func in zip(states, funcs):
            by_storage.setdefault(state.untyped_storage().data_ptr(), []).append((state, _kind(func, state)))
        for base, members in by_storage.items():
            geometry = tuple(
                (kind, s.data_ptr() - base, *(n * s.element_size() for n in (s.stride(0), s[0].numel(), s.stride(1))))
                for s, kind in members
            )
            spans = sorted((offset, offset + nbytes) for _, offset, _, nbytes, _ in geometry)
            if len({g[2] for g in geometry}) > 1 or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                return None  # states of one storage must have disjoint blocks of one stride
            if spans[0][0] < 0 or spans[-1][1] - spans[0][0] > geometry[0][2]:
                return None
            row = math.gcd(*(x for g in geometry for x in g[1:]))
            out.append((name, group, row, geometry, members[0][0].untyped_storage()))
    unit = max(u for u in _DTYPES if all(row % u == 0 for _, _, row, *_ in out))
    keys: dict[tuple, int] = {}
    result = []
    for name, group, row, geometry, storage in out:
        flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        rows = flat[: flat.numel() // row * row].view(_DTYPES[unit]).view(-1, row // unit)
        key = keys.setdefault((group, row, geometry, rows.shape[0]), len(keys))
        result.append((name, key, rows, rows.view(-1)))
    counts = [sum(s[1] == k for s in result) for k in keys.values()]
    return list(zip(keys, counts)), result


def record(copy_bufs, layers_fn, mamba_group_ids, src_block_idx, dest_block_idx, bias, req_state) -> bool:
    """Record one request's moves; False when a copy function or state layout is not a known one.

    ``layers_fn()``: (layer name, KV-cache group id, states, copy functions) of the Mamba layers,
    read once a step.
    """
    if not getattr(copy_bufs, "_mamba_copy_requests", None):
        layers = layers_fn()
        key = [(s.data_ptr(), s.shape, f) for *_, states, funcs in layers for s, f in zip(states, funcs)]
        if key != getattr(copy_bufs, "_mamba_copy_key", None):
            known = all(_kind(f, s) for *_, states, funcs in layers for s, f in zip(states, funcs))
            copy_bufs._mamba_copy_storages = _storages(layers) if known else None
            copy_bufs._mamba_copy_key = key
        copy_bufs._mamba_copy_layers, copy_bufs._mamba_copy_requests = layers, []
    if copy_bufs._mamba_copy_storages is None or bias < 0:
        return False
    for group in mamba_group_ids:
        ids = req_state.block_ids[group]
        copy_bufs._mamba_copy_requests.append(
            (group, ids, src_block_idx, bias, ids[src_block_idx], ids[src_block_idx + bias], ids[dest_block_idx])
        )
    metadata = getattr(copy_bufs, "_layer_copy_metadata", None)
    for name, *_ in copy_bufs._mamba_copy_layers if metadata is not None else ():
        metadata.setdefault(name, ([], [], []))  # the layers the layerwise path must visit
    return True


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(start, start + length) for each pair."""
    within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within


def _spans(reqs: np.ndarray, group: int, row: int, geometry, num_rows: int):
    """First source row, first destination row and row count of each pair (state, then request) in one storage."""
    reqs = reqs[reqs[:, 0] == group]
    _, bias, conv_src, temporal_src, dst = reqs.T
    spans = []
    for kind, offset, stride, nbytes, row_bytes in geometry:
        shift = bias * row_bytes if kind == "conv" else 0 * bias
        src = conv_src if kind == "conv" else temporal_src
        spans.append(((offset + src * stride + shift) // row, (offset + dst * stride) // row, (nbytes - shift) // row))
    src, dst, length = (np.concatenate(x) for x in zip(*spans))
    if ((np.minimum(src, dst) < 0) | (np.maximum(src, dst) + length > num_rows) | (length < 0)).any():
        raise IndexError(f"Mamba state copy outside its storage: block ids {sorted(set(reqs[:, 2:].flat))}")
    return src, dst, length


def _plan(requests, keys, storages):
    """How this step's requests are copied: (requests, interacting mask, direct views or index chunks per key)."""
    table = np.array([(r[0], r[3], *r[4:]) for r in requests], dtype=np.int64)
    _, _, conv_src, temporal_src, dst = table.T
    owners = np.tile(np.arange(len(requests)), 2)
    interacting = np.zeros(len(requests), dtype=bool)
    if len(requests) > 1:  # one request cannot interact with another
        pairs = conflicting_pairs(np.r_[conv_src, temporal_src], np.r_[dst, dst], np.ones_like(owners), owners)
        interacting = pairs[: len(requests)] | pairs[len(requests) :]
    spans = [_spans(table[~interacting], *key) for key, _ in keys]
    unit = storages[0][2].element_size()
    if sum(len(s[0]) * n for s, (_, n) in zip(spans, keys)) <= DIRECT_PAIRS_PER_STORAGE * len(storages):
        views, staged = [], 0
        for (key, count), (src, dst, length) in zip(keys, spans):
            src, dst, length = (x * (key[1] // unit) for x in (src, dst, length))
            keep = src != dst  # a pair onto itself changes nothing
            stage = keep & (np.abs(src - dst) < length)
            views.append(
                [list(zip(x[m].tolist(), (x + length)[m].tolist())) for m in (keep & ~stage, stage) for x in (src, dst)]
            )
            staged += int(length[stage].sum()) * unit * count
        if staged <= GATHER_BYTES:  # per part (plain sources, destinations, staged ...): spans per key
            return requests, interacting, "direct", list(zip(*views)), {s[0] for s in storages}
    chunks, sizes = [], []
    device = storages[0][2].device
    for (key, _), (src, dst, length) in zip(keys, spans):
        index = torch.from_numpy(np.stack([_ranges(src, length), _ranges(dst, length)])).to(device, non_blocking=True)
        most, n = max(1, GATHER_BYTES // key[1]), index.shape[1]
        rows = -(-n // -(-n // most)) if n else 1  # even chunks of at most `most` rows
        chunks.append([(index[0, i : i + rows], index[1, i : i + rows]) for i in range(0, n, rows)])
        sizes.append(min(rows, n) * key[1])
    buffer = torch.empty(max(sizes, default=0) // unit, dtype=storages[0][2].dtype, device=device)
    for (key, _), parts in zip(keys, chunks):
        parts[:] = [(src, dst, buffer[: src.numel() * key[1] // unit].view(src.numel(), -1)) for src, dst in parts]
    return requests, interacting, "indexed", chunks, {s[0] for s in storages}


def _copy_pair_by_pair(copy_bufs, requests, layer_name=None) -> None:
    """``dst.copy_(src.clone())`` per pair, in pair order: request, layer, state."""
    for group, ids, cur, bias, *_, dst_block in requests:
        for name, grp, states, funcs in copy_bufs._mamba_copy_layers:
            if grp == group and layer_name in (None, name):
                for state, func in zip(states, funcs):
                    spec = func(state, ids, cur, bias + 1)
                    flat = torch.empty(0, dtype=state.dtype, device=state.device).set_(state.untyped_storage())
                    src = (spec.start_addr - flat.data_ptr()) // state.element_size()
                    dst = state.storage_offset() + dst_block * state.stride(0)
                    flat[dst : dst + spec.num_elements].copy_(flat[src : src + spec.num_elements].clone())


def copy(copy_bufs, layer_name: str | None = None) -> bool:
    """Run the recorded moves of every layer (and forget them), or of one layer; False if none."""
    requests = getattr(copy_bufs, "_mamba_copy_requests", None)
    if not requests:
        return False
    plan = getattr(copy_bufs, "_mamba_copy_plan", None)
    if plan is None or plan[0] is not requests:  # once a step, also on the layerwise path
        plan = copy_bufs._mamba_copy_plan = _plan(requests, *copy_bufs._mamba_copy_storages)
    _, interacting, how, work, pending = plan
    storages = copy_bufs._mamba_copy_storages[1]
    storages = storages if layer_name is None else [s for s in storages if s[0] == layer_name]
    if how == "direct":  # views of the whole step (or layer), part by part
        srcs, dsts, staged_srcs, staged_dsts = (
            [flat[a:b] for _, k, _, flat in storages for a, b in p[k]] for p in work
        )
        if staged_srcs:  # a conv state shifted inside its block: read it whole before the copy writes it
            sizes = [s.numel() for s in staged_srcs]
            staged = torch.empty(sum(sizes), dtype=staged_srcs[0].dtype, device=staged_srcs[0].device).split(sizes)
            torch._foreach_copy_(staged, staged_srcs)
            srcs, dsts = srcs + list(staged), dsts + staged_dsts
        if srcs:
            torch._foreach_copy_(dsts, srcs)
    else:
        for _, key, rows, _ in storages:
            for src, dst, buffer in work[key]:
                torch.index_select(rows, 0, src, out=buffer)
                rows.index_copy_(0, dst, buffer)
    _copy_pair_by_pair(copy_bufs, [r for r, bad in zip(requests, interacting) if bad], layer_name)
    pending.discard(layer_name)
    if layer_name is None or not pending:  # the step is done: its buffers go
        copy_bufs._mamba_copy_plan = None
    if layer_name is None:
        copy_bufs._mamba_copy_requests = []
    return True
