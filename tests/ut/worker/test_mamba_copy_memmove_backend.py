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
"""VLLM_ASCEND_MAMBA_COPY_BACKEND=memmove: batch_memmove on the whole-batch and the layerwise path.

Real Triton cannot run under tests/ut (its conftest mocks ``triton.runtime``), so
``batch_memmove`` is replaced by a host launcher that checks the launch and moves
the bytes with memmove semantics, pairs in reverse order (an unordered launch);
the kernel itself is tested under the Triton interpreter and on devices by
tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_batch_memmove.py.
"""

import ctypes

import pytest
import torch
from vllm.v1.worker import mamba_utils

from tests.ut.patch.worker.test_patch_mamba_utils_overlap import LAYERWISE, UnorderedKernel, World, bound, use_kernel


class HostMemmove:
    def __init__(self):
        self.launches = []

    def __call__(self, src_ptrs, dst_ptrs, sizes, *, tiles=16, **kwargs):
        assert src_ptrs.dtype == dst_ptrs.dtype == torch.int64 and sizes.dtype == torch.int32
        assert tiles >= 1 and sizes.shape[0] * tiles <= 65535, (sizes.shape[0], tiles)
        pairs = list(zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()))
        self.launches.append((pairs, tiles))
        for s, d, n in reversed(pairs):
            if n > 0:
                ctypes.memmove(d, ctypes.string_at(s, n), n)


@pytest.mark.parametrize("layerwise", [False, True] if LAYERWISE else [False])
@pytest.mark.parametrize("bias", [1, 3])
def test_memmove_backend_runs_every_copy_path_overlap_safe(monkeypatch, bias, layerwise):
    world = World()
    memmove = HostMemmove()
    with bound(monkeypatch, "memmove") as module:
        monkeypatch.setattr(module, "batch_memmove", memmove)
        use_kernel(monkeypatch, UnorderedKernel())  # the pointer kernel of "triton": must not be used
        assert mamba_utils.do_mamba_copy_block is module._do_mamba_copy_block_npu
        world.start_step()
        world.collect([3, 5, 5, 7, 9, 10], 1, 2, bias)  # same-block conv shift
        world.collect([4, 6, 8, 1, 10, 11], 0, 2, 2)
        before = world.bytes()
        world.run_layerwise() if layerwise else world.run_whole_batch()
        assert len(memmove.launches) == (len(world.layer_names) if layerwise else 1)
        assert mamba_utils.batch_memcpy.launches == []
    world.assert_memmove(before)


def test_large_batches_bound_the_grid(monkeypatch):
    memmove = HostMemmove()
    with bound(monkeypatch, "memmove") as module:
        monkeypatch.setattr(module, "batch_memmove", memmove)
        n = 8192
        buf = torch.zeros(2 * n, dtype=torch.uint8)
        src = torch.full((n,), buf.data_ptr(), dtype=torch.int64)
        dst = torch.arange(n, dtype=torch.int64) + buf.data_ptr() + n
        module._batch_memmove(src, dst, torch.ones(n, dtype=torch.int32))
        module._batch_memmove(src[:2], dst[:2], torch.ones(2, dtype=torch.int32))
    assert [tiles for _, tiles in memmove.launches] == [7, 16]
