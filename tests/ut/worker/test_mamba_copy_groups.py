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
"""Grouped copies and vectorised collection against a numpy memmove oracle.

State pools are carved out of one byte buffer filled with random bytes, with
page padding between blocks and conv and temporal states sharing pages, the
way block-major KV-cache pages bind them. Every test compares the whole
buffer byte for byte with the oracle: per pair, in pair order,
``buf[dst:dst + n] = buf[src:src + n].copy()``.

Set ``VLLM_ASCEND_MAMBA_COPY_GROUPS_UNSAFE=1`` to run the copies with the
interaction check switched off: the tests with interacting pairs then fail.
Runs on CPU by default; ``MAMBA_COPY_TEST_DEVICE=cuda`` (or npu) runs the
copies on a device. Hypothesis: 60 derandomized examples a property, or
``VLLM_ASCEND_FUZZ_PROFILE=long`` for 1000 random ones.
"""

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_ascend.worker import mamba_copy_batch as mcb
from vllm_ascend.worker import mamba_copy_groups as mcg

try:  # vLLM's own copy functions when vLLM is installed (tests/ut)
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
except ImportError:  # a model of them elsewhere (device machines without vLLM)

    @dataclass
    class _Spec:
        start_addr: int
        num_elements: int

    def get_conv_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
        src = state[block_ids[cur_block_idx], num_accepted_tokens - 1 :]
        return _Spec(src.data_ptr(), src.numel())

    def get_temporal_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
        src = state[block_ids[cur_block_idx + num_accepted_tokens - 1]]
        return _Spec(src.data_ptr(), src.numel())

    mcg.register_copy_func(get_conv_copy_spec, mcg.OFFSET_KIND)
    mcg.register_copy_func(get_temporal_copy_spec, mcg.INDEX_KIND)


CHECK_HAZARDS = os.environ.get("VLLM_ASCEND_MAMBA_COPY_GROUPS_UNSAFE") != "1"
DEVICE = os.environ.get("MAMBA_COPY_TEST_DEVICE", "cpu")
LONG = os.environ.get("VLLM_ASCEND_FUZZ_PROFILE") == "long"
FUZZ = settings(
    max_examples=1000 if LONG else 60,
    derandomize=not LONG,
    deadline=None,
    # the function-scoped fixtures (copy_path, op_pair) only set module constants
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int8)


def unrecognised_conv_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
    """Same addresses as the conv spec, but a function the grouping does not know."""
    return get_conv_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens)


def lying_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
    """Registered as the offset kind but reads the last block id: the probes must reject it."""
    return get_conv_copy_spec(state, [block_ids[-1]], 0, num_accepted_tokens)


mcg.register_copy_func(lying_spec, mcg.OFFSET_KIND)


class Arena:
    """One random byte buffer and the state pools carved out of it."""

    def __init__(self, rng, layers, num_blocks, shared_pages=True):
        self.layers = []  # per layer: (name, [states], [funcs])
        specs = []
        for li in range(layers):
            width = int(rng.integers(2, 5))
            dim = int(rng.integers(1, 9))
            conv_dtype = DTYPES[int(rng.integers(len(DTYPES)))]
            temp_dtype = DTYPES[int(rng.integers(len(DTYPES)))]
            temp_shape = (int(rng.integers(1, 3)), int(rng.integers(1, 5)))
            specs.append((f"layer.{li}", width, dim, conv_dtype, temp_dtype, temp_shape))
        # Lay out every layer's pages: conv state, then temporal state, then padding.
        offset = 0
        plan = []
        for name, width, dim, conv_dtype, temp_dtype, temp_shape in specs:
            conv_bytes = width * dim * _esize(conv_dtype)
            temp_off = _align(conv_bytes, _esize(temp_dtype))
            temp_bytes = temp_shape[0] * temp_shape[1] * _esize(temp_dtype)
            page = _align(temp_off + temp_bytes + int(rng.integers(0, 3)) * 4, 4)
            if not shared_pages:
                temp_off = None
            plan.append((offset, page, temp_off))
            offset = _align(offset + page * num_blocks + (0 if shared_pages else temp_bytes * num_blocks + 4), 8)
        self.nbytes = offset + 64
        self.buf = torch.from_numpy(rng.integers(0, 256, self.nbytes, dtype=np.uint8)).to(DEVICE)
        for (name, width, dim, conv_dtype, temp_dtype, temp_shape), (off, page, temp_off) in zip(specs, plan):
            conv = self._carve(off, conv_dtype, (num_blocks, width, dim), page)
            if temp_off is None:
                t_start = off + page * num_blocks
                t_page = temp_shape[0] * temp_shape[1] * _esize(temp_dtype)
                temporal = self._carve(_align(t_start, 4), temp_dtype, (num_blocks, *temp_shape), t_page)
            else:
                temporal = self._carve(off + temp_off, temp_dtype, (num_blocks, *temp_shape), page)
            self.layers.append((name, [conv, temporal], [get_conv_copy_spec, get_temporal_copy_spec]))

    def _carve(self, byte_off, dtype, shape, page_bytes):
        es = _esize(dtype)
        assert byte_off % es == 0 and page_bytes % es == 0
        flat = self.buf.view(dtype) if es == 1 else self.buf[: self.nbytes - self.nbytes % es].view(dtype)
        inner = shape[1:]
        strides = [page_bytes // es]
        acc = 1
        inner_strides = []
        for d in reversed(inner):
            inner_strides.append(acc)
            acc *= d
        return flat.as_strided(shape, tuple(strides + list(reversed(inner_strides))), byte_off // es)

    def snapshot(self):
        return self.buf.cpu().numpy().copy()

    def addr0(self):
        return self.buf.data_ptr()


def _esize(dtype):
    return torch.empty(0, dtype=dtype).element_size()


def _align(x, a):
    return (x + a - 1) // a * a


def oracle(snapshot, addr0, src, dst, nbytes):
    out = snapshot.copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist()):
        s, d = s - addr0, d - addr0
        out[d : d + n] = out[s : s + n].copy()
    return out


def reference_collect(layers, block_ids, src_idx, dest_idx, bias):
    """The per-pair collector's loop: one call of the copy function per layer and state."""
    src, dst, sizes = [], [], []
    dest_block_id = block_ids[dest_idx]
    for _, states, funcs in layers:
        for state, func in zip(states, funcs):
            spec = func(state, block_ids, src_idx, bias + 1)
            src.append(spec.start_addr)
            dst.append(state[dest_block_id].data_ptr())
            sizes.append(spec.num_elements * state.element_size())
    return np.array(src, np.int64), np.array(dst, np.int64), np.array(sizes, np.int64)


def make_rows(cap):
    return mcg.CopyRows(np.zeros(cap, np.int64), np.zeros(cap, np.int64), np.zeros(cap, np.int32))


def collect_all(layout, requests, cap):
    rows = make_rows(cap)
    offset = 0
    for block_ids, src_idx, dest_idx, bias in requests:
        offset = mcg.collect_request(layout, 0, block_ids, src_idx, dest_idx, bias, rows, offset)
    return rows, offset


def assert_bytes_equal(got, want):
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:8].tolist()}"


def run_and_check(arena, layout, rows, n, check_hazards=CHECK_HAZARDS):
    pool_ids, src, dst, nbytes, groupable = rows.batch(n)
    before = arena.snapshot()
    want = oracle(before, arena.addr0(), src, dst, nbytes)
    plan = mcb.copy_rows(layout.pools, pool_ids, src, dst, nbytes, groupable, check_hazards=check_hazards)
    assert_bytes_equal(arena.snapshot(), want)
    return plan


# --------------------------------------------------------------------------
# Deterministic cases
# --------------------------------------------------------------------------


def _single_layer(num_blocks=6, seed=0):
    rng = np.random.default_rng(seed)
    arena = Arena(rng, 1, num_blocks)
    layout = mcg.CopyLayout({0: arena.layers})
    return arena, layout


@pytest.fixture(autouse=True)
def indexed_copies(monkeypatch):
    """Every group takes the gather and scatter, and every batch the per-cluster interaction
    check, unless a test asks for the other path (copy_path)."""
    monkeypatch.setattr(mcb, "DIRECT_MAX_PAIRS", 0)
    monkeypatch.setattr(mcb, "CLUSTER_HAZARD_MIN_PAIRS", 2)
    monkeypatch.setattr(mcb, "REPLICATE_MIN_PAIRS", 1 << 30)


@pytest.fixture(params=["indexed", "direct", "replicated"])
def copy_path(request, monkeypatch):
    """Every way through the planner: gather + scatter per group after the per-cluster check;
    every hazard-free pair in the one multi-tensor copy after one check over the whole batch
    (small batches); or one plan per kind of unit, copied to the units that repeat it."""
    if request.param == "direct":
        monkeypatch.setattr(mcb, "DIRECT_MAX_PAIRS", 1 << 30)
        monkeypatch.setattr(mcb, "CLUSTER_HAZARD_MIN_PAIRS", 1 << 30)
    elif request.param == "replicated":
        monkeypatch.setattr(mcb, "REPLICATE_MIN_PAIRS", 2)
    return request.param


@pytest.fixture(params=sorted(mcb.OP_PAIRS))
def op_pair(request, monkeypatch):
    """Every gather/scatter op pair: index_select + index_put_, and the NPU's index_select + index_copy_."""
    monkeypatch.setattr(mcb, "DEVICE_OP_PAIR", {torch.device(DEVICE).type: request.param})
    return request.param


def test_same_block_conv_shift_is_a_memmove(op_pair, copy_path):
    arena, layout = _single_layer()
    rows, n = collect_all(layout, [([3, 3, 3], 0, 1, 1), ([4, 2, 2], 1, 2, 0)], 8)
    plan = run_and_check(arena, layout, rows, n)
    assert plan.grouped_pairs == n and plan.ordered.size == 0
    # the shifted pair overlaps itself: it needs the gather, never the direct copy
    assert plan.groups and (plan.direct is None or len(plan.direct[1]) < n)


def test_small_groups_are_copied_directly(monkeypatch):
    """vLLM's layout at one request a step: two pairs a storage, all in one multi-tensor copy."""
    monkeypatch.setattr(mcb, "DIRECT_MAX_PAIRS", 4)
    monkeypatch.setattr(mcb, "CLUSTER_HAZARD_MIN_PAIRS", 1024)
    arena = RawLayers(np.random.default_rng(21), 3, 8)
    layout = mcg.CopyLayout({0: arena.layers})
    rows, n = collect_all(layout, [([0, 2, 1], 0, 2, 1)], 16)  # conv 0 -> 1 shifted, temporal 2 -> 1
    plan = check_raw_layers(arena, layout, rows, n)
    assert plan.groups == [] and len(plan.direct[1]) == n == 6 and plan.grouped_pairs == n
    # three requests: six pairs a storage, gathered and scattered again
    arena = RawLayers(np.random.default_rng(22), 3, 8)
    layout = mcg.CopyLayout({0: arena.layers})
    rows, n = collect_all(layout, [([2 * r, 2 * r + 1, 2 * r + 1], 0, 1, r % 2) for r in range(3)], 32)
    plan = check_raw_layers(arena, layout, rows, n)
    assert plan.direct is None and len(plan.groups) == 3


def test_groups_per_pool_and_shift(op_pair):
    rng = np.random.default_rng(1)
    arena = Arena(rng, 3, 20)
    layout = mcg.CopyLayout({0: arena.layers})
    reqs = [([2 * r, 2 * r + 1], 0, 1, 0) for r in range(4)] + [
        ([10 + 2 * r, 11 + 2 * r, 19], 0, 1, 1) for r in range(3)
    ]
    rows, n = collect_all(layout, reqs, 64)
    plan = run_and_check(arena, layout, rows, n)
    assert plan.ordered.size == 0
    # One group per pool: the conv shifts of a pool share its row size.
    assert len(plan.groups) == 6
    assert plan.grouped_pairs == n


@pytest.mark.parametrize(
    "requests",
    [
        # duplicate destination: the later pair wins
        [([0, 1], 0, 1, 0), ([2, 1], 0, 1, 0)],
        # chain: a -> b then b -> c must move a's state to c
        [([0, 1], 0, 1, 0), ([1, 2], 0, 1, 0)],
        # the reverse chain: b -> c first reads b before a -> b writes it
        [([1, 2], 0, 1, 0), ([0, 1], 0, 1, 0)],
        # a pair's destination is another shift-group's source (overlap across groups)
        [([0, 1], 0, 1, 1), ([1, 2], 0, 1, 0)],
        # swap
        [([0, 1], 0, 1, 0), ([1, 0], 0, 1, 0)],
    ],
)
def test_interacting_pairs_fall_back_to_ordered_copies(requests, copy_path):
    arena, layout = _single_layer()
    rows, n = collect_all(layout, requests, 8)
    plan = run_and_check(arena, layout, rows, n)
    if CHECK_HAZARDS:
        assert plan.ordered.size > 0


def test_unsafe_grouping_is_detected():
    """Positive control: with the interaction check off, the oracle comparison fails."""
    arena, layout = _single_layer()
    rows, n = collect_all(layout, [([0, 1], 0, 1, 0), ([1, 2], 0, 1, 0)], 8)
    with pytest.raises(AssertionError, match="bytes differ"):
        run_and_check(arena, layout, rows, n, check_hazards=False)


def test_shared_source_stays_grouped():
    arena, layout = _single_layer(num_blocks=8)
    rows, n = collect_all(layout, [([5, 1], 0, 1, 0), ([5, 2], 0, 1, 0), ([5, 3], 0, 1, 0)], 8)
    plan = run_and_check(arena, layout, rows, n)
    assert plan.ordered.size == 0


def test_unrecognised_copy_functions_are_copied_per_pair():
    rng = np.random.default_rng(3)
    arena = Arena(rng, 2, 8)
    name, states, _ = arena.layers[1]
    arena.layers[1] = (name, states, [unrecognised_conv_spec, lying_spec])
    layout = mcg.CopyLayout({0: arena.layers})
    reqs = [([0, 1, 2], 0, 1, 1), ([3, 4, 6], 1, 2, 0)]
    rows, n = collect_all(layout, reqs, 16)
    ref = [reference_collect(arena.layers, *r) for r in reqs]
    np.testing.assert_array_equal(rows.src[:n], np.concatenate([r[0] for r in ref]))
    np.testing.assert_array_equal(rows.sizes[:n], np.concatenate([r[2] for r in ref]))
    assert not rows.groupable[2:4].any() and rows.groupable[:2].all()
    plan = run_and_check(arena, layout, rows, n)
    assert sorted(plan.ordered.tolist()) == [i for i in (2, 3, 6, 7) if rows.sizes[i] > 0]


def test_invalid_pair_raises_before_any_copy():
    arena, layout = _single_layer()
    rows, n = collect_all(layout, [([0, 1], 0, 1, 0), ([2, 3], 0, 1, 0)], 8)
    rows.src[3] = layout.pools[rows.pool[3]].base - 8  # before the pool
    before = arena.snapshot()
    pool_ids, src, dst, nbytes, groupable = rows.batch(n)
    with pytest.raises(RuntimeError, match="Invalid Mamba state copy pointer"):
        mcb.copy_rows(layout.pools, pool_ids, src, dst, nbytes, groupable)
    assert_bytes_equal(arena.snapshot(), before)


def test_out_of_range_block_id_raises_like_torch_indexing():
    arena, layout = _single_layer(num_blocks=4)
    rows = make_rows(8)
    with pytest.raises(IndexError):
        mcg.collect_request(layout, 0, [0, 9], 0, 1, 0, rows, 0)
    # negative ids wrap like state[-1]
    mcg.collect_request(layout, 0, [0, -1], 0, 1, 0, rows, 0)
    src, dst, sizes = reference_collect(arena.layers, [0, -1], 0, 1, 0)
    np.testing.assert_array_equal(rows.dst[:2], dst)


def test_layer_major_matches_the_per_layer_collector_order():
    rng = np.random.default_rng(5)
    arena = Arena(rng, 3, 10)
    layout = mcg.CopyLayout({0: arena.layers})
    rows, n = collect_all(layout, [([0, 1], 0, 1, 0), ([2, 3], 0, 1, 0)], 16)
    order, slices = mcg.layer_major(rows, n, layout.layer_names)
    assert list(slices) == ["layer.0", "layer.1", "layer.2"]
    # per layer, the pairs in collection order: request 0's two states, then request 1's
    assert order.tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    assert slices["layer.1"] == (4, 8)


# --------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------


def draw_requests(draw, num_blocks, max_requests, max_table):
    """(block table, source index, destination index, accepted-token bias) per request, over few
    distinct blocks: duplicate destinations, chains and cross-group overlaps are common."""
    blocks = st.integers(0, num_blocks - 1)
    reqs = []
    for _ in range(draw(st.integers(1, max_requests))):
        table = draw(st.lists(blocks, min_size=2, max_size=max_table))
        bias = draw(st.integers(0, len(table) - 2))
        src_idx = draw(st.integers(0, len(table) - 1 - bias))
        dest_idx = draw(st.integers(0, len(table) - 1))
        reqs.append((table, src_idx, dest_idx, bias))
    return reqs


@st.composite
def batches(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    layers = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(2, 9))
    shared = draw(st.booleans())
    reqs = draw_requests(draw, num_blocks, max_requests=6, max_table=5)
    return seed, layers, num_blocks, shared, reqs


@FUZZ
@given(batches())
def test_vectorised_collection_equals_per_pair_collector(batch):
    seed, layers, num_blocks, shared, reqs = batch
    arena = Arena(np.random.default_rng(seed), layers, num_blocks, shared)
    layout = mcg.CopyLayout({0: arena.layers})
    rows, n = collect_all(layout, reqs, 2 * layers * len(reqs))
    ref = [reference_collect(arena.layers, *r) for r in reqs]
    np.testing.assert_array_equal(rows.src[:n], np.concatenate([r[0] for r in ref]))
    np.testing.assert_array_equal(rows.dst[:n], np.concatenate([r[1] for r in ref]))
    np.testing.assert_array_equal(rows.sizes[:n], np.concatenate([r[2] for r in ref]))


@FUZZ
@given(batches())
def test_grouped_copy_equals_memmove_oracle(copy_path, batch):
    seed, layers, num_blocks, shared, reqs = batch
    arena = Arena(np.random.default_rng(seed), layers, num_blocks, shared)
    layout = mcg.CopyLayout({0: arena.layers})
    rows, n = collect_all(layout, reqs, 2 * layers * len(reqs))
    run_and_check(arena, layout, rows, n)


@st.composite
def raw_pairs(draw):
    """Arbitrary byte copies inside the pools: any block, offset and size, crossing rows too."""
    seed = draw(st.integers(0, 2**32 - 1))
    num_blocks = draw(st.integers(1, 6))
    layers = draw(st.integers(1, 3))
    n = draw(st.integers(1, 24))
    picks = draw(
        st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)), min_size=n, max_size=n)
    )
    return seed, num_blocks, layers, picks


@FUZZ
@given(raw_pairs())
def test_planner_on_raw_pairs_equals_memmove_oracle(copy_path, case):
    seed, num_blocks, layers, picks = case
    rng = np.random.default_rng(seed)
    arena = Arena(rng, layers, num_blocks)
    layout = mcg.CopyLayout({0: arena.layers})
    pools = layout.pools
    pool_ids, src, dst, nbytes = [], [], [], []
    for a, b, c in picks:
        pid = a % len(pools)
        pool = pools[pid]
        es = pool.esize
        span = pool.nbytes // es
        count = c % (span + 1)
        # offsets in whole elements, mostly block-aligned so that groups form
        if a % 3:
            s_el = (b % pool.num_blocks) * (pool.stride // es)
            d_el = ((b // 7) % pool.num_blocks) * (pool.stride // es) + (a // 5) % 2
        else:
            s_el, d_el = b % (span + 1), (b // 3) % (span + 1)
        count = min(count % (pool.stride // es + 2), span - s_el, span - d_el)
        pool_ids.append(pid)
        src.append(pool.base + s_el * es)
        dst.append(pool.base + d_el * es)
        nbytes.append(max(count, 0) * es)
    pool_ids, src, dst, nbytes = (np.array(x, np.int64) for x in (pool_ids, src, dst, nbytes))
    before = arena.snapshot()
    want = oracle(before, arena.addr0(), src, dst, nbytes)
    mcb.copy_rows(pools, pool_ids, src, dst, nbytes, check_hazards=CHECK_HAZARDS)
    assert_bytes_equal(arena.snapshot(), want)


@st.composite
def multi_arena_batches(draw):
    """Layers in separate allocations (one cluster each), often with the same relative layout."""
    seed = draw(st.integers(0, 2**32 - 1))
    arenas = draw(st.integers(2, 4))
    same_layout = draw(st.booleans())
    num_blocks = draw(st.integers(2, 7))
    shared = draw(st.booleans())
    reqs = draw_requests(draw, num_blocks, max_requests=5, max_table=4)
    return seed, arenas, same_layout, num_blocks, shared, reqs


@FUZZ
@given(multi_arena_batches())
def test_clusters_checked_once_per_relative_layout_equal_memmove_oracle(copy_path, case):
    """Pools in separate allocations: hazards are found per cluster (and once per relative layout)."""
    seed, count, same_layout, num_blocks, shared, reqs = case
    arenas = [
        Arena(np.random.default_rng(seed if same_layout else seed + i), 1, num_blocks, shared) for i in range(count)
    ]
    layout = mcg.CopyLayout({0: [layer for arena in arenas for layer in arena.layers]})
    rows, n = collect_all(layout, reqs, 2 * count * len(reqs))
    pool_ids, src, dst, nbytes, groupable = rows.batch(n)
    wants = []
    for arena in arenas:
        lo, hi = arena.addr0(), arena.addr0() + arena.nbytes
        mine = (dst >= lo) & (dst < hi)
        wants.append(oracle(arena.snapshot(), lo, src[mine], dst[mine], nbytes[mine]))
    mcb.copy_rows(layout.pools, pool_ids, src, dst, nbytes, groupable, check_hazards=CHECK_HAZARDS)
    for arena, want in zip(arenas, wants):
        assert_bytes_equal(arena.snapshot(), want)


# --------------------------------------------------------------------------
# Shared storages: vLLM's layout (conv and temporal views of one raw tensor)
# --------------------------------------------------------------------------


class RawLayers:
    """One raw byte tensor per KV-cache tensor, each layer's states viewed into it with a page stride.

    The layout of vllm-ascend's ``_reshape_kv_cache_tensors`` / ``_adjust_kv_layout`` for
    hybrid models: per block one page of [conv state][temporal state][padding]; ``per_raw``
    layers share one raw tensor (one page region after the other).
    """

    def __init__(self, rng, layers, num_blocks, per_raw=1, conv=(3, 128), temporal=(2, 64), pad=256, dtypes=None):
        self.raws, self.layers = [], []
        for first in range(0, layers, per_raw):
            count = min(per_raw, layers - first)
            parts = []
            for _ in range(count):
                conv_dtype = DTYPES[int(rng.integers(len(DTYPES)))]
                temp_dtype = DTYPES[int(rng.integers(len(DTYPES) - 1))]  # 16/32-bit temporal states
                if dtypes is not None:
                    conv_dtype, temp_dtype = dtypes
                conv_bytes = conv[0] * conv[1] * 2  # conv[1] counts 2-byte units whatever the dtype
                temp_bytes = temporal[0] * temporal[1] * 4
                parts.append((conv_dtype, temp_dtype, conv_bytes, temp_bytes, conv_bytes + temp_bytes + pad))
            size = sum(p[4] for p in parts) * num_blocks + 64
            raw = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)).to(DEVICE)
            self.raws.append(raw)
            off = 0
            for i, (conv_dtype, temp_dtype, conv_bytes, temp_bytes, page) in enumerate(parts):
                ce, te = _esize(conv_dtype), _esize(temp_dtype)
                states = [
                    raw.view(conv_dtype).as_strided(
                        (num_blocks, conv[0], conv_bytes // conv[0] // ce),
                        (page // ce, conv_bytes // conv[0] // ce, 1),
                        off // ce,
                    ),
                    raw.view(temp_dtype).as_strided(
                        (num_blocks, temporal[0], temp_bytes // temporal[0] // te),
                        (page // te, temp_bytes // temporal[0] // te, 1),
                        (off + conv_bytes) // te,
                    ),
                ]
                self.layers.append((f"layer.{first + i}", states, [get_conv_copy_spec, get_temporal_copy_spec]))
                off += page * num_blocks

    def snapshots(self):
        return [raw.cpu().numpy().copy() for raw in self.raws]


def check_raw_layers(arena, layout, rows, n, min_row=mcb.MIN_STORAGE_ROW_BYTES, check_hazards=CHECK_HAZARDS):
    pool_ids, src, dst, nbytes, groupable = rows.batch(n)
    wants = []
    for raw, snap in zip(arena.raws, arena.snapshots()):
        lo, hi = raw.data_ptr(), raw.data_ptr() + raw.numel()
        mine = (dst >= lo) & (dst < hi)
        wants.append(oracle(snap, lo, src[mine], dst[mine], nbytes[mine]))
    saved = mcb.MIN_STORAGE_ROW_BYTES
    mcb.MIN_STORAGE_ROW_BYTES = min_row
    try:
        plan = mcb.copy_rows(layout.pools, pool_ids, src, dst, nbytes, groupable, check_hazards=check_hazards)
    finally:
        mcb.MIN_STORAGE_ROW_BYTES = saved
    for got, want in zip(arena.snapshots(), wants):
        assert_bytes_equal(got, want)
    return plan


def test_one_group_per_shared_storage(op_pair):
    rng = np.random.default_rng(11)
    arena = RawLayers(rng, 3, 12)
    layout = mcg.CopyLayout({0: arena.layers})
    reqs = [([2 * r, 2 * r + 1, 2 * r + 1], 0, 1, r % 2) for r in range(5)]
    rows, n = collect_all(layout, reqs, 64)
    plan = check_raw_layers(arena, layout, rows, n)
    assert plan.ordered.size == 0 and plan.grouped_pairs == n
    # conv and temporal pairs of a layer: one group on its raw tensor, rows of 256 bytes
    assert len(plan.groups) == 3
    assert {g[0] for g in plan.groups} == set(range(len(layout.pools), len(layout.pools) + 3))
    assert {g[1] for g in plan.groups} == {256}


def test_repeated_units_are_planned_once(monkeypatch):
    """vLLM's layout: every layer's storage sees the same pairs, so one of them is planned."""
    monkeypatch.setattr(mcb, "REPLICATE_MIN_PAIRS", 2)
    planned = []
    plan_pairs = mcb._plan_pairs
    monkeypatch.setattr(
        mcb, "_plan_pairs", lambda arrays, batch, *a: planned.append(len(batch[3])) or plan_pairs(arrays, batch, *a)
    )
    arena = RawLayers(np.random.default_rng(23), 4, 20, dtypes=(torch.bfloat16, torch.float32))
    layout = mcg.CopyLayout({0: arena.layers})
    # six independent requests, then a chain (block 14 -> 15 -> 16) that must run in order
    reqs = [([2 * r, 2 * r + 1, 2 * r + 1], 0, 1, r % 2) for r in range(6)]
    reqs += [([14, 15], 0, 1, 0), ([15, 16], 0, 1, 0)]
    rows, n = collect_all(layout, reqs, 64)
    plan = check_raw_layers(arena, layout, rows, n)
    assert planned == [n // 4]
    assert len(plan.groups) == 4 and {g[0] for g in plan.groups} == set(range(8, 12))
    assert plan.ordered.size == 4 * 4  # both states of both chain pairs, in every layer


class MambaOnlyLayers(RawLayers):
    """A Mamba-only model's layout: one raw byte tensor a layer, all conv states, then all temporal states."""

    def __init__(self, layers, num_blocks, conv_bytes=3 * 256, temp_bytes=2 * 512):
        self.raws, self.layers = [], []
        for li in range(layers):
            raw = torch.from_numpy(
                np.random.default_rng(li).integers(0, 256, num_blocks * (conv_bytes + temp_bytes), dtype=np.uint8)
            ).to(DEVICE)
            conv = raw[: num_blocks * conv_bytes].view(torch.bfloat16).view(num_blocks, 3, conv_bytes // 6)
            temporal = raw[num_blocks * conv_bytes :].view(torch.float32).view(num_blocks, 2, temp_bytes // 8)
            self.raws.append(raw)
            self.layers.append((f"layer.{li}", [conv, temporal], [get_conv_copy_spec, get_temporal_copy_spec]))


def test_mamba_only_layout_is_planned_once(monkeypatch):
    monkeypatch.setattr(mcb, "REPLICATE_MIN_PAIRS", 2)
    arena = MambaOnlyLayers(3, 6)
    layout = mcg.CopyLayout({0: arena.layers})
    arrays = layout.pools.arrays()
    # a layer's pools run to the end of its raw tensor: one cluster a layer, all of one geometry
    assert len(arrays.cluster_base) == 3 and len(set(arrays.cluster_kind.tolist())) == 1
    rows, n = collect_all(layout, [([0, 1, 1], 0, 1, 1), ([2, 3], 0, 1, 0), ([3, 4], 0, 1, 0)], 32)
    check_raw_layers(arena, layout, rows, n)


def test_short_storage_rows_keep_per_pool_groups():
    rng = np.random.default_rng(12)
    arena = RawLayers(rng, 2, 8, conv=(3, 24), temporal=(2, 8), pad=16)  # rows of 16 bytes at most
    layout = mcg.CopyLayout({0: arena.layers})
    rows, n = collect_all(layout, [([0, 1, 1], 0, 1, 1), ([2, 3, 3], 0, 1, 0)], 16)
    plan = check_raw_layers(arena, layout, rows, n)
    assert len(plan.groups) == 4 and all(g[0] < len(layout.pools) for g in plan.groups)


@pytest.mark.parametrize(
    "requests",
    [
        # duplicate destination across requests: the later pair wins
        [([0, 1, 1], 0, 1, 0), ([2, 1, 1], 0, 1, 1)],
        # chain through one raw tensor: a -> b, then b -> c
        [([0, 1, 1], 0, 1, 1), ([1, 2, 2], 0, 1, 0)],
        # swap
        [([0, 1, 1], 0, 1, 0), ([1, 0, 0], 0, 1, 0)],
    ],
)
def test_interacting_pairs_in_a_shared_storage(requests, copy_path):
    arena = RawLayers(np.random.default_rng(13), 2, 4, per_raw=2)
    layout = mcg.CopyLayout({0: arena.layers})
    rows, n = collect_all(layout, requests, 16)
    plan = check_raw_layers(arena, layout, rows, n)
    if CHECK_HAZARDS:
        assert plan.ordered.size > 0


def test_cross_state_overlap_falls_back():
    """A conv pair writing into the temporal state of its page (one raw tensor), then a copy reading it."""
    arena = RawLayers(np.random.default_rng(14), 1, 6)
    layout = mcg.CopyLayout({0: arena.layers})
    conv, temporal = layout.pools
    t1 = temporal.base + temporal.stride  # temporal state of block 1
    # pair 0 (conv pool) writes the last 256 B of conv[1] and the first 768 B of temporal[1];
    # pair 1 then copies temporal[1] to temporal[3]; pair 2 is disjoint from both.
    pool_ids = np.array([0, 1, 1], np.int64)
    src = np.array([conv.base, t1, t1 + 3 * temporal.stride], np.int64)
    dst = np.array([t1 - 256, t1 + 2 * temporal.stride, t1 + 4 * temporal.stride], np.int64)
    nbytes = np.array([1024, 512, 512], np.int64)
    rows = make_rows(3)
    rows.pool[:3], rows.src[:3], rows.dst[:3], rows.sizes[:3] = pool_ids, src, dst, nbytes
    rows.groupable[:3] = True
    plan = check_raw_layers(arena, layout, rows, 3)
    if CHECK_HAZARDS:
        assert sorted(plan.ordered.tolist()) == [0, 1]


@st.composite
def raw_layer_batches(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    layers = draw(st.integers(1, 4))
    per_raw = draw(st.integers(1, 3))
    num_blocks = draw(st.integers(2, 7))
    conv = (draw(st.integers(2, 4)), draw(st.sampled_from([8, 64, 128, 384])))
    temporal = (draw(st.integers(1, 3)), draw(st.sampled_from([4, 64, 128])))
    pad = draw(st.sampled_from([0, 16, 256, 768]))
    min_row = draw(st.sampled_from([1, 64, mcb.MIN_STORAGE_ROW_BYTES]))
    # one dtype pair for every layer: their storages repeat each other (the replicated plan)
    dtypes = draw(st.sampled_from([None, (torch.bfloat16, torch.float32), (torch.int8, torch.float16)]))
    reqs = draw_requests(draw, num_blocks, max_requests=6, max_table=5)
    return seed, layers, per_raw, num_blocks, conv, temporal, pad, min_row, dtypes, reqs


@FUZZ
@given(raw_layer_batches())
def test_shared_storage_groups_equal_memmove_oracle(copy_path, case):
    seed, layers, per_raw, num_blocks, conv, temporal, pad, min_row, dtypes, reqs = case
    arena = RawLayers(np.random.default_rng(seed), layers, num_blocks, per_raw, conv, temporal, pad, dtypes)
    layout = mcg.CopyLayout({0: arena.layers})
    rows, n = collect_all(layout, reqs, 2 * layers * len(reqs))
    check_raw_layers(arena, layout, rows, n, min_row)


@FUZZ
@given(raw_pairs(), st.sampled_from([1, 8, mcb.MIN_STORAGE_ROW_BYTES]))
def test_raw_pairs_grouped_per_storage_equal_memmove_oracle(copy_path, case, min_row):
    """Arbitrary copies over pools of one buffer (crossing states and pages), grouped per storage."""
    seed, num_blocks, layers, picks = case
    arena = Arena(np.random.default_rng(seed), layers, num_blocks)
    layout = mcg.CopyLayout({0: arena.layers})
    pools = layout.pools
    rows = make_rows(len(picks))
    for i, (a, b, c) in enumerate(picks):
        pool = pools[a % len(pools)]
        es, span = pool.esize, pool.nbytes // pool.esize
        s_el, d_el = b % (span + 1), (b // 3 + a) % (span + 1)
        count = min(c % (span + 1), span - s_el, span - d_el)
        rows.pool[i], rows.src[i], rows.dst[i], rows.sizes[i] = (
            a % len(pools),
            pool.base + s_el * es,
            pool.base + d_el * es,
            count * es,
        )
    rows.groupable[:] = True
    pool_ids, src, dst, nbytes, groupable = rows.batch(len(picks))
    want = oracle(arena.snapshot(), arena.addr0(), src, dst, nbytes)
    saved, mcb.MIN_STORAGE_ROW_BYTES = mcb.MIN_STORAGE_ROW_BYTES, min_row
    try:
        mcb.copy_rows(pools, pool_ids, src, dst, nbytes, groupable, check_hazards=CHECK_HAZARDS)
    finally:
        mcb.MIN_STORAGE_ROW_BYTES = saved
    assert_bytes_equal(arena.snapshot(), want)
