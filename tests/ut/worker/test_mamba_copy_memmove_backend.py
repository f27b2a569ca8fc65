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
"""VLLM_ASCEND_MAMBA_COPY_BACKEND=memmove binds batch_memmove as mamba_utils.batch_memcpy.

Real Triton cannot run under tests/ut (its conftest mocks ``triton.runtime``), so the
kernel object behind ``batch_memmove`` is replaced by a host launcher that checks the
launch and moves the bytes with memmove semantics; the copy kernel itself is tested
under the Triton interpreter and on devices by the op tests in
tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_batch_memmove.py.
"""

import ctypes
import importlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker import mamba_utils

import vllm_ascend.envs as envs_ascend
import vllm_ascend.ops.triton.batch_memmove as batch_memmove_module
import vllm_ascend.patch.worker.patch_mamba_utils as patch_mamba_utils
from tests.ut.worker.mamba_copy_testing import restored_bindings
from vllm_ascend.worker import mamba_state_copy as msc


class HostLauncher:
    """Stands in for ``batch_memmove_kernel``: records ``kernel[grid](...)`` and memmoves every pair."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(src_ptrs, dst_ptrs, sizes, **meta):
            self.launches.append((grid, src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(), meta))
            for s, d, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
                if n > 0:
                    ctypes.memmove(d, ctypes.string_at(s, n), n)

        return launch


def test_memmove_is_an_allowed_value():
    assert "memmove" in envs_ascend.MAMBA_COPY_BACKENDS
    with pytest.raises(msc.MambaCopyConfigError, match="allowed values: torch, triton, memmove"):
        msc.resolve_backend("memcpy")


def test_switch_binds_batch_memmove_at_start_up(monkeypatch):
    monkeypatch.setenv(msc.ENV_NAME, "memmove")
    with restored_bindings():
        importlib.reload(patch_mamba_utils)
        assert msc.active_backend() == "memmove"
        assert mamba_utils.batch_memcpy is batch_memmove_module.batch_memmove
        assert mamba_utils.collect_mamba_copy_meta is msc.collect_mamba_copy_meta
        assert mamba_utils.do_mamba_copy_block is msc.do_mamba_copy_block


def test_memmove_backend_moves_overlapping_pairs_through_batch_memmove(monkeypatch):
    launcher = HostLauncher()
    monkeypatch.setattr(batch_memmove_module, "batch_memmove_kernel", launcher)
    gen = torch.Generator().manual_seed(3)
    pool = torch.randint(-(2**15), 2**15, (8, 32), dtype=torch.int16, generator=gen)
    before = pool.numpy().tobytes()
    es, base = pool.element_size(), pool.data_ptr()
    pairs = [(4, 0, 28), (100, 104, 40), (200, 200, 8), (160, 224, 32)]  # left, right, exact, disjoint (elements)

    def make_buffer(n, dtype):
        return CpuGpuBuffer(n, dtype=dtype, device=torch.device("cpu"), pin_memory=False)

    bufs = SimpleNamespace(
        src_ptrs=make_buffer(4, torch.int64), dst_ptrs=make_buffer(4, torch.int64), sizes=make_buffer(4, torch.int32)
    )
    bufs.offset = 0
    with restored_bindings():
        msc.bind_mamba_state_copy(
            mamba_utils, on_310p=False, pointer_kernels=patch_mamba_utils._MAMBA_COPY_POINTER_KERNELS, backend="memmove"
        )
        for s, d, n in pairs:
            msc.record_copy(bufs, pool, base + s * es, pool, base + d * es, n * es)
        mamba_utils.do_mamba_copy_block(bufs)

    expected = np.frombuffer(before, dtype=np.uint8).copy()
    for s, d, n in pairs:
        expected[d * es : (d + n) * es] = expected[s * es : (s + n) * es].copy()
    np.testing.assert_array_equal(pool.numpy().view(np.uint8).reshape(-1), expected)
    assert len(launcher.launches) == 1  # hazard-free batch: one launch of the whole batch
    grid, src, dst, sizes, _ = launcher.launches[0]
    assert grid[0] == len(pairs)
    assert (src, dst, sizes) == (
        [base + s * es for s, _, _ in pairs],
        [base + d * es for _, d, _ in pairs],
        [n * es for _, _, n in pairs],
    )


def test_memmove_is_refused_on_310p():
    with restored_bindings(), pytest.raises(msc.MambaCopyConfigError, match="310P"):
        msc.bind_mamba_state_copy(
            mamba_utils, on_310p=True, pointer_kernels=patch_mamba_utils._MAMBA_COPY_POINTER_KERNELS, backend="memmove"
        )
