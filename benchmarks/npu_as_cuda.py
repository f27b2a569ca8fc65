"""pytest plugin (and helper) for a CUDA GPU: the op tests' `npu` device becomes `cuda`.

The upstream-bound op tests are written as upstream writes them: device "npu", skipped without
`torch.npu`. On a CUDA GPU host there is no torch_npu, so `install()` gives torch an `npu` module
(`is_available`, `synchronize`, `device_count`, `current_device`, seeds, `NPUGraph` / `graph`
and `torch.accelerator.synchronize` answered by CUDA) and, for the
whole process, a torch function mode that turns every `npu` device a torch function is given
(`device=` of factory functions, `Tensor.to("npu")`) into `cuda`: the kernel harness's mapping
(`tools/kernel_harness/npu_cpu.device_mode`), which `--npu-on-cpu` points at the CPU.

    python -m pytest -p tools.kernel_harness.plugin -p benchmarks.npu_as_cuda --noconftest ...
"""

from __future__ import annotations

import types


def install() -> None:
    import torch

    from tools.kernel_harness.npu_cpu import device_mode

    if getattr(getattr(torch, "npu", None), "_npu_as_cuda", False):
        return
    if hasattr(torch, "npu") or not torch.cuda.is_available():
        raise RuntimeError("npu_as_cuda: needs a CUDA GPU and no torch_npu")
    torch.utils.rename_privateuse1_backend("npu")  # torch.device("npu:0") parses
    npu = types.ModuleType("torch.npu", "the NPU mapped to CUDA (benchmarks/npu_as_cuda.py)")
    npu._npu_as_cuda = True
    npu.is_available = lambda: True
    npu.synchronize = torch.cuda.synchronize
    npu.device_count = torch.cuda.device_count
    npu.current_device = torch.cuda.current_device
    npu.get_device_name = torch.cuda.get_device_name
    npu.manual_seed = torch.cuda.manual_seed
    npu.manual_seed_all = torch.cuda.manual_seed_all
    npu.empty_cache = torch.cuda.empty_cache
    npu.NPUGraph = torch.cuda.CUDAGraph  # record and replay: CUDA graphs
    npu.graph = torch.cuda.graph
    torch._register_device_module("npu", npu)
    # torch.accelerator would ask the renamed PrivateUse1 backend, which has no device here
    torch.accelerator.synchronize = lambda *args, **kwargs: torch.cuda.synchronize()

    device_mode("cuda").__enter__()  # for the whole process, as the CPU mapping does


def pytest_configure(config):
    install()
