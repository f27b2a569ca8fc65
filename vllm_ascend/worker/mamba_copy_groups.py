# SPDX-License-Identifier: Apache-2.0
"""Grouped tensor copies for align-mode Mamba state moves (the ``torch`` copy backend).

Per request and KV-cache group the collector knows a destination block and, per
state, a source block and a shift (vLLM's ``get_conv_copy_spec`` and
``get_temporal_copy_spec``), shared by the group's layers. So a step is recorded
as a few block ids per request and copied per family of layers: those one
storage holds at one stride (every layer of a group where the model runner
slices all layers from one allocation, else one), with other groups' layers at
the same places. Requests whose blocks interact (``conflicting_pairs``: a chain,
a shared destination) are copied per pair, in order. The others touch disjoint
blocks, so only a conv state shifted inside its block overlaps itself. Small
steps are copied by one multi-tensor copy of views over a family's layers (the
self-overlapping sources staged first), larger ones by row indices into each
family: ``index_select`` into a buffer, then ``index_copy_``, in chunks of at
most ``GATHER_BYTES`` (allocated after vLLM has sized the KV cache). A chunk
reads its rows before writing, and a self-overlapping pair only shifts towards
lower rows, so later chunks read no row an earlier chunk wrote.
"""

import math

import numpy as np
import torch
from vllm.model_executor.layers.mamba import mamba_utils as vllm_mamba

from vllm_ascend.worker.mamba_copy_checks import conflicting_pairs

GATHER_BYTES = 64 << 20  # the most bytes of temporaries one copy holds
DIRECT_PAIRS_PER_FAMILY = 4  # direct copies up to this x (families + 2: the row-index plan's fixed cost) pairs
_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _kind(func, state: torch.Tensor) -> str | None:
    conv = None if getattr(vllm_mamba, "is_conv_state_dim_first", lambda: False)() else "conv"
    kind = {vllm_mamba.get_conv_copy_spec: conv, vllm_mamba.get_temporal_copy_spec: "temporal"}.get(func)
    return kind if state.dim() > 1 and state[0].is_contiguous() else None


def _storages(layers):
    """(keys, families, places, blocks), or None for a layout the grouped copy does not know. A family is (key,
    its layers as a (layers, rows, row) and a (layers, elements) tensor); a key (row bytes, geometry from a layer's
    first byte, layers, groups) is shared by families laid out alike; ``places``: a layer's (family, index, group)s."""
    found: dict[int, list] = {}  # storage: [storage, {(group, geometry): [(first byte, layer)]}, row bytes]
    for name, group, states, funcs in layers:
        by_storage: dict[int, list] = {}
        for state, func in zip(states, funcs):
            by_storage.setdefault(state.untyped_storage().data_ptr(), []).append((state, _kind(func, state)))
        for ptr, members in by_storage.items():
            first = min(s.data_ptr() for s, _ in members)
            geometry = tuple(
                (kind, s.data_ptr() - first, *(n * s.element_size() for n in (s.stride(0), s[0].numel(), s.stride(1))))
                for s, kind in members
            )
            spans = sorted((offset, offset + nbytes) for _, offset, _, nbytes, _ in geometry) + [(geometry[0][2],)]
            if len({g[2] for g in geometry}) > 1 or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                return None  # a layer's states in one storage are disjoint and fit in a block of one stride
            entry = found.setdefault(ptr, [members[0][0].untyped_storage(), {}, 0])
            entry[1].setdefault((group, geometry), []).append((first - ptr, name))
            entry[2] = math.gcd(entry[2], first - ptr, *(x for g in geometry for x in g[1:]))
    unit = max(u for u in _DTYPES if all(row % u == 0 for *_, row in found.values()))
    runs: dict[tuple, dict] = {}
    for ptr, (storage, members, row) in found.items():
        size = storage.nbytes() // row * row
        for (group, geometry), at in members.items():
            firsts, names = zip(*sorted(at))
            spacing = firsts[1] - firsts[0] if len(firsts) > 1 else size - firsts[0]
            if np.diff(firsts).tolist() != [spacing] * (len(firsts) - 1) or firsts[0] + len(firsts) * spacing > size:
                return None  # the layers of a group in one storage lie at one stride (vLLM's layer stride)
            runs.setdefault((ptr, row, geometry, firsts[0], spacing, len(firsts)), {})[group] = names
    keys, families, places = {}, [], {}
    for (ptr, row, geometry, first, spacing, count), groups in runs.items():
        flat = torch.empty(0, dtype=torch.uint8, device=found[ptr][0].device).set_(found[ptr][0])
        stack = flat[first : first + count * spacing].view(_DTYPES[unit]).view(count, spacing // row, -1)
        key = keys.setdefault((row, geometry, count, tuple(sorted(groups))), len(keys))
        for group, names in groups.items():
            places.update({name: [*places.get(name, []), (len(families), i, group)] for i, name in enumerate(names)})
        families.append((key, stack, stack.view(count, -1)))
    return list(keys), families, places, min(s.shape[0] for *_, states, _ in layers for s in states)


def record(copy_bufs, layers_fn, mamba_group_ids, src_block_idx, dest_block_idx, bias, req_state) -> bool:
    """Record one request's moves; False when a copy function or state layout is not a known one.
    ``layers_fn()``: (layer name, KV-cache group id, states, copy functions) of the Mamba layers, read once a step."""
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


def _pairs(reqs: np.ndarray, key):
    """First source row, first destination row, row count and group of each pair of a layer of a family with
    this key, from the layer's first byte: group by group, then state, then request."""
    row, geometry, _, groups = key
    grp, bias, conv_src, temporal_src, dst = reqs[np.equal.outer(reqs[:, 0], groups).any(1)].T
    kind, offset, stride, nbytes, row_bytes = (np.array(x)[:, None] for x in zip(*geometry))
    shift = np.where(kind == "conv", bias * row_bytes, 0)
    src = (offset + np.where(kind == "conv", conv_src, temporal_src) * stride + shift) // row
    pairs = src, (offset + dst * stride) // row, np.maximum(nbytes - shift, 0) // row, np.broadcast_to(grp, src.shape)
    order = np.argsort(pairs[3].ravel(), kind="stable")
    return [x.ravel()[order] for x in pairs]


def _plan(requests, keys, families, places, blocks):
    """How this step's requests are copied: (requests, interacting mask, direct views or row indices per key)."""
    table = np.array([(r[0], r[3], *r[4:]) for r in requests], dtype=np.int64)
    if table[:, 2:].min() < 0 or table[:, 2:].max() >= blocks:
        raise IndexError(f"Mamba state copy outside the {blocks} KV-cache blocks: {np.unique(table[:, 2:]).tolist()}")
    interacting = np.zeros(len(requests), dtype=bool)
    ids = np.sort(table[:, 2:], axis=1)
    ids = ids[np.diff(ids, axis=1, prepend=-1) != 0]  # the blocks of each request, once
    if np.unique(ids).size < ids.size:  # some block touched by two requests: do they interact?
        owners = np.tile(np.arange(len(requests)), 2)
        pairs = conflicting_pairs(table[:, 2:4].T.ravel(), np.tile(table[:, 4], 2), np.ones_like(owners), owners)
        interacting = pairs[: len(requests)] | pairs[len(requests) :]
    pairs = [_pairs(table[~interacting], key) for key in keys]
    unit = families[0][1].element_size()
    if sum(len(pairs[key][0]) for key, *_ in families) <= DIRECT_PAIRS_PER_FAMILY * (len(families) + 2):
        views, staged = [], []  # per key: parts (sources, destinations, staged ones) of (group, start, end)
        for key, (src, dst, length, group) in zip(keys, pairs):
            src, dst, length = (x * (key[0] // unit) for x in (src, dst, length))
            keep = src != dst  # a pair onto itself changes nothing
            stage = keep & (np.abs(src - dst) < length)
            parts = [(group[m], x[m], (x + length)[m]) for m in (keep & ~stage, stage) for x in (src, dst)]
            views.append([list(zip(*(y.tolist() for y in part))) for part in parts])
            staged.append(int(length[stage].sum()) * unit * key[2])  # bytes staged in a family of this key
        if sum(staged[key] for key, *_ in families) <= GATHER_BYTES:
            return requests, interacting, "direct", list(zip(*views)), set(places)
    device, size, indices = families[0][1].device, 0, {}
    for k, stack in {k: stack for k, stack, _ in reversed(families)}.items():  # each key's row indices
        (row, _, layers, groups), (src, dst, length, group) = keys[k], pairs[k]
        ends = np.cumsum([0, *(length[group == g].sum() for g in groups)]).tolist()
        index = torch.from_numpy(np.stack([_ranges(src, length), _ranges(dst, length)])).to(device, non_blocking=True)
        first = torch.arange(0, layers * stack.shape[1], stack.shape[1], device=device)  # every layer's first row
        n = ends[-1]  # a layer's rows: group by group (``spans``), layer after layer in the index
        spans = {(i, g): (i * n + ends[j], i * n + ends[j + 1]) for i in range(layers) for j, g in enumerate(groups)}
        indices[k] = ((index[:, None] + first[None, :, None]).view(2, -1), spans)
        size = max(size, min(layers * n, max(1, GATHER_BYTES // row)) * row)
    buffer = torch.empty(size // unit, dtype=families[0][1].dtype, device=device)
    whole = {k: _chunks(*index, buffer, keys[k][0] // unit) for k, (index, _) in indices.items()}
    return requests, interacting, "indexed", (indices, buffer, whole), set(places)


def _chunks(src, dst, buffer, row: int):
    """(source rows, destination rows, buffer) of each chunk of at most GATHER_BYTES of ``row``-element rows."""
    step = max(1, GATHER_BYTES // (row * buffer.element_size()))
    chunks = list(zip(src.split(step), dst.split(step))) if len(src) else []
    out = {n: buffer[: n * row].view(n, row) for n in {len(s) for s, _ in chunks}}
    return [(s, d, out[len(s)]) for s, d in chunks]


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
    _, families, places, _ = copy_bufs._mamba_copy_storages
    # (family, layer index in it, group): all of every family, or one layer's places
    targets = [(f, None, None) for f in range(len(families))] if layer_name is None else places.get(layer_name, [])
    if how == "direct":  # views of the whole step (or layer), part by part
        views = [(key, rows if only is None else rows[only : only + 1], grp) for f, only, grp in targets
                 for key, _, rows in [families[f]]]  # fmt: skip
        srcs, dsts, staged_srcs, staged_dsts = (  # (layers, elements) views, a family's layers at once
            [rows[:, a:b] for key, rows, grp in views for g, a, b in part[key] if grp in (None, g)] for part in work
        )
        if staged_srcs:  # a conv state shifted inside its block: read it whole before the copy writes it
            sizes = [s.numel() for s in staged_srcs]
            staged = torch.empty(sum(sizes), dtype=staged_srcs[0].dtype, device=staged_srcs[0].device).split(sizes)
            staged = [t.view(s.shape) for t, s in zip(staged, staged_srcs)]
            torch._foreach_copy_(staged, staged_srcs)
            srcs, dsts = srcs + list(staged), dsts + staged_dsts
        if srcs:
            torch._foreach_copy_(dsts, srcs)
    else:  # row indices into a family's layers (or one layer), chunk by chunk
        indices, buffer, whole = work
        for f, only, grp in targets:
            key, stack, _ = families[f]
            ((src, dst), spans), rows = indices[key], stack.view(-1, stack.shape[2])
            a, b = spans[only, grp] if only is not None else (0, 0)
            for s, d, out in whole[key] if only is None else _chunks(src[a:b], dst[a:b], buffer, rows.shape[1]):
                torch.index_select(rows, 0, s, out=out)
                rows.index_copy_(0, d, out)
    _copy_pair_by_pair(copy_bufs, [r for r, bad in zip(requests, interacting) if bad], layer_name)
    pending.discard(layer_name)
    if layer_name is None or not pending:  # the step is done: its buffers go
        copy_bufs._mamba_copy_plan = None
    if layer_name is None:
        copy_bufs._mamba_copy_requests = []
    return True
