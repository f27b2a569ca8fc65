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
"""CPU tests of the overlap-safe Mamba state copy path (vllm_ascend.worker.mamba_state_copy).

vLLM's real ``mamba_utils`` entry points are driven as ``patch_mamba_utils`` binds
them, over Mamba-like state pools carved out of one poisoned byte buffer, and the
result is compared byte for byte with a numpy memmove oracle applied in pair
order. Real Triton cannot run under tests/ut (its conftest mocks
``triton.runtime``), so pointer backends get a host kernel that behaves like one
unordered launch (``ParallelLaunchKernel``).

Hypothesis budget: ``VLLM_ASCEND_FUZZ_PROFILE=ci`` (default, fixed and
derandomized) or ``long`` for manual runs.
"""

import contextlib
import ctypes
import importlib
import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker import mamba_utils

import vllm_ascend.envs as envs_ascend
import vllm_ascend.patch.worker.patch_mamba_utils as patch_mamba_utils
from tests.ut.worker.mamba_copy_testing import restored_bindings
from vllm_ascend.worker import mamba_state_copy as msc

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings.get_profile(os.environ.get("VLLM_ASCEND_FUZZ_PROFILE", "ci"))

COPY_FUNCS = (get_conv_copy_spec, get_temporal_copy_spec)
GUARD = 64


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def bound(backend, kernel=None):
    """Bind the fork's copy path on the NPU path with ``backend`` (and a host kernel)."""
    with restored_bindings():
        msc.bind_mamba_state_copy(
            mamba_utils, on_310p=False, pointer_kernels={"triton": kernel or _forbidden_kernel}, backend=backend
        )
        yield


def _forbidden_kernel(*args):
    raise AssertionError("the pointer kernel must not run on this path")


class ParallelLaunchKernel:
    """Host stand-in for one launch of a pointer kernel (programs unordered).

    Each program is a memmove of its own pair; the programs run in reverse pair
    order, one legal schedule of an unordered launch and the adversarial one
    for pair-order semantics (a read-after-write, write-after-read or
    write-after-write between two pairs of one launch comes out wrong).
    Records the buffers of every launch.
    """

    def __init__(self):
        self.launches = []

    def __call__(self, src_ptrs, dst_ptrs, sizes):
        src, dst, size = src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()
        self.launches.append((src, dst, size))
        for s, d, n in reversed(list(zip(src, dst, size))):
            if n > 0:
                ctypes.memmove(d, ctypes.string_at(s, n), n)


def memmove_oracle(raw: np.ndarray, copies) -> np.ndarray:
    """numpy memmove of (src_off, dst_off, nbytes) byte ranges, in pair order."""
    out = raw.copy()
    for s, d, n in copies:
        out[d : d + n] = out[s : s + n].copy()
    return out


def make_buffer(n, dtype):
    return CpuGpuBuffer(n, dtype=dtype, device=torch.device("cpu"), pin_memory=False)


class World:
    """Mamba-like pools for ``num_layers`` layers, carved out of one poisoned byte buffer.

    Per layer: a conv pool (blocks, width, dim) and a temporal pool
    (blocks, heads, head_dim), laid out back to back like model_runner_v1 does,
    with guard bytes around everything.
    """

    def __init__(
        self,
        *,
        num_layers=2,
        num_blocks=16,
        width=4,
        dim=8,
        temporal=(2, 3, 4),
        dtype=torch.float16,
        block_size=4,
        num_spec=2,
        max_reqs=8,
        seed=0,
    ):
        self.width, self.dim, self.temporal, self.dtype = width, dim, temporal, dtype
        es = torch.empty((), dtype=dtype).element_size()
        self.conv_bytes = width * dim * es
        self.temporal_bytes = int(np.prod(temporal)) * es
        layer_bytes = num_blocks * (self.conv_bytes + self.temporal_bytes)
        total = GUARD + num_layers * layer_bytes + GUARD
        gen = torch.Generator().manual_seed(seed)
        self.raw = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen)
        self.layer_names = [f"model.layers.{i}.linear_attn" for i in range(num_layers)]
        self.conv_off, self.temporal_off, self.forward_context = {}, {}, {}
        start = GUARD
        for name in self.layer_names:
            conv_end = start + num_blocks * self.conv_bytes
            temporal_end = conv_end + num_blocks * self.temporal_bytes
            conv = self.raw[start:conv_end].view(dtype).view(num_blocks, width, dim)
            temp = self.raw[conv_end:temporal_end].view(dtype).view(num_blocks, *temporal)
            self.conv_off[name], self.temporal_off[name] = start, conv_end
            self.forward_context[name] = SimpleNamespace(kv_cache=[conv, temp])
            start = temporal_end
        spec = MambaSpec(
            block_size=block_size,
            shapes=((width, dim), tuple(temporal)),
            dtypes=(dtype, dtype),
            mamba_cache_mode="align",
            num_speculative_blocks=num_spec,
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=list(self.layer_names), kv_cache_spec=spec)],
        )
        self.copy_bufs = mamba_utils.MambaCopyBuffers.create(max_reqs, self.kv_cache_config, COPY_FUNCS, make_buffer)
        self.base = self.raw.data_ptr()

    def bytes(self) -> np.ndarray:
        return self.raw.numpy().copy()

    def expected_copies(self, block_ids, src_idx, dest_idx, bias):
        """Byte ranges vLLM's copy specs describe, derived from first principles, in pair order."""
        es = torch.empty((), dtype=self.dtype).element_size()
        row = self.dim * es
        copies = []
        for name in self.layer_names:
            conv, temp = self.conv_off[name], self.temporal_off[name]
            src_blk, dst_blk = block_ids[src_idx], block_ids[dest_idx]
            conv_src = conv + src_blk * self.conv_bytes + bias * row
            copies.append((conv_src, conv + dst_blk * self.conv_bytes, (self.width - bias) * row))
            t_src = temp + block_ids[src_idx + bias] * self.temporal_bytes
            copies.append((t_src, temp + dst_blk * self.temporal_bytes, self.temporal_bytes))
        return copies

    def collect(self, req_id, block_ids, src_idx, dest_idx, bias, collector=None):
        collector = collector or mamba_utils.collect_mamba_copy_meta
        req_state = SimpleNamespace(req_id=req_id, block_ids=(list(block_ids),))
        collector(
            self.copy_bufs,
            self.kv_cache_config,
            COPY_FUNCS,
            self.copy_bufs.mamba_group_ids,
            src_idx,
            dest_idx,
            bias,
            req_state,
            self.forward_context,
        )


def _pristine_vllm_mamba_utils():
    """A fresh, unpatched copy of vllm.v1.worker.mamba_utils (vLLM's own collector)."""
    spec = importlib.util.spec_from_file_location("_pristine_vllm_mamba_utils", mamba_utils.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BACKENDS = ["torch", "triton"]


def _kernel_for(backend):
    return ParallelLaunchKernel() if backend == "triton" else None


# --------------------------------------------------------------------------- the copy path


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [1, 2, 3])
def test_same_block_conv_left_shift_every_bias(backend, bias):
    world = World(width=4)
    block_ids = [3, 7, 1, 9, 5, 11]
    before = world.bytes()
    expected = memmove_oracle(before, world.expected_copies(block_ids, 1, 1, bias))
    assert not np.array_equal(expected, before)
    with bound(backend, _kernel_for(backend)):
        world.copy_bufs.offset = 0
        world.collect("req-0", block_ids, 1, 1, bias)
        mamba_utils.do_mamba_copy_block(world.copy_bufs)
    np.testing.assert_array_equal(world.bytes(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_distinct_block_moves_with_accept_token_bias(backend):
    world = World(num_layers=3, num_blocks=24)
    requests = [
        ("req-a", [2, 4, 6, 8, 10], 0, 1, 0),
        ("req-b", [3, 5, 7, 9, 11], 1, 2, 1),
        ("req-c", [12, 13, 14, 15, 16], 0, 2, 2),
        ("req-d", [17, 18, 19, 20, 21], 2, 2, 2),
    ]
    before = world.bytes()
    copies = []
    with bound(backend, _kernel_for(backend)):
        world.copy_bufs.offset = 0
        for req_id, block_ids, src_idx, dest_idx, bias in requests:
            world.collect(req_id, block_ids, src_idx, dest_idx, bias)
            copies += world.expected_copies(block_ids, src_idx, dest_idx, bias)
        mamba_utils.do_mamba_copy_block(world.copy_bufs)
    np.testing.assert_array_equal(world.bytes(), memmove_oracle(before, copies))


def _preprocess_model(reqs, mamba_state_idx, block_size, num_spec):
    """Plain-Python model of preprocess_mamba's decisions: (req, src_idx, dest_idx, bias) per copy."""
    decisions = []
    for req_id, computed, scheduled, accepted, _ in reqs:
        prev = mamba_state_idx.get(req_id)
        if prev is None:
            prev = (computed - 1) // block_size
        curr = -(-(computed + scheduled) // block_size) - 1  # cdiv(...) + num_spec - 1 - num_spec
        if prev != -1 and prev != curr:
            decisions.append((req_id, prev, curr, accepted - 1))
    return decisions


@pytest.mark.parametrize("backend", BACKENDS)
def test_preprocess_mamba_collects_and_copies_like_the_model(backend):
    block_size, num_spec = 4, 2
    world = World(num_blocks=40, block_size=block_size, num_spec=num_spec)
    # (req_id, num_computed_tokens, num_scheduled_tokens, accepted tokens, block ids)
    reqs = [
        ("r0", 7, 3, 3, [0, 1, 2, 3, 4, 5]),  # running state moves 1 -> 2 with bias 2
        ("r1", 4, 1, 1, [6, 7, 8, 9, 10, 11]),  # 0 -> 1, bias 0
        ("r2", 5, 2, 2, [12, 13, 14, 15, 16, 17]),  # stays in block 1: no copy
        ("r3", 0, 5, 1, [18, 19, 20, 21, 22, 23]),  # new request: no previous state
        ("r4", 9, 3, 2, [24, 25, 26, 27, 28, 29]),  # previous state known: 1 -> 2, bias 1
    ]
    mamba_state_idx = {"r4": 1}
    decisions = _preprocess_model(reqs, dict(mamba_state_idx), block_size, num_spec)
    assert [d[0] for d in decisions] == ["r0", "r1", "r4"]
    block_table = {r[0]: r[4] for r in reqs}
    before = world.bytes()
    copies = []
    for req_id, src_idx, dest_idx, bias in decisions:
        copies += world.expected_copies(block_table[req_id], src_idx, dest_idx, bias)

    scheduler_output = SimpleNamespace(
        finished_req_ids=set(),
        preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
        num_scheduled_tokens={r[0]: r[2] for r in reqs},
    )
    input_batch = SimpleNamespace(
        req_ids=[r[0] for r in reqs], num_accepted_tokens_cpu=np.array([r[3] for r in reqs], dtype=np.int32)
    )
    requests = {r[0]: SimpleNamespace(req_id=r[0], num_computed_tokens=r[1], block_ids=(list(r[4]),)) for r in reqs}
    with bound(backend, _kernel_for(backend)):
        assert mamba_utils.preprocess_mamba is patch_mamba_utils.preprocess_mamba
        mamba_utils.preprocess_mamba(
            scheduler_output,
            world.kv_cache_config,
            SimpleNamespace(enable_prefix_caching=True),
            mamba_state_idx,
            input_batch,
            requests,
            world.forward_context,
            COPY_FUNCS,
            world.copy_bufs,
        )
        np.testing.assert_array_equal(world.bytes(), before)  # preprocess only collects
        mamba_utils.do_mamba_copy_block(world.copy_bufs)
    np.testing.assert_array_equal(world.bytes(), memmove_oracle(before, copies))
    copied = {d[0] for d in decisions}
    assert input_batch.num_accepted_tokens_cpu.tolist() == [1 if r[0] in copied else r[3] for r in reqs]


def test_pointer_buffers_and_tensor_pairs_describe_the_same_copies():
    world = World(num_layers=2, num_blocks=20)
    reference = World(num_layers=2, num_blocks=20)
    reference.raw, reference.forward_context, reference.base = world.raw, world.forward_context, world.base
    vllm_collect = _pristine_vllm_mamba_utils().collect_mamba_copy_meta
    steps = [("a", [0, 1, 2, 3, 4], 1, 1, 2), ("b", [5, 6, 7, 8, 9], 0, 2, 1), ("c", [10, 11, 12, 13, 14], 1, 2, 0)]
    expected = []
    with bound("torch"):
        world.copy_bufs.offset = reference.copy_bufs.offset = 0
        for req_id, block_ids, src_idx, dest_idx, bias in steps:
            world.collect(req_id, block_ids, src_idx, dest_idx, bias)
            reference.collect(req_id, block_ids, src_idx, dest_idx, bias, collector=vllm_collect)
            expected += world.expected_copies(block_ids, src_idx, dest_idx, bias)
        n = world.copy_bufs.offset
        assert n == reference.copy_bufs.offset == len(expected) == 12
        for name in ("src_ptrs", "dst_ptrs", "sizes"):
            np.testing.assert_array_equal(
                getattr(world.copy_bufs, name).np[:n], getattr(reference.copy_bufs, name).np[:n], err_msg=name
            )
        pairs = msc.tensor_copy_pairs(world.copy_bufs)
    assert len(pairs) == n
    storage = world.raw.untyped_storage().data_ptr()
    for i, ((src_view, dst_view), (s, d, nbytes)) in enumerate(zip(pairs, expected)):
        assert src_view.data_ptr() == world.copy_bufs.src_ptrs.np[i] == world.base + s
        assert dst_view.data_ptr() == world.copy_bufs.dst_ptrs.np[i] == world.base + d
        assert src_view.numel() * src_view.element_size() == world.copy_bufs.sizes.np[i] == nbytes
        assert src_view.shape == dst_view.shape and src_view.dtype == dst_view.dtype == world.dtype
        assert src_view.untyped_storage().data_ptr() == dst_view.untyped_storage().data_ptr() == storage


# --------------------------------------------------------------------------- the switch


def test_switch_torch_runs_tensor_pairs_not_the_pointer_kernel():
    world = World()
    before = world.bytes()
    with bound("torch"):  # the bound kernel raises if it is called
        assert mamba_utils.collect_mamba_copy_meta is msc.collect_mamba_copy_meta
        assert mamba_utils.do_mamba_copy_block is msc.do_mamba_copy_block
        world.copy_bufs.offset = 0
        world.collect("r", [1, 2, 3, 4], 1, 1, 1)
        mamba_utils.do_mamba_copy_block(world.copy_bufs)
    np.testing.assert_array_equal(world.bytes(), memmove_oracle(before, world.expected_copies([1, 2, 3, 4], 1, 1, 1)))


def test_switch_triton_hands_the_buffers_to_batch_memcpy():
    world = World()
    kernel = ParallelLaunchKernel()
    before = world.bytes()
    with bound("triton", kernel):
        assert mamba_utils.batch_memcpy is kernel
        world.copy_bufs.offset = 0
        world.collect("r", [1, 2, 3, 4, 5], 0, 2, 1)
        n = world.copy_bufs.offset
        collected = [getattr(world.copy_bufs, k).np[:n].tolist() for k in ("src_ptrs", "dst_ptrs", "sizes")]
        mamba_utils.do_mamba_copy_block(world.copy_bufs)
    copies = world.expected_copies([1, 2, 3, 4, 5], 0, 2, 1)
    assert kernel.launches == [tuple(collected)]
    assert kernel.launches[0] == (
        [world.base + s for s, _, _ in copies],
        [world.base + d for _, d, _ in copies],
        [nbytes for _, _, nbytes in copies],
    )
    np.testing.assert_array_equal(world.bytes(), memmove_oracle(before, copies))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "torch"), ("", "torch"), ("torch", "torch"), ("triton", "triton"), (" Triton ", "triton")],
)
def test_switch_reads_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(msc.ENV_NAME, raising=False)
    else:
        monkeypatch.setenv(msc.ENV_NAME, value)
    assert expected == envs_ascend.VLLM_ASCEND_MAMBA_COPY_BACKEND
    kernel = ParallelLaunchKernel()
    with restored_bindings():
        assert msc.bind_mamba_state_copy(mamba_utils, on_310p=False, pointer_kernels={"triton": kernel}) == expected
        assert msc.active_backend() == expected
        assert (mamba_utils.batch_memcpy is kernel) == (expected == "triton")


@pytest.mark.parametrize("value", ["memcpy", "1", "Torch2", "triton,torch"])
def test_unknown_backend_fails_naming_the_variable_and_allowed_values(monkeypatch, value):
    monkeypatch.setenv(msc.ENV_NAME, value)
    with restored_bindings(), pytest.raises(msc.MambaCopyConfigError) as err:
        msc.bind_mamba_state_copy(mamba_utils, on_310p=False, pointer_kernels={"triton": _forbidden_kernel})
    message = str(err.value)
    assert msc.ENV_NAME in message and repr(value) in message
    assert "allowed values: " + ", ".join(envs_ascend.MAMBA_COPY_BACKENDS) in message


@pytest.mark.parametrize("value", [None, "triton", "bogus"])
def test_patch_module_binds_at_start_up(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(msc.ENV_NAME, raising=False)
    else:
        monkeypatch.setenv(msc.ENV_NAME, value)
    with restored_bindings():
        if value == "bogus":
            with pytest.raises(msc.MambaCopyConfigError, match=msc.ENV_NAME):
                importlib.reload(patch_mamba_utils)
            return
        module = importlib.reload(patch_mamba_utils)
        assert mamba_utils.collect_mamba_copy_meta is msc.collect_mamba_copy_meta
        assert mamba_utils.do_mamba_copy_block is msc.do_mamba_copy_block
        assert mamba_utils.batch_memcpy is module._batch_memcpy_triton
        assert msc.active_backend() == (value or "torch")


def test_310p_keeps_its_fallback_and_rejects_pointer_backends():
    fallback = SimpleNamespace(collect_mamba_copy_meta=object(), do_mamba_copy_block=object(), batch_memcpy=object())
    before = dict(vars(fallback))
    with restored_bindings():
        assert msc.bind_mamba_state_copy(fallback, on_310p=True, pointer_kernels={}, backend="torch") == "torch"
        assert vars(fallback) == before
        with pytest.raises(msc.MambaCopyConfigError, match="310P"):
            msc.bind_mamba_state_copy(
                fallback, on_310p=True, pointer_kernels={"triton": _forbidden_kernel}, backend="triton"
            )
        assert vars(fallback) == before


# --------------------------------------------------------------------------- validation


def _bad_copy_cases(world):
    conv0, temp0 = world.forward_context[world.layer_names[0]].kv_cache
    conv1 = world.forward_context[world.layer_names[1]].kv_cache[0]
    es = conv0.element_size()
    base, span = conv0.data_ptr(), conv0.numel() * es
    fp32 = torch.zeros(16, dtype=torch.float32)
    return {
        "src before its pool": ((conv0, base - es, conv0, base, es), "reads outside its source state pool"),
        "src in another pool": ((conv0, conv1.data_ptr(), conv0, base, es), "reads outside its source state pool"),
        "dst past its pool": ((conv0, base, conv0, base + span - es, 2 * es), "writes outside its destination"),
        "negative size": ((conv0, base, conv0, base + 64, -es), "negative size"),
        "oversized": ((conv0, base, conv0, base, span + es), "larger than its state pool"),
        "misaligned src": ((conv0, base + 1, conv0, base + 64, es), "not element-aligned"),
        "misaligned dst": ((temp0, temp0.data_ptr(), temp0, temp0.data_ptr() + 3, es), "not element-aligned"),
        "partial element": ((conv0, base, conv0, base + 64, es + 1), "whole number of elements"),
        "dtype mismatch": ((conv0, base, fp32, fp32.data_ptr(), 4 * es), "different dtypes"),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case",
    [
        "src before its pool",
        "src in another pool",
        "dst past its pool",
        "negative size",
        "oversized",
        "misaligned src",
        "misaligned dst",
        "partial element",
        "dtype mismatch",
    ],
)
def test_bad_pair_is_refused_by_name_before_any_copy(backend, case):
    world = World()
    (src_state, src, dst_state, dst, nbytes), reason = _bad_copy_cases(world)[case]
    with bound(backend, _kernel_for(backend)):
        world.copy_bufs.offset = 0
        world.collect("good-req", [1, 2, 3, 4], 0, 1, 1)  # valid pairs first: they must not run either
        msc.record_copy(world.copy_bufs, src_state, src, dst_state, dst, nbytes, label=("bad-req", "layer.x", 1))
        before = world.bytes()
        with pytest.raises(msc.MambaCopyValidationError) as err:
            mamba_utils.do_mamba_copy_block(world.copy_bufs)
    message = str(err.value)
    assert reason in message
    assert "pair 4 (request 'bad-req', layer 'layer.x', state 1)" in message
    np.testing.assert_array_equal(world.bytes(), before)


def test_bad_pointer_from_a_copy_func_names_request_layer_and_state():
    world = World()

    def broken_temporal_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
        spec = get_temporal_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens)
        if state is world.forward_context[world.layer_names[1]].kv_cache[1]:
            spec.start_addr += state.numel() * state.element_size()  # one pool past the end
        return spec

    kernel = ParallelLaunchKernel()
    before = world.bytes()
    with bound("triton", kernel):
        world.copy_bufs.offset = 0
        mamba_utils.collect_mamba_copy_meta(
            world.copy_bufs,
            world.kv_cache_config,
            (get_conv_copy_spec, broken_temporal_spec),
            world.copy_bufs.mamba_group_ids,
            0,
            1,
            0,
            SimpleNamespace(req_id="req-7", block_ids=([4, 5, 6],)),
            world.forward_context,
        )
        with pytest.raises(msc.MambaCopyValidationError) as err:
            mamba_utils.do_mamba_copy_block(world.copy_bufs)
    assert f"pair 3 (request 'req-7', layer '{world.layer_names[1]}', state 1) reads outside" in str(err.value)
    assert kernel.launches == []
    np.testing.assert_array_equal(world.bytes(), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pointer_and_size_buffers_of_different_lengths_are_refused(backend):
    world = World()
    with bound(backend, _kernel_for(backend)):
        world.copy_bufs.offset = 0
        world.collect("r", [1, 2, 3], 0, 1, 0)
        world.copy_bufs.offset += 1  # an entry no collector recorded
        before = world.bytes()
        with pytest.raises(msc.MambaCopyValidationError, match="different lengths"):
            mamba_utils.do_mamba_copy_block(world.copy_bufs)
    np.testing.assert_array_equal(world.bytes(), before)
    conv = world.forward_context[world.layer_names[0]].kv_cache[0]
    with pytest.raises(msc.MambaCopyValidationError, match=r"src_ptrs=2, dst_ptrs=1, sizes=2"):
        msc.validate_copy_batch([conv.data_ptr()] * 2, [conv.data_ptr()], [2, 2], [conv], [0, 0], [0, 0])


# --------------------------------------------------------------------------- cross-pair hazards


def _pool_world(dtype=torch.int16, elems=256):
    es = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(
        0, 256, (GUARD + elems * es + GUARD,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    pool = raw[GUARD : GUARD + elems * es].view(dtype).view(-1, 16)
    return raw, pool, es


def _run_pairs(backend, raw, pool, pairs, es):
    """Record element-offset pairs inside ``pool`` and copy them with ``backend``; returns the kernel."""
    kernel = _kernel_for(backend)
    bufs = SimpleNamespace(
        src_ptrs=make_buffer(len(pairs), torch.int64),
        dst_ptrs=make_buffer(len(pairs), torch.int64),
        sizes=make_buffer(len(pairs), torch.int32),
        offset=0,
    )
    base = pool.data_ptr()
    with bound(backend, kernel):
        for i, (s, d, n) in enumerate(pairs):
            msc.record_copy(bufs, pool, base + s * es, pool, base + d * es, n * es, label=f"pair-{i}")
        mamba_utils.do_mamba_copy_block(bufs)
    return kernel


def _oracle_for(raw, pairs, es):
    return memmove_oracle(raw.numpy().copy(), [(GUARD + s * es, GUARD + d * es, n * es) for s, d, n in pairs])


SAFE_BATCH = [
    (0, 16, 16),  # block 0 -> block 1
    (0, 32, 16),  # the same source read again (a shared prefix-cache block)
    (52, 48, 12),  # same-block left shift (overlaps itself only)
    (64, 70, 20),  # right overlap with itself only
    (120, 120, 8),  # exact overlap
    (200, 100, 0),  # empty copy
]
HAZARD_BATCHES = {
    "read after write": [(0, 16, 16), (16, 32, 16)],
    "write after read": [(16, 32, 16), (0, 16, 16)],
    "write after write": [(0, 64, 16), (32, 64, 16), (64, 96, 16)],
    "shift chain": [(4, 0, 28), (36, 32, 28), (33, 28, 8), (100, 104, 40), (104, 100, 40)],
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_hazard_free_batch_is_one_launch(backend):
    raw, pool, es = _pool_world()
    expected = _oracle_for(raw, SAFE_BATCH, es)
    kernel = _run_pairs(backend, raw, pool, SAFE_BATCH, es)
    np.testing.assert_array_equal(raw.numpy(), expected)
    assert msc.plan_ordered_launches(*(np.array(c, dtype=np.int64) for c in zip(*SAFE_BATCH))) is None
    if kernel is not None:
        assert len(kernel.launches) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HAZARD_BATCHES))
def test_hazardous_batch_runs_in_pair_order(backend, name):
    pairs = HAZARD_BATCHES[name]
    raw, pool, es = _pool_world()
    expected = _oracle_for(raw, pairs, es)
    # The hazard is real: one unordered launch of the same batch can give another result.
    single = raw.clone()
    base = single.data_ptr() + GUARD
    ParallelLaunchKernel()(
        torch.tensor([base + s * es for s, _, _ in pairs]),
        torch.tensor([base + d * es for _, d, _ in pairs]),
        torch.tensor([n * es for _, _, n in pairs]),
    )
    assert not np.array_equal(single.numpy(), expected)

    kernel = _run_pairs(backend, raw, pool, pairs, es)
    np.testing.assert_array_equal(raw.numpy(), expected)
    if kernel is not None:
        assert len(kernel.launches) > 1
        assert sorted(p for launch in kernel.launches for p in zip(*launch)) == sorted(
            (pool.data_ptr() + s * es, pool.data_ptr() + d * es, n * es) for s, d, n in pairs
        )


# --------------------------------------------------------------------------- property-based


DTYPES = [torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.float64]


@st.composite
def pools_and_pairs(draw, max_pairs=8):
    dtype = draw(st.sampled_from(DTYPES))
    blocks = draw(st.integers(1, 6))
    row = draw(st.integers(1, 24))
    elems = blocks * row
    pairs = []
    for _ in range(draw(st.integers(1, max_pairs))):
        size = draw(st.integers(0, elems))
        src = draw(st.integers(0, elems - size))
        kind = draw(st.sampled_from(["left", "right", "exact", "disjoint"]))
        if kind == "exact":
            dst = src
        elif kind == "left":
            dst = max(0, src - draw(st.integers(1, row)))
        elif kind == "right":
            dst = min(elems - size, src + draw(st.integers(1, row)))
        else:
            dst = draw(st.integers(0, elems - size))
        pairs.append((src, dst, size))
    return dtype, blocks, row, pairs


def _fuzz_pool(dtype, blocks, row, seed):
    es = torch.empty((), dtype=dtype).element_size()
    nbytes = blocks * row * es
    raw = torch.randint(
        0, 256, (GUARD + nbytes + GUARD,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return raw, raw[GUARD : GUARD + nbytes].view(dtype).view(blocks, row), es


@FUZZ
@given(pools_and_pairs(), st.integers(0, 2**16))
def test_fuzz_torch_tensor_pairs_match_memmove_in_pair_order(case, seed):
    dtype, blocks, row, pairs = case
    raw, pool, es = _fuzz_pool(dtype, blocks, row, seed)
    expected = _oracle_for(raw, pairs, es)
    _run_pairs("torch", raw, pool, pairs, es)
    np.testing.assert_array_equal(raw.numpy(), expected)


@FUZZ
@given(pools_and_pairs(max_pairs=12), st.integers(0, 2**16))
def test_fuzz_pointer_batches_match_memmove_in_pair_order(case, seed):
    dtype, blocks, row, pairs = case
    raw, pool, es = _fuzz_pool(dtype, blocks, row, seed)
    expected = _oracle_for(raw, pairs, es)
    kernel = _run_pairs("triton", raw, pool, pairs, es)
    np.testing.assert_array_equal(raw.numpy(), expected)
    if msc.plan_ordered_launches(*(np.array(c, dtype=np.int64) for c in zip(*pairs))) is None:
        assert len(kernel.launches) == 1


def _conflicts(pairs):
    def overlap(a, n, b, m):
        return n > 0 and m > 0 and a < b + m and b < a + n

    found = set()
    for i, (si, di, ni) in enumerate(pairs):
        for j, (sj, dj, nj) in enumerate(pairs):
            if i < j and (overlap(di, ni, sj, nj) or overlap(si, ni, dj, nj) or overlap(di, ni, dj, nj)):
                found.add((i, j))
    return found


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200), st.integers(0, 40)), min_size=0, max_size=24))
def test_fuzz_launch_plan_orders_every_conflict(pairs):
    arrays = [np.array(c, dtype=np.int64) for c in zip(*pairs)] if pairs else [np.zeros(0, np.int64)] * 3
    plan = msc.plan_ordered_launches(*arrays)
    conflicts = _conflicts(pairs)
    if plan is None:
        assert not conflicts
        return
    assert conflicts
    level = {}
    for k, launch in enumerate(plan):
        assert list(launch) == sorted(launch)
        level.update({int(i): k for i in launch})
    assert sorted(level) == list(range(len(pairs)))
    assert all(level[i] < level[j] for i, j in conflicts)
