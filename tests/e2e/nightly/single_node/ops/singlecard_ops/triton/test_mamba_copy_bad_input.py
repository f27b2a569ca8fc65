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
"""Bad Mamba copy metadata is refused on the host before the memmove kernel runs; device-generic.

Runs on `npu`, else `cuda`, else the CPU under the Triton interpreter. A bad address
does not raise inside a kernel: on a device it corrupts memory, under the
interpreter it kills the process (the control test, run in a subprocess).
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_ascend.ops.triton.batch_memmove import batch_memmove
from vllm_ascend.worker.mamba_copy_checks import MambaCopyValidationError, validate_copy_batch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def _device() -> str:
    if hasattr(torch, "npu") and torch.npu.is_available():
        return "npu"
    if torch.cuda.is_available() and not INTERPRETER:
        return "cuda"
    return "cpu"


DEVICE = _device()
BAD_ADDRESS = 0x10  # never mapped


def _checked_memmove(pool: torch.Tensor, src, dst, sizes):
    """The launch path: host tables validated against the pool, then one batch_memmove launch."""
    start = pool.data_ptr()
    validate_copy_batch(src, dst, sizes, {start: start + pool.numel() * pool.element_size()})
    batch_memmove(
        torch.tensor(src, dtype=torch.int64, device=DEVICE),
        torch.tensor(dst, dtype=torch.int64, device=DEVICE),
        torch.tensor(sizes, dtype=torch.int32, device=DEVICE),
    )
    if DEVICE != "cpu":
        getattr(torch, DEVICE).synchronize()


def _pool():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 255, (4, 3, 64), dtype=torch.uint8, generator=gen).to(torch.float32).to(DEVICE)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().copy()


def test_valid_batch_runs_through_the_real_kernel():
    conv = _pool()
    before = _bytes(conv).reshape(4, -1)
    row = conv.stride(1) * conv.element_size()
    # same-block conv shift by one row (left overlap) and a move to another block
    _checked_memmove(conv, [conv[1].data_ptr() + row, conv[2].data_ptr()], [conv[1].data_ptr(), conv[3].data_ptr()],
                     [2 * row, 3 * row])  # fmt: skip
    expected = before.copy()
    expected[1, : 2 * row] = before[1, row : 3 * row]
    expected[3] = before[2]
    np.testing.assert_array_equal(_bytes(conv).reshape(4, -1), expected)


@pytest.mark.parametrize("case", ["src outside its pool", "dst past the end of its pool", "negative size"])
def test_bad_input_is_refused_before_any_launch(case):
    conv = _pool()
    before = _bytes(conv)
    end = conv.data_ptr() + conv.numel() * conv.element_size()
    bad = {
        "src outside its pool": (BAD_ADDRESS, conv[0].data_ptr(), 64),
        "dst past the end of its pool": (conv[0].data_ptr(), end - 32, 64),
        "negative size": (conv[1].data_ptr(), conv[0].data_ptr(), -4),
    }[case]
    with pytest.raises(MambaCopyValidationError, match="copy 1 of 2"):
        _checked_memmove(conv, [conv[2].data_ptr(), bad[0]], [conv[3].data_ptr(), bad[1]], [128, bad[2]])
    np.testing.assert_array_equal(_bytes(conv), before)  # nothing reached the kernel


@pytest.mark.skipif(not INTERPRETER, reason="a deliberate bad address is only run under the Triton interpreter")
def test_control_unchecked_bad_address_kills_the_interpreter():
    """Without the host check the same address reaches the kernel and the process dies."""
    spec = importlib.util.find_spec("vllm_ascend.ops.triton.batch_memmove")
    kernel_file = Path(spec.origin)
    code = textwrap.dedent(
        f"""
        import importlib.util, torch
        spec = importlib.util.spec_from_file_location("bm", {str(kernel_file)!r})
        bm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bm)
        dst = torch.zeros(64, dtype=torch.uint8)
        bm.batch_memmove(torch.tensor([{BAD_ADDRESS}]), torch.tensor([dst.data_ptr()]),
                         torch.tensor([64], dtype=torch.int32))
        print("survived")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode < 0 and "survived" not in proc.stdout, (proc.returncode, proc.stderr[-2000:])
