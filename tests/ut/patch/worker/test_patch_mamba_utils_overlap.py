# SPDX-License-Identifier: Apache-2.0
"""Overlap-safe Mamba state copies on the NPU path (patch_mamba_utils).

vLLM's ``mamba_utils`` entry points are driven as ``patch_mamba_utils`` binds them
(reloaded with a chosen hardware profile and ``VLLM_ASCEND_MAMBA_COPY_BACKEND``),
over Mamba-like state pools carved out of one poisoned byte buffer; every byte is
compared with a numpy memmove oracle applied in pair order. Real Triton cannot run
under tests/ut (its conftest mocks ``triton.runtime``), so the pointer kernel is
replaced by ``UnorderedKernel``: a host model of one launch of
``batch_memcpy_kernel`` whose chunks run in one legal order of an unordered launch
(last chunk first), which is how loads and stores race on a device.

Hypothesis budget: ``VLLM_ASCEND_FUZZ_PROFILE=ci`` (default, fixed and
derandomized) or ``long`` for manual runs.
"""

import contextlib
import ctypes
import importlib
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

import vllm_ascend.device.hardware_profile as hardware_profile
import vllm_ascend.envs as envs_ascend
import vllm_ascend.patch.worker.patch_mamba_utils as pm

settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings.get_profile(os.environ.get("VLLM_ASCEND_FUZZ_PROFILE", "ci"))


ENV = "VLLM_ASCEND_MAMBA_COPY_BACKEND"
GUARD = 64
RUNS = ["run_whole_batch", "run_layerwise"]


@contextlib.contextmanager
def bound(monkeypatch, backend=None, npu=True, env=None):
    """Re-run patch_mamba_utils' start-up with a hardware profile and the copy-backend env; undo it after."""
    saved_vllm = dict(vars(mamba_utils))
    saved_create = vars(mamba_utils.MambaCopyBuffers)["create"]
    saved_pm = dict(vars(pm))
    with monkeypatch.context() as mp:
        mp.delenv(ENV, raising=False)
        for name, value in (env or ({ENV: backend} if backend is not None else {})).items():
            mp.setenv(name, value)
        profile = SimpleNamespace(supports=lambda capability: npu)
        mp.setattr(hardware_profile, "get_current_hardware_profile", lambda: profile)
        try:
            importlib.reload(pm)
            yield pm
        finally:
            vars(mamba_utils).update(saved_vllm)
            mamba_utils.MambaCopyBuffers.create = saved_create
            vars(pm).clear()
            vars(pm).update(saved_pm)


class UnorderedKernel:
    """Host model of one batch_memcpy_kernel launch: every pair copied in 16-byte chunks with no
    order between chunks (here: the last chunk first, one legal schedule of unordered lanes)."""

    CHUNK = 16

    def __init__(self):
        self.launches = []

    def __call__(self, src_ptrs, dst_ptrs, sizes):
        pairs = list(zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()))
        self.launches.append(pairs)
        for s, d, n in pairs:
            for start in reversed(range(0, n, self.CHUNK)):
                k = min(self.CHUNK, n - start)
                ctypes.memmove(d + start, ctypes.string_at(s + start, k), k)


def memmove_oracle(raw: np.ndarray, copies) -> np.ndarray:
    """numpy memmove of (src_off, dst_off, nbytes) byte ranges, in pair order."""
    out = raw.copy()
    for s, d, n in copies:
        out[d : d + n] = out[s : s + n].copy()
    return out


def make_buffer(n, dtype):
    return CpuGpuBuffer(n, dtype=dtype, device=torch.device("cpu"), pin_memory=False)


class World:
    """Per layer a conv pool (blocks, width, dim) and a temporal pool, carved out of one poisoned buffer."""

    def __init__(self, *, num_layers=2, num_blocks=12, width=4, dim=8, temporal=(2, 3, 4), dtype=torch.float16):
        self.width, self.dim, self.dtype = width, dim, dtype
        self.es = torch.empty((), dtype=dtype).element_size()
        self.conv_bytes = width * dim * self.es
        self.temporal_bytes = int(np.prod(temporal)) * self.es
        total = 2 * GUARD + num_layers * num_blocks * (self.conv_bytes + self.temporal_bytes)
        self.raw = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        self.layer_names = [f"model.layers.{i}.linear_attn" for i in range(num_layers)]
        self.conv_off, self.temporal_off, self.forward_context = {}, {}, {}
        start = GUARD
        for name in self.layer_names:
            conv_end = start + num_blocks * self.conv_bytes
            end = conv_end + num_blocks * self.temporal_bytes
            conv = self.raw[start:conv_end].view(dtype).view(num_blocks, width, dim)
            temp = self.raw[conv_end:end].view(dtype).view(num_blocks, *temporal)
            self.conv_off[name], self.temporal_off[name] = start, conv_end
            self.forward_context[name] = SimpleNamespace(kv_cache=[conv, temp])
            start = end
        spec = MambaSpec(
            block_size=4,
            shapes=((width, dim), tuple(temporal)),
            dtypes=(dtype, dtype),
            mamba_cache_mode="align",
            num_speculative_blocks=2,
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=list(self.layer_names), kv_cache_spec=spec)],
        )
        self.copy_funcs = {spec.mamba_type: (get_conv_copy_spec, get_temporal_copy_spec)}
        self.copy_bufs = mamba_utils.MambaCopyBuffers.create(8, self.kv_cache_config, self.copy_funcs, make_buffer)
        self.base = self.raw.data_ptr()
        self.copies = []

    def bytes(self) -> np.ndarray:
        return self.raw.numpy().copy()

    def start_step(self):
        # What preprocess_mamba does before collecting.
        self.copy_bufs.offset = 0
        pm._reset_layerwise_copy_meta(self.copy_bufs)
        self.copies = []

    def collect(self, block_ids, src_idx, dest_idx, bias):
        """One request through the bound collector; records the byte ranges vLLM's copy specs describe."""
        mamba_utils.collect_mamba_copy_meta(
            self.copy_bufs,
            self.kv_cache_config,
            self.copy_funcs,
            self.copy_bufs.mamba_group_ids,
            src_idx,
            dest_idx,
            bias,
            SimpleNamespace(block_ids=(list(block_ids),)),
            self.forward_context,
        )
        if src_idx == dest_idx and bias == 0:
            return
        row = self.dim * self.es
        for name in self.layer_names:
            conv, temp = self.conv_off[name], self.temporal_off[name]
            dst_blk = block_ids[dest_idx]
            conv_src = conv + block_ids[src_idx] * self.conv_bytes + bias * row
            self.copies.append((conv_src, conv + dst_blk * self.conv_bytes, (self.width - bias) * row))
            t_src = temp + block_ids[src_idx + bias] * self.temporal_bytes
            self.copies.append((t_src, temp + dst_blk * self.temporal_bytes, self.temporal_bytes))

    def run_whole_batch(self):
        self.stage()
        mamba_utils.do_mamba_copy_block(self.copy_bufs)

    def stage(self):
        # What preprocess_mamba does after collecting, on the NPU path.
        if self.copy_bufs._layer_copy_metadata:
            pm.prepare_mamba_copy_by_layer(self.copy_bufs)
        else:
            pm._stage_mamba_copy_metadata(self.copy_bufs)

    def run_layerwise(self):
        self.stage()
        for name in self.layer_names:
            mamba_utils.do_mamba_copy_block_for_layer(self.copy_bufs, name)
        mamba_utils.finish_mamba_copy_by_layer(self.copy_bufs)

    def assert_memmove(self, before):
        expected = memmove_oracle(before, [(s - self.base, d - self.base, n) for s, d, n in self._abs()])
        after = self.bytes()
        bad = np.flatnonzero(after != expected)
        assert bad.size == 0, f"{bad.size} bytes differ from the memmove oracle (first at offset {bad[0]})"

    def _abs(self):
        return [(s + self.base, d + self.base, n) for s, d, n in self.copies]


def use_kernel(monkeypatch, kernel):
    """Route every pointer launch of the bound path to ``kernel`` (by name, and as vLLM's batch_memcpy)."""
    monkeypatch.setattr(pm, "_batch_memcpy_triton", kernel)
    monkeypatch.setattr(mamba_utils, "batch_memcpy", kernel)
    return kernel


def _step(world, requests):
    world.start_step()
    for block_ids, src_idx, dest_idx, bias in requests:
        world.collect(block_ids, src_idx, dest_idx, bias)


def test_npu_default_binds_the_tensor_pair_path(monkeypatch):
    with bound(monkeypatch) as module:
        assert mamba_utils.collect_mamba_copy_meta is module._collect_mamba_copy_meta_npu
        assert mamba_utils.do_mamba_copy_block is module._do_mamba_copy_block_npu_torch
        assert envs_ascend.VLLM_ASCEND_MAMBA_COPY_BACKEND == "torch"
        assert ENV in envs_ascend.env_variables


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("bias", [1, 2, 3])
def test_same_block_conv_shift_matches_memmove(monkeypatch, bias, run):
    """The conv shift inside one block (dst < src < dst + size): the case that races."""
    world = World()
    with bound(monkeypatch):
        k = use_kernel(monkeypatch, UnorderedKernel())  # on the base, the default NPU path lands here
        _step(world, [([3, 5, 5, 7, 9], 1, 2, bias), ([4, 6, 8, 8, 10], 2, 3, 0)])
        before = world.bytes()
        getattr(world, run)()
        assert k.launches == []
    world.assert_memmove(before)


@pytest.mark.parametrize("run", RUNS)
def test_per_pair_collector_files_each_pair_under_its_layer(monkeypatch, run):
    """torch path, per-pair collector: every tensor pair once, under its layer, for the layerwise copy."""
    world = World()
    with bound(monkeypatch):
        # the per-pair collector (copy functions the grouped path does not know)
        monkeypatch.setattr(pm.mamba_copy_groups, "record", lambda *args: False)
        _step(world, [([3, 5, 5, 7, 9], 1, 2, 1), ([4, 6, 8, 1, 10], 0, 2, 2)])
        bufs = world.copy_bufs
        assert bufs.offset == len(world.copies) == len(bufs._tensor_copy_pairs)
        per_layer = bufs._layer_tensor_copy_pairs
        assert list(per_layer) == list(bufs._layer_copy_metadata) == world.layer_names

        def ranges(pairs):
            return [(s.data_ptr(), d.data_ptr(), s.numel() * s.element_size()) for s, d in pairs]

        assert sorted(r for name in world.layer_names for r in ranges(per_layer[name])) == sorted(world._abs())
        assert ranges(bufs._tensor_copy_pairs) == world._abs()
        before = world.bytes()
        getattr(world, run)()
    world.assert_memmove(before)


def test_triton_backend_restores_the_pointer_kernel(monkeypatch):
    """A/B: VLLM_ASCEND_MAMBA_COPY_BACKEND=triton runs the previous pointer path: one launch of every pair."""
    world = World()
    with bound(monkeypatch, "triton") as module:
        kernel = use_kernel(monkeypatch, UnorderedKernel())
        assert mamba_utils.collect_mamba_copy_meta is module._collect_mamba_copy_meta_with_layers
        assert mamba_utils.do_mamba_copy_block is module._do_mamba_copy_block_npu
        _step(world, [([3, 5, 5, 7, 9], 1, 2, 1)])
        world.run_whole_batch()
        assert len(kernel.launches) == 1 and sorted(kernel.launches[0]) == sorted(world._abs())


@pytest.mark.parametrize("value", ["memcpy", "1", "torch,triton"])
def test_unknown_value_fails_at_start_up(monkeypatch, value):
    with (
        pytest.raises(ValueError, match=rf"Unknown {ENV}='{value}'; allowed values: torch, triton"),
        bound(monkeypatch, value),
    ):
        pass


@pytest.mark.parametrize(("value", "active"), [("", "torch"), (" Torch ", "torch"), ("TRITON", "triton")])
def test_value_is_normalised_and_logged_once(monkeypatch, value, active):
    from vllm.logger import logger

    said = []
    monkeypatch.setattr(logger, "info_once", lambda msg, *args, **kw: said.append(msg % args))
    with bound(monkeypatch, value):
        assert said == [f"Mamba state copies: {ENV}={active}"]


def test_310p_binds_the_per_pair_copy_of_its_release(monkeypatch):
    """310P keeps the release's own tensor-copy fallback: collector and copy unchanged, one pair at a
    time, whatever VLLM_ASCEND_MAMBA_COPY_BACKEND says; the grouped copy never runs there."""
    world = World()

    def spy(*args, **kwargs):
        raise AssertionError("the grouped copy ran on 310P")

    with bound(monkeypatch, npu=False) as module:
        monkeypatch.setattr(module.mamba_copy_groups, "record", spy)
        monkeypatch.setattr(module.mamba_copy_groups, "copy", spy)
        assert mamba_utils.collect_mamba_copy_meta is module._collect_mamba_copy_meta_torch
        assert mamba_utils.do_mamba_copy_block is module._do_mamba_copy_block_torch
        assert mamba_utils.postprocess_mamba_align_gpu is module._postprocess_mamba_align_gpu_cpu_fallback
        copied = []
        monkeypatch.setattr(torch.Tensor, "clone", lambda self, f=torch.Tensor.clone: copied.append(1) or f(self))
        _step(world, [([3, 5, 5, 7, 9], 1, 2, 1), ([4, 6, 8, 8, 10], 2, 3, 0)])
        before = world.bytes()
        mamba_utils.do_mamba_copy_block(world.copy_bufs)
        assert len(copied) == len(world.copies)  # dst.copy_(src.clone()), pair by pair
    world.assert_memmove(before)


_request = st.integers(0, 2).flatmap(
    lambda src_idx: st.tuples(
        st.lists(st.integers(0, 11), min_size=6, max_size=6),
        st.just(src_idx),
        st.integers(0, 5),
        st.integers(0, 3),
    )
)


@FUZZ
@given(requests=st.lists(_request, min_size=1, max_size=4), layerwise=st.booleans())
def test_fuzz_any_batch_equals_pair_order_memmove(requests, layerwise):
    """Random block tables (shared and repeated blocks), indices and biases, several requests:
    the bound NPU path equals a memmove of every pair in collection order."""
    world = World()
    with pytest.MonkeyPatch.context() as mp, bound(mp):
        use_kernel(mp, UnorderedKernel())
        _step(world, requests)
        before = world.bytes()
        world.run_layerwise() if layerwise else world.run_whole_batch()
    world.assert_memmove(before)
