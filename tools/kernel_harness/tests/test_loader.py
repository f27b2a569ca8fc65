"""The harness registers light vllm_ascend packages without running the real __init__s."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_py(code: str, tree: str):
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
        },
        timeout=300,
    )


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
