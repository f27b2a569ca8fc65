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
"""Overlap-safe Mamba state copies for align-mode block moves on the NPU path.

Align mode moves Mamba states (conv and temporal states) between cache blocks.
A move can overlap itself inside one state pool: the conv-state shift copies
``state[blk, bias:]`` to ``state[blk, :width - bias]``, so ``dst < src < dst + size``.
A parallel copy kernel without ordering between its loads and stores races on
such a copy and corrupts the pool. This module provides the copy path that
``patch_mamba_utils`` binds into ``vllm.v1.worker.mamba_utils`` on the NPU path:

* ``collect_mamba_copy_meta`` has vLLM's signature and writes the pointer and
  size buffers exactly like vLLM's collector. Per pair it also records which
  state pool the pair lives in and a label (request, layer, state index), so
  that validation errors can name the pair.
* ``do_mamba_copy_block`` validates the whole batch on the host (vectorised,
  before any copy or kernel launch), then copies it with the backend selected
  by ``VLLM_ASCEND_MAMBA_COPY_BACKEND``:

  - ``torch`` (default): one ``(src_view, dst_view)`` tensor pair per copy,
    built from the validated pointers, run as ``dst.copy_(src.clone())`` in
    pair order. Memmove semantics per pair, pair order across pairs.
  - pointer backends (``triton``: the raw, unguarded ``batch_memcpy`` kernel,
    kept for A/B runs): the device copies of the buffers go to
    ``mamba_utils.batch_memcpy``, looked up at call time.

Validation (``validate_copy_batch``) refuses, naming the pair: a pointer outside
the state pool the pair belongs to, a negative or oversized size, an offset or
size that is not a whole number of elements, pointer/size/metadata buffers of
different lengths, and a dtype mismatch between the source and destination
pools. A bad address would crash the device (or segfault the Triton
interpreter), so nothing is launched unless the whole batch is valid.

Cross-pair hazards (decision: split, do not refuse)
---------------------------------------------------
One launch of a pointer kernel runs all pairs concurrently with no order
between them. If one pair's destination overlaps another pair's source or
destination, no order inside one launch is safe. The pointers are on the host,
so ``plan_ordered_launches`` detects such batches in O(n log n) (sort the
destinations, binary-search every source) and, only when a hazard exists,
splits the batch into ordered launches: every pair goes into the launch after
the last earlier pair it conflicts with. Conflicting pairs therefore run in
pair order and non-conflicting pairs commute, so the result equals a serial
memmove of the pairs in pair order, which is exactly what the ``torch`` path
computes. We split rather than refuse because vLLM defines these batches by
pair order and the torch path already honours it: refusing would turn a
legal (if unusual) scheduler step into an engine crash, and a silent race
would bring back the corruption this module exists to remove. The common,
hazard-free batch (distinct destinations; shared read-only sources such as a
prefix-cache block read by several requests are fine) stays one launch; a
split logs a warning once. Overlap of a pair with itself is not a cross-pair
hazard: it is the copy kernel's job (the ``triton`` backend keeps the
upstream race there on purpose, for A/B runs).
"""

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from vllm.logger import logger
from vllm.v1.worker import mamba_utils

import vllm_ascend.envs as envs_ascend

ENV_NAME = "VLLM_ASCEND_MAMBA_COPY_BACKEND"
TORCH_BACKEND = "torch"

# Per-batch metadata lives on the MambaCopyBuffers object under this name.
_BATCH_ATTR = "_ascend_mamba_copy_batch"

_active_backend = TORCH_BACKEND


class MambaCopyConfigError(ValueError):
    """The copy backend configuration is invalid (raised at start-up)."""


class MambaCopyValidationError(ValueError):
    """A copy batch failed validation; nothing was copied or launched."""


def allowed_backends() -> tuple[str, ...]:
    return tuple(envs_ascend.MAMBA_COPY_BACKENDS)


def resolve_backend(value: str | None = None) -> str:
    """Return the validated backend name (``value`` or the environment)."""
    if value is None:
        value = os.environ.get(ENV_NAME, "")
        name = envs_ascend.VLLM_ASCEND_MAMBA_COPY_BACKEND
    else:
        name = value.strip().lower() or TORCH_BACKEND
    allowed = allowed_backends()
    if name not in allowed:
        raise MambaCopyConfigError(
            f"Unknown {ENV_NAME}={value!r}; allowed values: {', '.join(allowed)} (default: {TORCH_BACKEND})."
        )
    return name


def active_backend() -> str:
    return _active_backend


def bind_mamba_state_copy(
    mamba_utils_module: Any,
    *,
    on_310p: bool,
    pointer_kernels: Mapping[str, Callable[..., Any]],
    backend: str | None = None,
) -> str:
    """Bind the copy path selected by ``VLLM_ASCEND_MAMBA_COPY_BACKEND``.

    Called once at start-up by ``patch_mamba_utils``. On 310P the module keeps
    its own tensor-copy fallback and only a pointer backend is an error there.
    Returns the active backend name.
    """
    global _active_backend
    name = resolve_backend(backend)
    if on_310p:
        if name != TORCH_BACKEND:
            raise MambaCopyConfigError(
                f"{ENV_NAME}={name!r} selects a pointer-based Triton copy kernel, but 310P cannot launch "
                f"Triton kernels; use {TORCH_BACKEND!r} (the 310P tensor-copy fallback) or unset {ENV_NAME}."
            )
        _active_backend = name
        logger.info_once("Mamba state copies: 310P tensor-copy fallback (dst.copy_(src.clone())).")
        return name
    if name != TORCH_BACKEND:
        kernel = pointer_kernels.get(name)
        if kernel is None:
            raise MambaCopyConfigError(f"{ENV_NAME}={name!r} is allowed but no copy kernel is bound for it.")
        mamba_utils_module.batch_memcpy = kernel
    mamba_utils_module.collect_mamba_copy_meta = collect_mamba_copy_meta
    mamba_utils_module.do_mamba_copy_block = do_mamba_copy_block
    _active_backend = name
    if name == TORCH_BACKEND:
        logger.info_once("Mamba state copies: overlap-safe tensor pairs, dst.copy_(src.clone()) (%s=torch).", ENV_NAME)
    else:
        logger.info_once("Mamba state copies: pointer kernel %r via mamba_utils.batch_memcpy (%s).", name, ENV_NAME)
    return name


class _CopyBatch:
    """Host-side metadata of the pairs recorded in one MambaCopyBuffers step."""

    __slots__ = ("pools", "pool_ids", "src_pools", "dst_pools", "labels")

    def __init__(self) -> None:
        self.pools: list[torch.Tensor] = []
        self.pool_ids: dict[int, int] = {}
        self.src_pools: list[int] = []
        self.dst_pools: list[int] = []
        self.labels: list[Any] = []

    def pool_index(self, state: torch.Tensor) -> int:
        idx = self.pool_ids.get(id(state))
        if idx is None:
            idx = len(self.pools)
            self.pools.append(state)
            self.pool_ids[id(state)] = idx
        return idx


def _batch_for(copy_bufs: Any) -> _CopyBatch:
    batch = getattr(copy_bufs, _BATCH_ATTR, None)
    if batch is None or copy_bufs.offset == 0:
        batch = _CopyBatch()
        setattr(copy_bufs, _BATCH_ATTR, batch)
    return batch


def _clear_batch(copy_bufs: Any) -> None:
    if getattr(copy_bufs, _BATCH_ATTR, None) is not None:
        setattr(copy_bufs, _BATCH_ATTR, None)


def collect_mamba_copy_meta(
    copy_bufs: Any,
    kv_cache_config: Any,
    mamba_state_copy_funcs: Sequence[Callable[..., Any]],
    mamba_group_ids: list[int],
    src_block_idx: int,
    dest_block_idx: int,
    accept_token_bias: int,
    req_state: Any,
    forward_context: dict[str, Any],
) -> None:
    """vLLM's ``collect_mamba_copy_meta`` plus the pool and label of every pair."""
    if src_block_idx == dest_block_idx and accept_token_bias == 0:
        return

    batch = _batch_for(copy_bufs)
    src_ptrs_np = copy_bufs.src_ptrs.np
    dst_ptrs_np = copy_bufs.dst_ptrs.np
    sizes_np = copy_bufs.sizes.np
    offset = copy_bufs.offset
    req_id = getattr(req_state, "req_id", None)

    for mamba_group_id in mamba_group_ids:
        block_ids = req_state.block_ids[mamba_group_id]
        dest_block_id = block_ids[dest_block_idx]
        layer_names = kv_cache_config.kv_cache_groups[mamba_group_id].layer_names
        for layer_name in layer_names:
            kv_caches: list[torch.Tensor] = forward_context[layer_name].kv_cache
            for state_idx, (state, state_copy_func) in enumerate(zip(kv_caches, mamba_state_copy_funcs)):
                copy_spec = state_copy_func(state, block_ids, src_block_idx, accept_token_bias + 1)
                src_ptrs_np[offset] = copy_spec.start_addr
                dst_ptrs_np[offset] = state[dest_block_id].data_ptr()
                sizes_np[offset] = copy_spec.num_elements * state.element_size()
                pool = batch.pool_index(state)
                batch.src_pools.append(pool)
                batch.dst_pools.append(pool)
                batch.labels.append((req_id, layer_name, state_idx))
                offset += 1

    copy_bufs.offset = offset


def record_copy(
    copy_bufs: Any,
    src_state: torch.Tensor,
    src_addr: int,
    dst_state: torch.Tensor,
    dst_addr: int,
    num_bytes: int,
    label: Any = None,
) -> None:
    """Append one raw pair (addresses inside ``src_state`` / ``dst_state``) to the batch."""
    batch = _batch_for(copy_bufs)
    offset = copy_bufs.offset
    copy_bufs.src_ptrs.np[offset] = src_addr
    copy_bufs.dst_ptrs.np[offset] = dst_addr
    copy_bufs.sizes.np[offset] = num_bytes
    batch.src_pools.append(batch.pool_index(src_state))
    batch.dst_pools.append(batch.pool_index(dst_state))
    batch.labels.append(label)
    copy_bufs.offset = offset + 1


def _pool_span_bytes(state: torch.Tensor) -> int:
    """Bytes from ``state.data_ptr()`` to one past its last element (strides included)."""
    if state.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(state.shape, state.stride()))
    return (last + 1) * state.element_size()


def _describe(index: int, label: Any) -> str:
    if isinstance(label, tuple) and len(label) == 3:
        req_id, layer_name, state_idx = label
        return f"pair {index} (request {req_id!r}, layer {layer_name!r}, state {state_idx})"
    if label is not None:
        return f"pair {index} ({label})"
    return f"pair {index}"


def validate_copy_batch(
    src_ptrs: Sequence[int] | np.ndarray,
    dst_ptrs: Sequence[int] | np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    pools: Sequence[torch.Tensor],
    src_pools: Sequence[int],
    dst_pools: Sequence[int],
    labels: Sequence[Any] | None = None,
) -> None:
    """Raise ``MambaCopyValidationError`` naming the first invalid pair.

    Pair ``i`` copies ``sizes[i]`` bytes from ``src_ptrs[i]`` (inside
    ``pools[src_pools[i]]``) to ``dst_ptrs[i]`` (inside ``pools[dst_pools[i]]``).
    """
    lengths = {
        "src_ptrs": len(src_ptrs),
        "dst_ptrs": len(dst_ptrs),
        "sizes": len(sizes),
        "src pools": len(src_pools),
        "dst pools": len(dst_pools),
    }
    if labels is not None:
        lengths["labels"] = len(labels)
    if len(set(lengths.values())) > 1:
        raise MambaCopyValidationError(
            "Mamba state copy buffers have different lengths ("
            + ", ".join(f"{k}={v}" for k, v in lengths.items())
            + "); refusing to copy."
        )
    n = len(sizes)
    if n == 0:
        return
    src = np.asarray(src_ptrs, dtype=np.int64)
    dst = np.asarray(dst_ptrs, dtype=np.int64)
    size = np.asarray(sizes, dtype=np.int64)
    pool_base = np.array([p.data_ptr() for p in pools], dtype=np.int64)
    pool_span = np.array([_pool_span_bytes(p) for p in pools], dtype=np.int64)
    pool_elem = np.array([p.element_size() for p in pools], dtype=np.int64)
    sp = np.asarray(src_pools, dtype=np.int64)
    dp = np.asarray(dst_pools, dtype=np.int64)
    if sp.min() < 0 or dp.min() < 0 or max(sp.max(), dp.max()) >= len(pools):
        raise MambaCopyValidationError("Mamba state copy metadata refers to an unknown state pool.")

    s_base, s_span, elem = pool_base[sp], pool_span[sp], pool_elem[sp]
    d_base, d_span = pool_base[dp], pool_span[dp]
    # src >= base makes src - base non-negative, so no int64 wrap-around below.
    s_off = np.where(src >= s_base, src - s_base, -1)
    d_off = np.where(dst >= d_base, dst - d_base, -1)
    dtype_codes: dict[torch.dtype, int] = {}
    pool_dtype = np.array([dtype_codes.setdefault(p.dtype, len(dtype_codes)) for p in pools], dtype=np.int64)
    dtype_ok = pool_dtype[sp] == pool_dtype[dp]
    checks = (
        (size < 0, "has a negative size"),
        (size > np.minimum(s_span, d_span), "is larger than its state pool"),
        ((s_off < 0) | (s_off > s_span - size), "reads outside its source state pool"),
        ((d_off < 0) | (d_off > d_span - size), "writes outside its destination state pool"),
        (~dtype_ok, "copies between state pools of different dtypes"),
        ((s_off % elem != 0) | (d_off % elem != 0), "starts at an offset that is not element-aligned"),
        (size % elem != 0, "has a size that is not a whole number of elements"),
    )
    bad = np.zeros(n, dtype=bool)
    for mask, _ in checks:
        bad |= mask
    if not bad.any():
        return
    i = int(np.argmax(bad))
    reason = next(text for mask, text in checks if mask[i])
    src_pool, dst_pool = pools[int(sp[i])], pools[int(dp[i])]
    raise MambaCopyValidationError(
        f"Mamba state copy {_describe(i, labels[i] if labels is not None else None)} {reason}: "
        f"src={int(src[i]):#x} dst={int(dst[i]):#x} size={int(size[i])} bytes; "
        f"source pool [{int(s_base[i]):#x}, +{int(s_span[i])}) {src_pool.dtype}, "
        f"destination pool [{int(d_base[i]):#x}, +{int(d_span[i])}) {dst_pool.dtype}. "
        "No copy was launched."
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


def plan_ordered_launches(src_ptrs: np.ndarray, dst_ptrs: np.ndarray, sizes: np.ndarray) -> list[np.ndarray] | None:
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


def _flat_view(state: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(state, (_pool_span_bytes(state) // state.element_size(),), (1,))


def _checked_batch(copy_bufs: Any, n: int) -> _CopyBatch:
    batch = getattr(copy_bufs, _BATCH_ATTR, None)
    if batch is None:
        batch = _CopyBatch()
    if len(batch.labels) != n:
        raise MambaCopyValidationError(
            f"Mamba state copy buffers have different lengths (pointer and size buffers hold {n} pairs, "
            f"{len(batch.labels)} pairs were recorded by the collector); refusing to copy."
        )
    validate_copy_batch(
        copy_bufs.src_ptrs.np[:n],
        copy_bufs.dst_ptrs.np[:n],
        copy_bufs.sizes.np[:n],
        batch.pools,
        batch.src_pools,
        batch.dst_pools,
        batch.labels,
    )
    return batch


def tensor_copy_pairs(copy_bufs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validate the batch and return its ``(src_view, dst_view)`` pairs in pair order."""
    n = copy_bufs.offset
    batch = _checked_batch(copy_bufs, n)
    flats = [_flat_view(pool) for pool in batch.pools]
    bases = [pool.data_ptr() for pool in batch.pools]
    elems = [pool.element_size() for pool in batch.pools]
    pairs = []
    for src, dst, size, sp, dp in zip(
        copy_bufs.src_ptrs.np[:n].tolist(),
        copy_bufs.dst_ptrs.np[:n].tolist(),
        copy_bufs.sizes.np[:n].tolist(),
        batch.src_pools,
        batch.dst_pools,
    ):
        count = size // elems[sp]
        src_view = flats[sp].narrow(0, (src - bases[sp]) // elems[sp], count)
        dst_view = flats[dp].narrow(0, (dst - bases[dp]) // elems[dp], count)
        pairs.append((src_view, dst_view))
    return pairs


def _launch_pointer_kernel(copy_bufs: Any, n: int) -> None:
    launches = plan_ordered_launches(copy_bufs.src_ptrs.np[:n], copy_bufs.dst_ptrs.np[:n], copy_bufs.sizes.np[:n])
    if launches is not None:
        # Group the host buffers launch by launch (pair order inside each) and
        # launch the slices one after another on the stream.
        perm = np.concatenate(launches)
        for buf in (copy_bufs.src_ptrs, copy_bufs.dst_ptrs, copy_bufs.sizes):
            buf.np[:n] = buf.np[:n][perm]
        logger.warning_once(
            "Mamba state copy batch has cross-pair overlaps; running it as %d ordered launches.", len(launches)
        )
    src_ptrs = copy_bufs.src_ptrs.copy_to_gpu(n)
    dst_ptrs = copy_bufs.dst_ptrs.copy_to_gpu(n)
    sizes = copy_bufs.sizes.copy_to_gpu(n)
    if launches is None:
        mamba_utils.batch_memcpy(src_ptrs, dst_ptrs, sizes)
        return
    start = 0
    for launch in launches:
        stop = start + len(launch)
        mamba_utils.batch_memcpy(src_ptrs[start:stop], dst_ptrs[start:stop], sizes[start:stop])
        start = stop


def do_mamba_copy_block(copy_bufs: Any) -> None:
    """Validate, then copy the collected batch with the active backend."""
    n = copy_bufs.offset
    if n == 0:
        _clear_batch(copy_bufs)
        return
    if _active_backend == TORCH_BACKEND:
        for src_view, dst_view in tensor_copy_pairs(copy_bufs):
            dst_view.copy_(src_view.clone())
    else:
        _checked_batch(copy_bufs, n)
        _launch_pointer_kernel(copy_bufs, n)
    _clear_batch(copy_bufs)
