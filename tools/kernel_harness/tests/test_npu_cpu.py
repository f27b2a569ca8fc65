"""`--npu-on-cpu`: upstream's NPU op tests run on CPU tensors under the interpreter (kernel_harness/npu_cpu.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

KERNEL = """\
from vllm.triton_utils import tl, triton


@triton.jit
def add_one_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask) + 1, mask=mask)
"""

# Written as upstream writes its NPU op tests: an NPU guard, device "npu", torch.npu calls, a graph.
NPU_TEST = """\
import pytest
import torch

from vllm_ascend.ops.triton.add_one import add_one_kernel

pytestmark = pytest.mark.skipif(not torch.npu.is_available(), reason="NPU required")


def test_npu_tensors_are_cpu_tensors():
    x = torch.arange(4, dtype=torch.int32, device="npu")
    y = torch.zeros(4, device=torch.device("npu:0")).to("npu").npu()
    z = torch.full_like(x, 3).to(device="npu:0", dtype=torch.float32)
    assert {t.device.type for t in (x, y, z)} == {"cpu"}
    torch.npu.synchronize()
    torch.accelerator.synchronize()
    torch.npu.empty_cache()
    torch.npu.reset_peak_memory_stats()
    assert torch.npu.device_count() == 1 and torch.npu.current_device() == 0


def test_seeding_the_npu_seeds_what_npu_tensors_draw():
    torch.npu.manual_seed(7)
    a = torch.rand(5, device="npu")
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(5, device="npu"))


def test_kernel_runs_on_npu_tensors():
    src = torch.arange(8, dtype=torch.int32, device="npu")
    dst = torch.zeros_like(src)
    add_one_kernel[(1,)](src, dst, 8, BLOCK=8)
    torch.npu.synchronize()
    assert dst.tolist() == list(range(1, 9))


def test_a_graph_replays_its_launches_on_the_inputs_of_the_replay():
    src = torch.arange(8, dtype=torch.int32, device="npu")
    dst = torch.zeros_like(src)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        add_one_kernel[(1,)](src, dst, 8, BLOCK=8)
    assert dst.tolist() == [0] * 8  # captured, not run (as on a device)
    src.fill_(10)
    graph.replay()
    assert dst.tolist() == [11] * 8
    src.fill_(20)
    graph.replay()
    assert dst.tolist() == [21] * 8
    dst.zero_()
    add_one_kernel[(1,)](src, dst, 3, BLOCK=8)  # after the capture, launches run at once again
    assert dst.tolist() == [21] * 3 + [0] * 5


def test_npu_operators_are_absent():
    with pytest.raises(ImportError):
        import torch_npu  # noqa: F401
"""


@pytest.fixture
def tree(tmp_path):
    kernels = tmp_path / "tree" / "vllm_ascend" / "ops" / "triton"
    kernels.mkdir(parents=True)
    (kernels / "add_one.py").write_text(KERNEL)
    test = tmp_path / "tree" / "tests" / "test_on_npu.py"
    test.parent.mkdir()
    test.write_text(NPU_TEST)
    return tmp_path / "tree"


def run_pytest(tree: Path, *options: str, test: str = "test_on_npu.py") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rA",
            "-p",
            "no:cacheprovider",
            "--noconftest",
            "-p",
            "tools.kernel_harness.plugin",
            f"--kernel-tree={tree}",
            f"--rootdir={tree}",
            *options,
            str(tree / "tests" / test),
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "TRITON_INTERPRET": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
        },
        timeout=600,
    )


def test_upstream_style_npu_tests_run_on_the_cpu(tree):
    proc = run_pytest(tree, "--npu-on-cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "5 passed" in proc.stdout
    assert "npu=mapped to the CPU" in proc.stdout  # the report header says so


def test_without_the_option_the_npu_is_not_there(tree):
    proc = run_pytest(tree)
    # torch has no `npu` here: the module-level guard itself fails at collection
    assert proc.returncode != 0
    assert "has no attribute 'npu'" in proc.stdout, proc.stdout[-3000:]


# An op test sized for a device's concurrency, as upstream's shift tests are.
SIZED_TEST = """\
NUM_SHIFTED_ROWS = 2048
NUM_LONG_SHIFTS = 256
NUM_OTHER = 7


def test_sizes():
    assert (NUM_SHIFTED_ROWS, NUM_LONG_SHIFTS, NUM_OTHER) == (16, 4, 7)
"""


def test_the_interpreter_runs_device_sized_tests_at_its_own_sizes(tree):
    (tree / "tests" / "test_sized.py").write_text(SIZED_TEST)
    proc = run_pytest(tree, "--npu-on-cpu", test="test_sized.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
