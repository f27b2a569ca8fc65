# SPDX-License-Identifier: Apache-2.0
"""Bad copy metadata is refused on the host before the memmove kernel is launched.

A bad address does not raise inside a Triton kernel: on a device it corrupts memory or faults
later, and under the Triton interpreter it kills the process (segfault). These tests drive the
fork's ``do_mamba_copy_block`` with the real ``batch_memmove`` kernel bound as the pointer
backend and check that each bad input raises ``MambaCopyValidationError`` naming the pair,
with no launch and no byte changed. ``test_control_*`` shows, under the interpreter only and in
a child process, that the same bad address passed straight to the kernel kills the process.
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
from vllm.v1.worker import mamba_utils

from vllm_ascend.ops.triton.batch_memmove import batch_memmove
from vllm_ascend.worker import mamba_state_copy as msc

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def _device() -> str:
    if hasattr(torch, "npu") and torch.npu.is_available():
        return "npu"
    if torch.cuda.is_available() and not INTERPRETER:
        return "cuda"
    return "cpu"


DEVICE = _device()
BAD_ADDRESS = 0x10  # never mapped


class _Buffer:
    """The CpuGpuBuffer surface the copy path uses: a numpy view and copy_to_gpu(n)."""

    def __init__(self, n: int, dtype: torch.dtype):
        self.cpu = torch.zeros(n, dtype=dtype)
        self.np = self.cpu.numpy()

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        return self.cpu[:n].to(DEVICE).clone()


class _CopyBufs:
    def __init__(self, n: int = 8):
        self.src_ptrs = _Buffer(n, torch.int64)
        self.dst_ptrs = _Buffer(n, torch.int64)
        self.sizes = _Buffer(n, torch.int32)
        self.offset = 0


@pytest.fixture
def memmove_backend(monkeypatch):
    """Bind the memmove backend; count launches that reach the kernel."""
    launches = []

    def counting_memmove(src_ptrs, dst_ptrs, sizes):
        launches.append(len(sizes))
        batch_memmove(src_ptrs, dst_ptrs, sizes)

    monkeypatch.setattr(mamba_utils, "batch_memcpy", mamba_utils.batch_memcpy)
    monkeypatch.setattr(mamba_utils, "collect_mamba_copy_meta", mamba_utils.collect_mamba_copy_meta)
    monkeypatch.setattr(mamba_utils, "do_mamba_copy_block", mamba_utils.do_mamba_copy_block)
    msc.bind_mamba_state_copy(
        mamba_utils, on_310p=False, pointer_kernels={"memmove": counting_memmove}, backend="memmove"
    )
    yield launches
    msc.bind_mamba_state_copy(mamba_utils, on_310p=False, pointer_kernels={}, backend="torch")


def _pools():
    gen = torch.Generator().manual_seed(0)
    conv = torch.randint(0, 255, (4, 3, 64), dtype=torch.uint8, generator=gen).to(torch.float32).to(DEVICE)
    half = torch.zeros(4, 64, dtype=torch.float16, device=DEVICE)
    return conv, half


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().copy()


def test_valid_batch_runs_through_the_real_kernel(memmove_backend):
    conv, _ = _pools()
    before = _bytes(conv)
    bufs = _CopyBufs()
    row = conv.stride(1) * conv.element_size()
    # same-block conv shift by one row (left overlap) and a move to another block
    msc.record_copy(bufs, conv, conv[1].data_ptr() + row, conv, conv[1].data_ptr(), 2 * row, ("r0", "l0", 0))
    msc.record_copy(bufs, conv, conv[2].data_ptr(), conv, conv[3].data_ptr(), 3 * row, ("r1", "l0", 0))
    mamba_utils.do_mamba_copy_block(bufs)
    if DEVICE != "cpu":
        getattr(torch, DEVICE).synchronize()
    expected = before.copy().reshape(4, -1)
    expected[1, : 2 * row] = before.reshape(4, -1)[1, row : 3 * row]
    expected[3] = before.reshape(4, -1)[2]
    assert memmove_backend == [2]
    np.testing.assert_array_equal(_bytes(conv).reshape(4, -1), expected)


def _bad_cases():
    conv, half = _pools()
    end = conv.data_ptr() + conv.numel() * conv.element_size()
    return (
        conv,
        half,
        {
            "src outside its pool": (conv, BAD_ADDRESS, conv, conv[0].data_ptr(), 64),
            "dst past the end of its pool": (conv, conv[0].data_ptr(), conv, end - 32, 64),
            "negative size": (conv, conv[1].data_ptr(), conv, conv[0].data_ptr(), -4),
            "element-misaligned offset": (conv, conv[1].data_ptr() + 2, conv, conv[0].data_ptr(), 64),
            "dtype mismatch between src and dst": (conv, conv[1].data_ptr(), half, half[0].data_ptr(), 64),
        },
    )


@pytest.mark.parametrize("case", sorted(_bad_cases()[2]))
def test_bad_input_is_refused_before_any_launch(memmove_backend, case):
    conv, half, cases = _bad_cases()
    src_state, src, dst_state, dst, size = cases[case]
    before = (_bytes(conv), _bytes(half))
    bufs = _CopyBufs()
    msc.record_copy(bufs, conv, conv[2].data_ptr(), conv, conv[3].data_ptr(), 128, ("ok-req", "layer.0", 0))
    msc.record_copy(bufs, src_state, src, dst_state, dst, size, ("bad-req", "layer.7", 1))
    with pytest.raises(msc.MambaCopyValidationError, match="bad-req"):
        mamba_utils.do_mamba_copy_block(bufs)
    assert memmove_backend == []  # nothing reached the kernel
    np.testing.assert_array_equal(_bytes(conv), before[0])
    np.testing.assert_array_equal(_bytes(half), before[1])


def test_buffers_of_different_lengths_are_refused(memmove_backend):
    conv, _ = _pools()
    bufs = _CopyBufs()
    msc.record_copy(bufs, conv, conv[2].data_ptr(), conv, conv[3].data_ptr(), 128, ("r", "l", 0))
    bufs.offset = 2  # a pointer/size entry the collector did not record
    with pytest.raises(msc.MambaCopyValidationError, match="different lengths"):
        mamba_utils.do_mamba_copy_block(bufs)
    assert memmove_backend == []


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
