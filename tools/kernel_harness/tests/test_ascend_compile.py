"""The triton-ascend front-end check passes the series' kernels and fails a known-bad one.

Runs the real CLI (it creates build/ascend-venv on first use; the kernels compile in it).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tools.kernel_harness.ascend_compile import KERNELS

ROOT = Path(__file__).resolve().parents[3]
FORK = ROOT / "build" / "fork"
BROKEN = Path(__file__).with_name("broken_kernels.py")


def run(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "tools.kernel_harness.ascend_compile", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return proc.returncode, proc.stdout


@pytest.mark.skipif(not FORK.is_dir(), reason="materialize the fork first: python -m tools.fork apply")
def test_series_kernels_pass_the_front_end():
    rc, out = run("--tree", str(ROOT), "--tree", str(FORK))
    lines = [line for line in out.splitlines() if line.startswith(("OK ", "FAIL ", "SKIP "))]
    assert rc == 0, out
    # DS conv row and tiled variants SKIP on releases whose postprocess kernel lacks them, precopy where it is absent
    assert len(lines) == len(KERNELS) and all(line.startswith(("OK ", "SKIP ")) for line in lines), out
    assert sum(line.startswith("OK ") for line in lines) >= 3, out
    assert "ConvertLinalgRToBinary" in out


@pytest.mark.skipif(not FORK.is_dir(), reason="materialize the fork first: python -m tools.fork apply")
def test_pointer_cast_inside_loop_fails():
    rc, out = run("--tree", str(FORK), "--only", "batch_memcpy", "--extra", f"{BROKEN}:cast_inside_loop_kernel")
    assert rc == 1, out
    assert "OK batch_memcpy_kernel" in out
    fail = [line for line in out.splitlines() if line.startswith("FAIL cast_inside_loop_kernel")]
    assert fail and "ConvertTritonIRToLinalgIR" in fail[0], out


def test_missing_kernel_file_fails(tmp_path):
    (tmp_path / "vllm_ascend" / "ops" / "triton").mkdir(parents=True)
    rc, out = run("--tree", str(tmp_path), "--only", "batch_memcpy")
    assert rc == 1 and "FAIL batch_memcpy_kernel: batch_memcpy.py not found" in out, out


NPU_TREE_KERNEL = """
from vllm.triton_utils import tl, triton

from vllm_ascend.utils import vllm_version_is

if vllm_version_is("0.27.1"):  # the body this tree's own vLLM (0.27.1rc1 -> 0.27.1) runs

    @triton.jit
    def batch_memcpy_kernel(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE: tl.constexpr):
        pid = tl.program_id(0)
        src = tl.load(src_ptrs + pid).to(tl.pointer_type(tl.uint8))
        dst = tl.load(dst_ptrs + pid).to(tl.pointer_type(tl.uint8))
        size = tl.load(sizes + pid)
        offsets = tl.arange(0, BLOCK_SIZE)
        for i in range(0, size, BLOCK_SIZE):
            mask = (i + offsets) < size
            tl.store(dst + i + offsets, tl.load(src + i + offsets, mask=mask), mask=mask)

else:
    raise RuntimeError("the body for another vLLM was chosen")
"""


def test_kernel_importing_a_torch_npu_module_compiles(tmp_path, monkeypatch):
    """A 0.27.1rc1-like tree: its kernel file imports vllm_ascend.utils, which imports torch_npu.

    The triton-ascend venv has no vLLM: the stub's vllm_version_is answers for the tree's own X.Y.Z.
    """
    monkeypatch.delenv("VLLM_VERSION", raising=False)
    pkg = tmp_path / "vllm_ascend"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "utils.py").write_text("import torch_npu  # noqa: F401\n\n\ndef vllm_version_is(v):\n    return True\n")
    (pkg / "_version.py").write_text("__version__ = version = '0.27.1rc1'\n")
    (pkg / "ops" / "triton" / "batch_memcpy.py").write_text(NPU_TREE_KERNEL)
    rc, out = run("--tree", str(tmp_path), "--only", "batch_memcpy")
    assert rc == 0 and "OK batch_memcpy_kernel" in out, out
