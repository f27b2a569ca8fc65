"""pytest plugin that runs vllm-ascend's device-generic Triton op tests anywhere.

Upstream's `tests/e2e/conftest.py` imports vLLM's engine, modelscope and needs
an NPU, so the op tests under `tests/e2e/nightly/single_node/ops/singlecard_ops/
triton/` are run with `--noconftest` and this plugin instead:

    python -m pytest -p tools.kernel_harness.plugin --noconftest \\
        --kernel-tree build/fork \\
        build/fork/tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_batch_memmove.py

It (a) switches to the Triton interpreter (CUDA_VISIBLE_DEVICES="",
TRITON_INTERPRET=1) when there is no GPU/NPU, before any kernel is imported;
(b) provides `vllm.triton_utils` when vLLM is not installed; (c) registers light
`vllm_ascend...` packages pointing at the tree under test so that importing a
kernel module skips the heavy package `__init__`s. The tree is `--kernel-tree`
or $KERNEL_TREE (several roots joined with os.pathsep; the first wins).
With `--npu-on-cpu` (interpreter only) it (d) maps the NPU to the CPU for
upstream's NPU op tests (`npu_cpu.py`). Under the interpreter it (e) scales
device-sized op tests down: the module constants in INTERPRETER_SIZES.
"""

from __future__ import annotations

import os

from tools.kernel_harness import loader

# The interpreter runs one program after another, about 0.5 ms a copy block: op tests that size a
# launch for a device's concurrency (thousands of rows shifted in place, to give a race its chances)
# run with these values of their module constants instead. The race itself shows on a device only.
INTERPRETER_SIZES = {"NUM_SHIFTED_ROWS": 16, "NUM_LONG_SHIFTS": 4}


def pytest_addoption(parser):
    group = parser.getgroup("kernel_harness")
    group.addoption(
        "--kernel-tree",
        default=os.environ.get(loader.TREE_ENV),
        help="vllm-ascend tree(s) whose kernels are tested (os.pathsep-separated; default $KERNEL_TREE)",
    )
    group.addoption(
        "--npu-on-cpu",
        action="store_true",
        help="map the NPU to the CPU (torch.npu, device 'npu', torch_npu) for upstream's NPU op tests "
        "under the interpreter (tools/kernel_harness/npu_cpu.py)",
    )


def pytest_configure(config):
    roots = loader.split_roots(config.getoption("--kernel-tree") or "")
    try:
        info = loader.setup(roots)
    except loader.HarnessError as exc:
        raise SystemExit(f"kernel_harness: {exc}") from exc
    if config.getoption("--npu-on-cpu"):
        if not info["interpreter"]:
            raise SystemExit("kernel_harness: --npu-on-cpu runs the kernels under the Triton interpreter only")
        from tools.kernel_harness import npu_cpu

        try:
            npu_cpu.install()
        except RuntimeError as exc:
            raise SystemExit(f"kernel_harness: {exc}") from exc
        info["npu"] = "mapped to the CPU (--npu-on-cpu)"
    config._kernel_harness_info = info
    # The interpreter converts 1-element arrays with int() on every scalar use.
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def pytest_report_header(config):
    info = getattr(config, "_kernel_harness_info", None)
    if not info:
        return None
    import triton

    mode = "interpreter (TRITON_INTERPRET=1)" if info["interpreter"] else "device"
    return (
        f"kernel_harness: tree={os.pathsep.join(info['roots'])} triton={triton.__version__} "
        f"mode={mode} vllm.triton_utils={info['triton_utils']}" + (f" npu={info['npu']}" if "npu" in info else "")
    )


def pytest_collection_modifyitems(config, items):
    info = getattr(config, "_kernel_harness_info", None)
    if not info or not info["interpreter"]:
        return
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        for name, value in INTERPRETER_SIZES.items():
            if isinstance(getattr(module, name, None), int):
                setattr(module, name, value)
