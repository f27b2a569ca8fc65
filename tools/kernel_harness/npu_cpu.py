"""Run upstream's NPU op tests on the CPU: the `npu` device mapped to the CPU, in the test process only.

Upstream's Triton op tests under `tests/e2e/nightly/single_node/ops/singlecard_ops/triton/` are
written for an NPU: `torch.npu.is_available()` guards, `device="npu"` / `torch.device("npu:0")`,
`torch.npu.synchronize()`, `torch.npu.NPUGraph`. `install()` makes those work on CPU tensors
without editing the tests, so the kernels they call run under the Triton interpreter:

- the PrivateUse1 backend is named `npu`, so `torch.device("npu:0")` parses;
- a torch function mode rewrites every `npu` device a torch function is given (factory functions'
  `device=`, `Tensor.to("npu")`, ...) to `cpu`, and `Tensor.npu()` returns the tensor itself;
- `torch.npu` is a small module: `is_available()` True, one device, `synchronize`, `empty_cache`
  and the memory-statistics resets do nothing, `manual_seed*` seed the CPU generator, and
  `NPUGraph` / `graph` record the Triton launches made inside `with torch.npu.graph(g):` and run
  them again on `g.replay()` (as a device graph does; torch ops inside the block run at once);
- `torch_npu` is left out on purpose: a `torch_npu` that imports makes transformers and vLLM take
  their NPU paths (`from torch_npu import npu_fusion_attention`) and `import vllm` fails. A test
  that imports torch_npu (for its NPU operators) fails on the base as well, and `test`
  import-checks it only (in upstream's CPU set-up, whose tests/ut/conftest.py stubs torch_npu).

`torch.accelerator` keeps answering for the CPU (no accelerator), except `synchronize()`, which
does nothing. Nothing here runs unless asked for: `--npu-on-cpu` (tools/kernel_harness/plugin.py).
"""

from __future__ import annotations

import sys
import types

SHIM = "kernel harness npu-on-cpu shim"


def _is_npu(device) -> bool:
    import torch

    if isinstance(device, torch.device):
        return device.type == "npu"
    if isinstance(device, str):
        return device == "npu" or device.startswith("npu:")
    return False


def device_mode(target: str):
    """A torch function mode that turns every `npu` device handed to a torch function (factory
    functions' `device=`, `x.to("npu")`, `x.to(torch.device("npu", 0), dtype)`) into `target`."""
    import torch
    from torch.overrides import TorchFunctionMode

    def mapped(value):
        return torch.device(target) if _is_npu(value) else value

    class NpuTo(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "device" in kwargs:
                kwargs = {**kwargs, "device": mapped(kwargs["device"])}
            if func is torch.Tensor.to:
                args = tuple(mapped(a) for a in args)
            return func(*args, **kwargs)

    return NpuTo()


class _Graph:
    """`torch.npu.NPUGraph` on the CPU: the Triton launches captured inside `torch.npu.graph(g)`."""

    def __init__(self, *args, **kwargs):
        self.launches: list = []

    def replay(self):
        for run, fn, args, kwargs in self.launches:
            run(fn, *args, **kwargs)

    def reset(self):
        self.launches = []

    def capture_begin(self, *args, **kwargs):
        _capture_begin(self)

    def capture_end(self):
        _capture_end()


_capturing: list = []  # the graph being captured (at most one)


def _launcher():
    """The interpreter's launch entry point (`kernel[grid](...)` calls `run(..., grid=..., warmup=False)`)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction


def _capture_begin(graph: _Graph) -> None:
    cls = _launcher()
    run = cls.run

    def capture(fn, *args, **kwargs):
        if kwargs.get("warmup"):
            return run(fn, *args, **kwargs)
        graph.launches.append((run, fn, args, kwargs))
        return None

    _capturing.append((graph, run))
    cls.run = capture


def _capture_end() -> None:
    graph, run = _capturing.pop()
    _launcher().run = run


class _GraphContext:
    def __init__(self, graph, *args, **kwargs):
        self.graph = graph

    def __enter__(self):
        self.graph.reset()
        _capture_begin(self.graph)
        return self.graph

    def __exit__(self, *exc):
        _capture_end()
        return False


def _npu_module() -> types.ModuleType:
    import torch

    npu = types.ModuleType("torch.npu", f"{SHIM}: the NPU mapped to the CPU")
    npu.__kernel_harness__ = True
    noop = lambda *args, **kwargs: None  # noqa: E731
    npu.is_available = lambda: True
    npu.device_count = lambda: 1
    npu.current_device = lambda: 0
    npu.get_device_name = lambda device=None: f"CPU ({SHIM})"
    npu.set_device = noop
    npu.synchronize = noop
    npu.empty_cache = noop
    npu.reset_peak_memory_stats = noop
    # torch.manual_seed calls the PrivateUse1 module's manual_seed_all: seed the CPU generator only
    npu.manual_seed = npu.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed)) and None
    npu._is_in_bad_fork = lambda: False
    npu.NPUGraph = _Graph
    npu.graph = _GraphContext
    return npu


def installed() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and getattr(getattr(torch, "npu", None), "__kernel_harness__", False))


def install() -> None:
    """Map the NPU to the CPU in this process (idempotent). Refuses where torch already has an `npu`."""
    import torch

    if installed():
        return
    if hasattr(torch, "npu") or "torch_npu" in sys.modules:
        raise RuntimeError(f"{SHIM}: torch already has an NPU backend (torch_npu): run the tests on it instead")
    torch.utils.rename_privateuse1_backend("npu")
    npu = _npu_module()
    torch._register_device_module("npu", npu)  # torch.npu and sys.modules["torch.npu"]
    torch.Tensor.npu = lambda self, *args, **kwargs: self
    torch.accelerator.synchronize = lambda *args, **kwargs: None

    device_mode("cpu").__enter__()  # for the whole process: pytest runs every test in it
