# SPDX-License-Identifier: Apache-2.0
"""Grouped Mamba state copies (``mamba_copy_groups``) against a numpy memmove oracle.

Each step is a batch of requests (block table, source index, destination index,
accepted-token bias) recorded as the collector records them and copied whole
batch or layer by layer. The oracle applies, in pair order (request, KV-cache
group, layer, state), a memmove of the byte ranges vLLM's own copy functions
describe, to a snapshot of every storage; the bytes must be equal. Hypothesis
draws the layout (vllm-ascend's raw KV-cache tensor per layer, one allocation
for all layers with the KV-cache groups' layers aliased, separate pools,
conv-only and temporal-only models, odd row sizes with storages whose length
is not a multiple of the row), one or two KV-cache groups, shifts, shared
blocks, duplicate destinations and chains, and each case runs on both copy
strategies (direct multi-tensor copies, whose every call must be free of
interactions between its pairs, and row-index chunks, down to one row a chunk).

Runs on CPU under tests/ut, and on a CUDA GPU where there is one.
"""

import contextlib
import os
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec

from vllm_ascend.worker import mamba_copy_groups

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings.get_profile(os.environ.get("VLLM_ASCEND_FUZZ_PROFILE", "ci"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # tests/ut stubs torch_npu: its npu is no device
CONV, TEMPORAL = get_conv_copy_spec, get_temporal_copy_spec
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# layout: (copy functions, raw tensors ("layer": one per layer, "backing": one for all), conv (width, dim),
# temporal shape, state dtypes, tail bytes)
LAYOUTS = {
    "raw": ((CONV, TEMPORAL), "layer", (4, 8), (2, 3, 8), (BF16, F32), 0),
    "backing": ((CONV, TEMPORAL), "backing", (4, 8), (2, 3, 8), (BF16, F32), 5),
    "separate": ((CONV, TEMPORAL), None, (4, 8), (2, 3, 8), (BF16, F32), 0),
    "conv_only": ((CONV,), "layer", (3, 16), None, (BF16,), 0),
    "temporal_only": ((TEMPORAL,), None, None, (4, 6), (F32,), 0),
    "odd": ((CONV, TEMPORAL), "layer", (3, 5), (7,), (F16, F16), 7),  # 10-byte rows, a 7-byte tail
}


STRATEGIES = ["direct", "indexed", "one_row_chunks"]


def _byte_ranges(t):
    """The byte ranges of a view: one per row of a (layers, elements) view."""
    return [(r.data_ptr(), r.data_ptr() + r.nbytes) for r in (t if t.dim() > 1 else [t])]


def assert_independent(dsts, srcs):
    """The pairs of one multi-tensor copy run in no order: none may write bytes another pair touches, or its source."""
    for i, dst in enumerate(dsts):
        others = [
            r for j, pair in enumerate(zip(dsts, srcs)) for t in (pair if j != i else pair[1:]) for r in _byte_ranges(t)
        ]
        bad = [(a, b) for lo, hi in _byte_ranges(dst) for a, b in others if lo < b and a < hi]
        assert not bad, f"pair {i} of a multi-tensor copy writes bytes that {len(bad)} other range(s) touch"


@contextlib.contextmanager
def strategy(name):
    """Force a copy strategy, and check that the step took it (and only it)."""
    ran = {"direct": 0, "indexed": 0}
    with pytest.MonkeyPatch.context() as mp:
        for path in ran:
            copy_path = getattr(mamba_copy_groups, f"_copy_{path}")
            mp.setattr(mamba_copy_groups, f"_copy_{path}", _counted(ran, path, copy_path))
        if name == "direct":
            foreach_copy = torch._foreach_copy_
            mp.setattr(mamba_copy_groups, "DIRECT_PAIRS_PER_FAMILY", 10**9)
            mp.setattr(
                torch, "_foreach_copy_", lambda dsts, srcs: assert_independent(dsts, srcs) or foreach_copy(dsts, srcs)
            )
        else:
            # -1: indexed even when every move interacts (pair by pair) and no range is grouped
            mp.setattr(mamba_copy_groups, "DIRECT_PAIRS_PER_FAMILY", -1)
            if name == "one_row_chunks":
                mp.setattr(mamba_copy_groups, "GATHER_BYTES", 1)
        yield
    took = "direct" if name == "direct" else "indexed"
    assert ran[took] > 0 and sum(ran.values()) == ran[took], f"{name} ran the paths {ran}"


def _counted(ran, path, copy_path):
    def counted(*args):
        ran[path] += 1
        return copy_path(*args)

    return counted


class Model:
    """Mamba layers over their own storages, with the layer tuples the collector passes to ``record``."""

    def __init__(self, layout, num_layers=3, num_blocks=10, groups=1, seed=0, pad=6):
        funcs, raw, conv, temporal, dtypes, tail = LAYOUTS.get(layout, layout)
        shapes = [conv if f is CONV else temporal for f in funcs]
        block_bytes = [int(np.prod(s)) * d.itemsize for s, d in zip(shapes, dtypes)]
        gen = torch.Generator().manual_seed(seed)
        self.storages, self.layers = [], []

        def random_bytes(n):
            buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(DEVICE)
            self.storages.append(buf)
            return buf

        page = sum(block_bytes) + pad
        page += -page % max(d.itemsize for d in dtypes)
        if raw == "backing":  # vllm-ascend 0.30: layer j of every group in region j of one allocation
            backing = random_bytes(-(-num_layers // groups) * num_blocks * page + tail)
        for i in range(num_layers):
            states = []
            if raw:  # pages of [state 0 | state 1 | pad]
                if raw == "backing":
                    buf = backing[i // groups * num_blocks * page :][: num_blocks * page]
                else:
                    buf = random_bytes(num_blocks * page + tail)[: num_blocks * page]
                offset = 0
                for shape, nbytes, dtype in zip(shapes, block_bytes, dtypes):
                    strides = [page // dtype.itemsize] + [int(np.prod(shape[k + 1 :])) for k in range(len(shape))]
                    start = (buf.storage_offset() + offset) // dtype.itemsize
                    states.append(buf.view(dtype).as_strided((num_blocks, *shape), strides, start))
                    offset += nbytes
            else:
                for shape, nbytes, dtype in zip(shapes, block_bytes, dtypes):
                    states.append(random_bytes(num_blocks * nbytes).view(dtype).view(num_blocks, *shape))
            self.layers.append((f"model.layers.{i}.mixer", i % groups, states, funcs))
        self.groups = groups
        self.bufs = SimpleNamespace(_layer_copy_metadata={})

    def snapshot(self):
        return [_bytes(s).cpu().numpy().copy() for s in self.storages]

    def oracle_pairs(self, table, src_idx, dest_idx, bias, group):
        """(storage, src offset, dst offset, bytes) of one request's pairs, by vLLM's copy functions."""
        out = []
        for _, grp, states, funcs in self.layers:
            for state, func in zip(states, funcs) if grp == group else ():
                spec = func(state, table, src_idx, bias + 1)
                k, base = next((k, _bytes(s).data_ptr()) for k, s in enumerate(self.storages) if _same(s, state))
                dst = state[table[dest_idx]].data_ptr()
                out.append((k, spec.start_addr - base, dst - base, spec.num_elements * state.element_size()))
        return out

    def run(self, requests, layerwise):
        """Record the requests (as the collector does), copy; returns the oracle's bytes."""
        want = self.snapshot()
        for tables, src_idx, dest_idx, bias in requests:
            req = SimpleNamespace(block_ids=tables)
            groups = list(range(self.groups))
            assert mamba_copy_groups.record(self.bufs, lambda: self.layers, groups, src_idx, dest_idx, bias, req)
            for g in groups:
                for k, s, d, n in self.oracle_pairs(tables[g], src_idx, dest_idx, bias, g):
                    want[k][d : d + n] = want[k][s : s + n].copy()
        if layerwise:
            for name, *_ in self.layers:
                assert self.bufs._layer_copy_metadata.pop(name) is not None
                mamba_copy_groups.copy(self.bufs, name)
            self.bufs._mamba_copy_requests = []
        else:
            mamba_copy_groups.copy(self.bufs)
        return want


def _bytes(t):
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _same(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def assert_equal(model, want):
    for k, (got, exp) in enumerate(zip(model.snapshot(), want)):
        bad = np.flatnonzero(got != exp)
        assert bad.size == 0, f"storage {k}: {bad.size} bytes differ, first at {bad[:8].tolist()}"


@st.composite
def steps(draw):
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    groups = draw(st.sampled_from([1, 2]))
    num_blocks = draw(st.integers(4, 10))
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 5))
        src_idx = draw(st.integers(0, length - 1))
        bias = draw(st.integers(0, min(length - 1 - src_idx, 2 if layout != "temporal_only" else 3)))
        dest_idx = draw(st.integers(0, length - 1))
        if src_idx == dest_idx and bias == 0:
            continue
        # Where groups alias one allocation, vLLM's block pool gives each block to one group at a time.
        aliased = groups if layout == "backing" else 1
        ids = st.lists(st.integers(0, num_blocks // aliased - 1), min_size=length, max_size=length)
        tables = [[b * aliased + g % aliased for b in draw(ids)] for g in range(groups)]
        requests.append((tables, src_idx, dest_idx, bias))
    assume(requests)
    return layout, groups, num_blocks, requests, draw(st.booleans()), draw(st.sampled_from(STRATEGIES))


@FUZZ
@given(steps())
def test_grouped_copies_equal_pair_order_memmove(case):
    layout, groups, num_blocks, requests, layerwise, how = case
    model = Model(layout, num_blocks=num_blocks, groups=groups)
    with strategy(how):
        want = model.run(requests, layerwise)
    assert_equal(model, want)


@pytest.mark.parametrize("how", STRATEGIES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize(
    "requests",
    [
        [([[2, 5, 5]], 1, 2, 1)],  # same-block conv shift (dst < src < dst + size)
        [([[2, 5, 6]], 1, 2, 1), ([[3, 5, 7]], 1, 2, 1)],  # two requests read one shared block
        [([[1, 4, 6]], 0, 2, 1), ([[2, 3, 4]], 1, 2, 0)],  # a chain: 1 -> 6 ... 3 -> 4, 4 read first
        [([[4, 5, 6]], 1, 2, 0), ([[3, 4, 5]], 1, 2, 0)],  # a chain through block 5: 5 -> 6, then 4 -> 5
        [([[1, 2, 5]], 0, 2, 1), ([[5, 6, 7]], 0, 2, 1)],  # a chain: 1, 2 -> 5, then 5 (just written), 6 -> 7
        [([[1, 2, 7]], 0, 2, 1), ([[3, 4, 7]], 0, 2, 1)],  # one destination twice: the later pair wins
        [([[1, 2, 7]], 0, 2, 1), ([[3, 7, 7]], 0, 2, 1), ([[4, 8, 9]], 1, 2, 0)],  # mixed
    ],
)
def test_shifts_shared_blocks_chains_and_duplicate_destinations(layout, layerwise, requests, how):
    model = Model(layout)
    with strategy(how):
        want = model.run(requests, layerwise)
    assert_equal(model, want)


class Temporaries(TorchDispatchMode):
    """The device memory that the ops allocate: the most alive at once (bytes), and what is alive now."""

    def __init__(self, device, kept):
        super().__init__()
        self.device, self.kept, self.alive, self.peak = device, kept, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.alive = {ptr: (n, refs) for ptr, (n, refs) in self.alive.items() if any(r() is not None for r in refs)}
        for t in tree_leaves(out):
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            # anything but the KV cache is a temporary
            if storage is not None and t.device.type == self.device and storage.data_ptr() not in self.kept:
                self.alive.setdefault(storage.data_ptr(), (storage.nbytes(), []))[1].append(weakref.ref(t))
        self.peak = max(self.peak, self.bytes())
        return out

    def bytes(self):
        return sum(n for n, refs in self.alive.values() if any(r() is not None for r in refs))


# Conv states of 128-byte rows (no padding in a page), so that a step's row indices (16 bytes a row) are a
# small part of its temporaries, as in real models.
WIDE = {
    "raw": ((CONV,), "layer", (4, 64), None, (BF16,), 0),
    "backing": ((CONV,), "backing", (4, 64), None, (BF16,), 5),
}


@pytest.mark.parametrize("layout", sorted(WIDE))
@pytest.mark.parametrize("direct_pairs_per_family", [0, 10**9])
def test_temporaries_stay_under_the_cap_on_both_paths_and_none_outlives_its_step(
    monkeypatch, direct_pairs_per_family, layout
):
    """Every temporary of a step (staging, gather buffer, row indices) together stays under GATHER_BYTES
    (without the cap they are larger), and none outlives its step."""
    monkeypatch.setattr(mamba_copy_groups, "DIRECT_PAIRS_PER_FAMILY", direct_pairs_per_family)
    # 8 requests, each a conv shift inside its block (staged on the direct path), then 8 into new blocks
    requests = [([[b, b, b + 8]], 0, 0, 1) for b in range(8)] + [([[b, b + 8, b + 8]], 0, 1, 1) for b in range(8)]
    # Below the 3 KiB a layer (raw) or 9 KiB a family of 3 layers (backing) that a step moves, at least twice
    # the row indices (16 bytes of 128-byte rows, and one more layer's while they are built).
    cap = {"raw": 2048, "backing": 4096}[layout]
    for gather_bytes in (10**9, cap):
        monkeypatch.setattr(mamba_copy_groups, "GATHER_BYTES", gather_bytes)
        model = Model(WIDE[layout], num_blocks=16, pad=0)
        kept = {s.untyped_storage().data_ptr() for s in model.storages}
        peaks = []
        for step, layerwise in zip((requests[:8], requests[8:]), (False, True)):
            with Temporaries(torch.device(DEVICE).type, kept) as temporaries:
                want = model.run(step, layerwise)
                assert temporaries.bytes() == 0, "a temporary outlived its step"
            assert_equal(model, want)
            peaks.append(temporaries.peak)
        assert max(peaks) <= cap if gather_bytes == cap else max(peaks) > cap, peaks


def test_unknown_copy_functions_are_left_to_the_per_pair_collector():
    def other_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
        return get_temporal_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens)

    model = Model("separate")
    name, group, states, _ = model.layers[0]
    model.layers[0] = (name, group, states, (CONV, other_spec))
    req = SimpleNamespace(block_ids=[[1, 2, 3]])
    assert not mamba_copy_groups.record(model.bufs, lambda: model.layers, [0], 0, 1, 0, req)
    assert not mamba_copy_groups.copy(model.bufs)


def test_a_block_outside_the_storage_raises_before_any_copy():
    model = Model("raw")
    before = model.snapshot()
    req = SimpleNamespace(block_ids=[[1, 2, 99]])
    assert mamba_copy_groups.record(model.bufs, lambda: model.layers, [0], 0, 2, 1, req)
    with pytest.raises(IndexError, match="outside the 10 KV-cache blocks"):
        mamba_copy_groups.copy(model.bufs)
    assert_equal(model, before)


def test_row_indices_over_half_the_cap_get_half_the_cap_beside_them(monkeypatch):
    """The cap's exception: indices that need more than half of GATHER_BYTES are kept whole, and the gather
    buffer gets half the cap, so the temporaries stay under the indices plus half the cap."""
    monkeypatch.setattr(mamba_copy_groups, "DIRECT_PAIRS_PER_FAMILY", 0)
    cap = 512
    monkeypatch.setattr(mamba_copy_groups, "GATHER_BYTES", cap)
    model = Model(WIDE["raw"], num_blocks=16, pad=0)
    # 8 moves of a conv state shifted by one token: 3 of its 4 128-byte rows each, in one layer a family
    requests = [([[b, b + 8, b + 8]], 0, 1, 1) for b in range(8)]
    # 16 bytes (int64 source, destination) a row, for every layer (one) and the uploaded layer
    indices = 16 * 8 * 3 * 2
    assert indices > cap // 2
    kept = {s.untyped_storage().data_ptr() for s in model.storages}
    with Temporaries(torch.device(DEVICE).type, kept) as temporaries:
        want = model.run(requests, layerwise=False)
    assert_equal(model, want)
    assert cap < temporaries.peak <= indices + cap // 2, temporaries.peak


def test_the_dim_first_conv_layout_is_left_to_the_per_pair_collector(monkeypatch):
    """vLLM's dim-first conv state layout does not shift by token rows: not a layout known here."""
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: True, raising=False)
    model = Model("raw")
    req = SimpleNamespace(block_ids=[[1, 2, 3]])
    assert not mamba_copy_groups.record(model.bufs, lambda: model.layers, [0], 0, 2, 1, req)
    assert not mamba_copy_groups.copy(model.bufs)


def test_a_negative_shift_raises_instead_of_mixing_a_step():
    """Declining one request of a step would copy it per pair after the grouped ones, out of pair order."""
    model = Model("raw")
    first = SimpleNamespace(block_ids=[[1, 2, 3]])
    assert mamba_copy_groups.record(model.bufs, lambda: model.layers, [0], 0, 2, 1, first)
    second = SimpleNamespace(block_ids=[[4, 5, 6]])
    with pytest.raises(ValueError, match="negative shift"):
        mamba_copy_groups.record(model.bufs, lambda: model.layers, [0], 1, 2, -1, second)


def test_kv_cache_re_strided_at_the_same_addresses_is_found_again():
    """A step after the KV cache is viewed anew (same first bytes and shapes, another block stride)
    copies by the new layout."""
    model = Model("raw")
    assert_equal(model, model.run([([[1, 2, 3]], 0, 2, 1)], layerwise=False))
    for i, (name, group, states, funcs) in enumerate(model.layers):
        # pages without their padding: each state at the same address, blocks closer together
        page = sum(s[0].numel() * s.element_size() for s in states)
        restrided = [s.as_strided(s.shape, (page // s.element_size(), *s.stride()[1:])) for s in states]
        model.layers[i] = (name, group, restrided, funcs)
    assert_equal(model, model.run([([[4, 5, 6]], 0, 2, 1)], layerwise=False))


def test_an_unfinished_layerwise_step_frees_its_temporaries_at_the_next_step():
    """A layerwise step whose last layers are never copied keeps its plan only until the next step."""
    model = Model(WIDE["raw"], num_blocks=16, pad=0)
    kept = {s.untyped_storage().data_ptr() for s in model.storages}
    with Temporaries(torch.device(DEVICE).type, kept) as temporaries:
        for b in range(8):
            req = SimpleNamespace(block_ids=[[b, b + 8, b + 8]])
            assert mamba_copy_groups.record(model.bufs, lambda: model.layers, [0], 0, 1, 1, req)
        mamba_copy_groups.copy(model.bufs, model.layers[0][0])  # the other layers never come
        assert temporaries.bytes() > 0
        model.bufs._mamba_copy_requests = []  # what the next step's reset does
        req = SimpleNamespace(block_ids=[[1, 2, 3]])
        assert mamba_copy_groups.record(model.bufs, lambda: model.layers, [0], 0, 2, 1, req)
        assert temporaries.bytes() == 0
