# SPDX-License-Identifier: Apache-2.0
"""Grouped tensor copies for align-mode Mamba state moves (the ``torch`` copy backend).

Per request and KV-cache group the collector knows a destination block and, per
state, a source block and a shift: vLLM's ``get_conv_copy_spec`` reads block
``block_ids[cur]`` from row ``bias`` on, ``get_temporal_copy_spec`` the whole
block ``block_ids[cur + bias]``, and every layer of the group shares those block
ids. So a step is recorded as a few block ids per request, and copied per
storage (a layer's raw KV-cache tensor, or a state pool of its own) with one
``index_select`` of rows followed by one ``index_copy_``: every source row is
read before any destination row is written, which is memmove semantics for
each pair. Requests whose blocks interact (``conflicting_pairs`` on block ids:
a chain, a shared destination) are copied per pair, in pair order.
"""

import math

import numpy as np
import torch
from vllm.model_executor.layers.mamba import mamba_utils as vllm_mamba

from vllm_ascend.worker.mamba_copy_checks import conflicting_pairs


def _kind(func, state: torch.Tensor) -> str | None:
    if state.dim() < 2 or not state[0].is_contiguous():
        return None
    if func is vllm_mamba.get_temporal_copy_spec:
        return "temporal"
    dim_first = getattr(vllm_mamba, "is_conv_state_dim_first", lambda: False)()
    return "conv" if func is vllm_mamba.get_conv_copy_spec and not dim_first else None


def _storages(layers):
    """Per layer, its states grouped by storage: (layer, (group, row bytes, geometry), rows view)."""
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
            row = math.gcd(*(x for g in geometry for x in g[1:]))
            unit = 4 if row % 4 == 0 else 1
            flat = torch.empty(0, dtype=torch.uint8, device=members[0][0].device).set_(members[0][0].untyped_storage())
            rows = flat[: flat.numel() // row * row].view(torch.int32 if unit == 4 else torch.uint8)
            out.append((name, (group, row, geometry), rows.view(-1, row // unit)))
    return out


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
    if copy_bufs._mamba_copy_storages is None:
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


def _row_indices(reqs: np.ndarray, rows: torch.Tensor, group: int, row: int, geometry):
    """Source and destination rows of the recorded requests ``reqs`` of ``group`` in one storage."""
    reqs = reqs[reqs[:, 0] == group]
    _, bias, conv_src, temporal_src, dst = reqs.T
    src_rows, dst_rows = [], []
    for kind, offset, stride, nbytes, row_bytes in geometry:
        shift = bias * row_bytes if kind == "conv" else 0
        src = conv_src if kind == "conv" else temporal_src
        length = (nbytes - shift) // row + np.zeros(len(reqs), dtype=np.int64)
        src_rows.append(_ranges((offset + src * stride + shift) // row, length))
        dst_rows.append(_ranges((offset + dst * stride) // row, length))
    both = np.concatenate(src_rows + dst_rows)
    if both.size and (both.min() < 0 or both.max() >= rows.shape[0]):
        raise IndexError(f"Mamba state copy outside its storage: block ids {sorted(set(reqs[:, 2:].flat))}")
    both = torch.from_numpy(both).to(rows.device, non_blocking=True)  # one host-to-device copy
    return (both[: both.numel() // 2], both[both.numel() // 2 :]) if both.numel() else None


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
        table = np.array([(r[0], r[3], *r[4:]) for r in requests], dtype=np.int64)
        _, _, conv_src, temporal_src, dst = table.T
        owners = np.tile(np.arange(len(requests)), 2)
        interacting = np.zeros(len(requests), dtype=bool)
        if len(requests) > 1:  # one request cannot interact with another
            pairs = conflicting_pairs(np.r_[conv_src, temporal_src], np.r_[dst, dst], np.ones_like(owners), owners)
            interacting = pairs[: len(requests)] | pairs[len(requests) :]
        plan = copy_bufs._mamba_copy_plan = (requests, table[~interacting], interacting, {})
    _, safe, interacting, indices = plan
    for name, key, rows in copy_bufs._mamba_copy_storages if safe.size else ():
        if layer_name in (None, name):
            if key not in indices:
                indices[key] = _row_indices(safe, rows, *key)
            if indices[key] is not None:
                src, dst = indices[key]
                rows.index_copy_(0, dst, rows.index_select(0, src))
    _copy_pair_by_pair(copy_bufs, [r for r, bad in zip(requests, interacting) if bad], layer_name)
    if layer_name is None:
        copy_bufs._mamba_copy_requests = []
    return True
