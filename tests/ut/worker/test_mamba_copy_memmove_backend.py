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
"""The pointer copy paths of patch_mamba_utils: VLLM_ASCEND_MAMBA_COPY_BACKEND=memmove, and triton (A/B).

``memmove`` checks the pointer tables on the host and runs batch_memmove (upstream's
batch_memcpy_kernel, pairs that interact with another pair apart, in pair order); ``triton``
launches batch_memcpy_kernel as upstream does, with nothing added on the host. Real Triton
cannot run under tests/ut (its conftest mocks ``triton.runtime``), so a launch is a host model
of one unordered launch: every pair a memmove of its own, pairs in reverse order (one legal
schedule, and the adversarial one for pair order). Oracle: numpy memmove of every pair, in pair
order. The launcher on a device (or the Triton interpreter) is tested by
tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_batch_memmove.py.
"""

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.utils import CpuGpuBuffer

from vllm_ascend.ops.triton import batch_memmove
from vllm_ascend.patch.worker import patch_mamba_utils as pm
from vllm_ascend.worker.mamba_copy_checks import MambaCopyValidationError

# (src, dst, size) byte offsets into one pool, per layer: a same-block left shift (the conv
# shift), a move between blocks, a move chained through block 512 (512 -> 768, then 256 -> 512:
# the second must run after the first) and a source shared by two pairs.
LAYERS = {
    "layers.0.linear_attn": [(16, 0, 96), (128, 192, 32), (512, 768, 128), (256, 512, 128)],
    "layers.1.linear_attn": [(1024, 1280, 64), (1024, 1536, 64), (1100, 1090, 40)],
}
PAIRS = [p for pairs in LAYERS.values() for p in pairs]
PATHS = ["whole_batch", "layerwise"]


class UnorderedLaunch:
    def __init__(self):
        self.launches = []

    def __call__(self, src_ptrs, dst_ptrs, sizes):
        pairs = list(zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()))
        self.launches.append(pairs)
        for s, d, n in reversed(pairs):
            ctypes.memmove(d, ctypes.string_at(s, n), n)


def memmove_oracle(pool: np.ndarray, pairs) -> np.ndarray:
    out = pool.copy()
    for s, d, n in pairs:
        out[d : d + n] = out[s : s + n].copy()
    return out


def make_copy_bufs(pool: torch.Tensor, layers=LAYERS):
    """MambaCopyBuffers as the pointer collector leaves them: pointer tables (and, per layer, their rows)."""
    base = pool.data_ptr()
    dtypes = (torch.int64, torch.int64, torch.int32)
    tables = [CpuGpuBuffer(16, dtype=dtype, device=torch.device("cpu"), pin_memory=False) for dtype in dtypes]
    metadata = {
        name: ([base + s for s, _, _ in p], [base + d for _, d, _ in p], [n for *_, n in p])
        for name, p in layers.items()
    }
    rows = [row for columns in metadata.values() for row in zip(*columns)]
    for i, row in enumerate(rows):
        for table, value in zip(tables, row):
            table.np[i] = value
    return SimpleNamespace(
        src_ptrs=tables[0],
        dst_ptrs=tables[1],
        sizes=tables[2],
        offset=len(rows),
        _layer_copy_metadata=metadata,
        _layer_copy_slices={},
        _layer_copy_staged=False,
        _layer_tensor_copy_pairs={},
        _tensor_copy_pairs=[],
    )


def run(copy_bufs, path: str) -> None:
    """Stage the tables as preprocess_mamba does, then copy the whole batch or layer by layer."""
    if path == "layerwise":
        pm.prepare_mamba_copy_by_layer(copy_bufs)
        for name in list(copy_bufs._layer_copy_metadata):
            pm.do_mamba_copy_block_for_layer(copy_bufs, name)
        return
    pm._stage_mamba_copy_metadata(copy_bufs)
    pm._do_mamba_copy_block_npu(copy_bufs)


@pytest.fixture
def launches(monkeypatch):
    """The kernel launches of each pointer backend, replaced by UnorderedLaunch."""
    launches = {"memmove": UnorderedLaunch(), "triton": UnorderedLaunch()}
    monkeypatch.setattr(batch_memmove, "_launch", launches["memmove"])
    monkeypatch.setattr(pm, "_batch_memcpy_triton", launches["triton"])
    return launches


def use_backend(monkeypatch, backend):
    monkeypatch.setattr(pm, "_MAMBA_COPY_BACKEND", backend)


def test_memmove_is_an_accepted_backend(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_MAMBA_COPY_BACKEND", "memmove")
    assert pm._mamba_copy_backend() == "memmove"


@pytest.mark.parametrize("path", PATHS)
def test_memmove_equals_pair_order_memmove(monkeypatch, launches, path):
    use_backend(monkeypatch, "memmove")
    pool = torch.randint(0, 256, (2048,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = memmove_oracle(pool.numpy(), PAIRS)
    run(make_copy_bufs(pool), path)
    np.testing.assert_array_equal(pool.numpy(), expected)
    # The chained pairs (rows 2 and 3) run apart, in pair order; everything else in one launch a layer.
    assert len(launches["memmove"].launches) == (3 if path == "whole_batch" else 4)
    assert not launches["triton"].launches


@pytest.mark.parametrize("path", PATHS)
def test_triton_launches_batch_memcpy_as_upstream_with_no_host_checks(monkeypatch, launches, path):
    """A/B: one unchecked launch of the staged rows (a layer's on the layerwise path), even for a chain."""

    def fail(*args):
        raise AssertionError("pointer tables checked on the triton path")

    use_backend(monkeypatch, "triton")
    monkeypatch.setattr(pm, "validate_copy_batch", fail)
    monkeypatch.setattr(pm, "conflicting_pairs", fail)
    pool = torch.zeros(2048, dtype=torch.uint8)
    run(make_copy_bufs(pool), path)
    base = pool.data_ptr()
    rows = [(base + s, base + d, n) for s, d, n in PAIRS]
    expected = [rows] if path == "whole_batch" else [rows[:4], rows[4:]]
    assert launches["triton"].launches == expected
    assert not launches["memmove"].launches


@pytest.mark.parametrize(
    ("row", "column", "value", "what"),
    [
        (1, 1, lambda base: 0, "destination address <= 0"),
        (2, 2, lambda base: -4, "size outside"),
        (5, 1, lambda base: base + 1030, r"destination overlaps its source from above \(dst > src\)"),
    ],
    ids=["null destination", "negative size", "right overlap"],
)
@pytest.mark.parametrize("path", PATHS)
def test_memmove_refuses_bad_tables_before_any_launch(monkeypatch, launches, path, row, column, value, what):
    use_backend(monkeypatch, "memmove")
    pool = torch.randint(0, 256, (2048,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    before = pool.clone()
    copy_bufs = make_copy_bufs(pool)
    name = list(LAYERS)[row // 4]
    getattr(copy_bufs, ("src_ptrs", "dst_ptrs", "sizes")[column]).np[row] = value(pool.data_ptr())
    copy_bufs._layer_copy_metadata[name][column][row % 4] = value(pool.data_ptr())
    with pytest.raises(MambaCopyValidationError, match=f"copy {row} of 7: {what}"):
        run(copy_bufs, path)
    assert not launches["memmove"].launches
    assert torch.equal(pool, before)


def test_default_backend_checks_nothing(monkeypatch):
    """`torch` (the default) copies tensors, so no host check of the pointer tables runs on it."""

    def fail(*args):
        raise AssertionError("pointer tables checked on the torch path")

    use_backend(monkeypatch, "torch")
    monkeypatch.setattr(pm, "validate_copy_batch", fail)
    monkeypatch.setattr(pm, "conflicting_pairs", fail)
    pm.prepare_mamba_copy_by_layer(make_copy_bufs(torch.zeros(2048, dtype=torch.uint8)))
    pm._stage_mamba_copy_metadata(make_copy_bufs(torch.zeros(2048, dtype=torch.uint8)))
