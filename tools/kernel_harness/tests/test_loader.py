"""The harness registers light vllm_ascend packages without running the real __init__s."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.kernel_harness import loader

ROOT = Path(__file__).resolve().parents[3]


def run_py(code: str, tree: str, **env):
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        # keep an inherited PYTHONPATH: Triton may live in a --target dir (the test env's triton-site)
        env={
            "PATH": "/usr/bin:/bin",
            "KERNEL_TREE": tree,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
            **env,
        },
        timeout=300,
    )


def npu_tree(root: Path, version: str = "0.27.1rc1") -> Path:
    """A tree like 0.27.1rc1's: the kernel file picks its body with vllm_ascend.utils, which imports torch_npu."""
    pkg = root / "vllm_ascend"
    (pkg / "ops" / "triton" / "mamba").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('heavy package init ran')\n")
    (pkg / "utils.py").write_text("import torch_npu  # noqa: F401\n\n\ndef vllm_version_is(v):\n    return True\n")
    (pkg / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    (pkg / "ops" / "triton" / "mamba" / "probe.py").write_text(
        "from vllm_ascend.utils import vllm_version_is\n"
        "BODY = 'for vLLM 0.27.1' if vllm_version_is('0.27.1') else 'for other vLLM'\n"
    )
    return root


def test_kernel_module_imports_from_the_tree_without_package_init(tmp_path):
    pkg = tmp_path / "vllm_ascend"
    (pkg / "ops" / "triton" / "mamba").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('heavy package init ran')\n")
    (pkg / "ops" / "__init__.py").write_text("raise RuntimeError('heavy ops init ran')\n")
    (pkg / "ops" / "triton" / "probe.py").write_text(
        "from vllm.triton_utils import tl, triton\nTL = tl\nJIT = triton.jit\n"
    )
    code = (
        "import os\n"
        "from tools.kernel_harness import loader\n"
        "info = loader.setup(loader.split_roots(os.environ['KERNEL_TREE']))\n"
        "import triton, triton.language as tl\n"
        "from vllm_ascend.ops.triton import probe\n"
        "assert probe.TL is tl and probe.JIT is triton.jit\n"
        "assert probe.__file__.startswith(os.environ['KERNEL_TREE'])\n"
        "print(info['interpreter'], os.environ['TRITON_INTERPRET'], repr(os.environ['CUDA_VISIBLE_DEVICES']))\n"
    )
    proc = run_py(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].split() == ["True", "1", "''"]  # vLLM may log above it


def test_not_a_tree_is_a_clear_error(tmp_path):
    code = f"from tools.kernel_harness import loader\nloader.register_tree([loader.Path('{tmp_path}')])\n"
    proc = run_py(code, str(tmp_path))
    assert proc.returncode != 0 and "is not a vllm-ascend tree" in proc.stderr


def test_kernel_importing_a_torch_npu_module_loads_with_the_utils_stub(tmp_path):
    tree = npu_tree(tmp_path)
    code = (
        "import os, sys\n"
        "from tools.kernel_harness import loader\n"
        "loader.register_tree(loader.split_roots(os.environ['KERNEL_TREE']))\n"
        "from vllm_ascend.ops.triton.mamba import probe\n"
        "assert 'torch_npu' not in sys.modules\n"
        "print(probe.BODY)\n"
    )
    picked = {}
    for vllm in ("0.27.1", "0.30.0"):
        proc = run_py(code, str(tree), VLLM_VERSION=vllm)
        assert proc.returncode == 0, proc.stderr
        picked[vllm] = proc.stdout.splitlines()[-1]
    assert picked == {"0.27.1": "for vLLM 0.27.1", "0.30.0": "for other vLLM"}


def test_the_tree_without_the_stub_needs_torch_npu(tmp_path):
    """The premise of the stub: with the tree's own vllm_ascend.utils the kernel does not load here."""
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed: the stub is not what makes the kernel importable here")
    code = (
        "import os, sys\n"
        "from tools.kernel_harness import loader\n"
        "loader.register_tree(loader.split_roots(os.environ['KERNEL_TREE']))\n"
        "del sys.modules['vllm_ascend.utils'], sys.modules['vllm_ascend'].utils\n"
        "from vllm_ascend.ops.triton.mamba import probe\n"
    )
    proc = run_py(code, str(npu_tree(tmp_path)))
    assert proc.returncode != 0 and "No module named 'torch_npu'" in proc.stderr, proc.stderr


def test_vllm_version_without_vllm_is_the_trees_x_y_z(tmp_path, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delenv("VLLM_VERSION", raising=False)
    monkeypatch.setattr(loader.importlib.metadata, "version", not_installed)
    assert loader.vllm_version([npu_tree(tmp_path / "a", "0.27.1rc1")]) == "0.27.1"
    assert loader.vllm_version([npu_tree(tmp_path / "b", "0.23.0.post1")]) == "0.23.0"
    monkeypatch.setenv("VLLM_VERSION", "0.26.0")
    assert loader.vllm_version([tmp_path / "a"]) == "0.26.0"


def test_a_name_the_stub_lacks_is_an_error_naming_the_stub(tmp_path):
    tree = npu_tree(tmp_path)
    code = (
        "import os\n"
        "from tools.kernel_harness import loader\n"
        "loader.register_tree(loader.split_roots(os.environ['KERNEL_TREE']))\n"
        "from vllm_ascend.utils import global_stream\n"
    )
    proc = run_py(code, str(tree))
    assert proc.returncode != 0 and "cannot import name 'global_stream'" in proc.stderr, proc.stderr
    assert "kernel harness stub" in proc.stderr, proc.stderr


def test_the_interpreter_gets_triton_ascends_extension_ops(tmp_path):
    """extract_slice / insert_slice / get_element under the interpreter, against numpy."""
    pkg = tmp_path / "vllm_ascend"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "ops" / "triton" / "probe.py").write_text(
        "from triton.language.extra.cann.extension import extract_slice, get_element, insert_slice\n"
        "from vllm.triton_utils import tl, triton\n\n\n"
        "@triton.jit\n"
        "def probe(x_ptr, out_ptr, one_ptr):\n"
        "    i = tl.arange(0, 8)\n"
        "    x = tl.load(x_ptr + i[:, None] * 8 + i[None, :])\n"
        "    sub = extract_slice(x, (2, 1), (2, 4), (1, 2))\n"
        "    y = insert_slice(tl.zeros((8, 8), tl.float32), sub * 10, (5, 0), (2, 4), (1, 1))\n"
        "    tl.store(out_ptr + i[:, None] * 8 + i[None, :], y)\n"
        "    tl.store(one_ptr, get_element(x, (3, 6)))\n"
    )
    code = (
        "import os\n"
        "from tools.kernel_harness import loader\n"
        "loader.setup(loader.split_roots(os.environ['KERNEL_TREE']))\n"
        "import numpy as np, torch\n"
        "from vllm_ascend.ops.triton.probe import probe\n"
        "x = torch.arange(64, dtype=torch.float32).view(8, 8)\n"
        "out, one = torch.full((8, 8), -1.0), torch.zeros(1)\n"
        "probe[(1,)](x, out, one)\n"
        "expected = np.zeros((8, 8), np.float32)\n"
        "expected[5:7, 0:4] = x.numpy()[2:4, 1:8:2] * 10\n"
        "assert np.array_equal(out.numpy(), expected), out\n"
        "assert one.item() == x[3, 6].item(), one\n"
        "print('ok')\n"
    )
    proc = run_py(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "ok"
