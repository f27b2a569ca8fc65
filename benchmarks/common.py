"""Shared plumbing for the copy-path benchmarks and stress runs (device choice, kernels, versions)."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.kernel_harness import loader  # noqa: E402

DEFAULT_TREES = [ROOT, ROOT / "build" / "fork"]
# The block memmove's kernel is launched with in these runs (the best of the H200 sweeps, benchmarks/RESULTS.md).
# GPU tuning stays here; vllm-ascend's launcher keeps its Ascend block (batch_memmove.BLOCK_SIZE).
MEMMOVE_BLOCK = 32768


def memmove_launcher(module):
    """The kernel ``module.batch_memmove`` launches (batch_memcpy_kernel, one program a pair), with
    benchmark parameters (block, warps), in one launch."""

    def launch(src, dst, sizes, *, block_size=MEMMOVE_BLOCK, num_warps=None):
        extra = {} if num_warps is None else {"num_warps": num_warps}
        if src.shape[0]:
            module.batch_memcpy_kernel[(src.shape[0],)](src, dst, sizes, BLOCK_SIZE=block_size, **extra)

    return launch


def setup_kernels(trees=None, base_tree=None):
    """Import the kernel modules from the tree(s); returns a namespace dict.

    `base_tree` (optional) is an unpatched vllm-ascend tree whose fused postprocess
    kernel and batch_memcpy_kernel are the unguarded controls (the fork's batch_memcpy_kernel
    carries the left-overlap guard).
    """
    roots = loader.split_roots(trees) if trees else [p for p in DEFAULT_TREES if p.exists()]
    info = loader.setup(roots)
    import torch  # noqa: F401  (after the interpreter decision)

    from benchmarks import vllm_copy_specs

    specs = vllm_copy_specs.install()  # vLLM's copy functions, or models of them without vLLM
    from vllm_ascend.ops.triton import batch_memcpy, batch_memmove
    from vllm_ascend.ops.triton.mamba import postprocess
    from vllm_ascend.worker import mamba_copy_groups

    kernels = {
        "info": info,
        "copy_groups": mamba_copy_groups,
        "copy_specs": specs,
        "batch_memcpy_kernel": batch_memcpy.batch_memcpy_kernel,
        "batch_memmove": memmove_launcher(batch_memmove),
        "memmove_module": batch_memmove,
        "postprocess_guarded": postprocess.postprocess_mamba_fused_kernel,
        "postprocess_unguarded": None,
        "batch_memcpy_unguarded": None,
    }
    if base_tree:
        triton_dir = Path(base_tree) / "vllm_ascend" / "ops" / "triton"
        path = triton_dir / "mamba" / "postprocess.py"
        kernels["postprocess_unguarded"] = loader.load_file(path, "_base_postprocess").postprocess_mamba_fused_kernel
        path = triton_dir / "batch_memcpy.py"
        kernels["batch_memcpy_unguarded"] = loader.load_file(path, "_base_batch_memcpy").batch_memcpy_kernel
    return kernels


def select_device(requested: str = "auto") -> str:
    import torch

    if requested != "auto":
        return requested
    if hasattr(torch, "npu") and torch.npu.is_available():
        return "npu"
    if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "npu":
        torch.npu.synchronize()


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    if device == "npu":
        return torch.npu.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"


def versions() -> dict:
    import numpy
    import torch
    import triton

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": numpy.__version__,
    }
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    try:
        import torch_npu

        out["torch_npu"] = torch_npu.__version__
    except Exception:
        pass
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
