"""vLLM's two Mamba state copy functions where vLLM is not installed (a GPU host with torch and Triton alone).

The fork's grouped copy module (`vllm_ascend.worker.mamba_copy_groups`) recognises vLLM's
`get_conv_copy_spec` and `get_temporal_copy_spec` by identity. With vLLM importable its own module
is used; otherwise `install()` registers `vllm.model_executor.layers.mamba.mamba_utils` with models
of the two (SD conv layout), written from their published semantics. Call it after the kernel
harness has set up `vllm.triton_utils`; as a pytest plugin (`-p benchmarks.vllm_copy_specs`) it
does so itself, last.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types

NAME = "vllm.model_executor.layers.mamba.mamba_utils"


@dataclasses.dataclass
class MambaCopySpec:
    start_addr: int
    num_elements: int


def get_conv_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
    src = state[block_ids[cur_block_idx], num_accepted_tokens - 1 :]
    return MambaCopySpec(src.data_ptr(), src.numel())


def get_temporal_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
    src = state[block_ids[cur_block_idx + num_accepted_tokens - 1]]
    return MambaCopySpec(src.data_ptr(), src.numel())


def install() -> types.ModuleType:
    try:
        return importlib.import_module(NAME)
    except ImportError:  # no vLLM (or the kernel harness's two-name shim of it)
        pass
    parent = sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    for name in ("model_executor", "model_executor.layers", "model_executor.layers.mamba", NAME[len("vllm.") :]):
        module = sys.modules.setdefault(f"vllm.{name}", types.ModuleType(f"vllm.{name}"))
        module.__path__ = []
        setattr(parent, name.rsplit(".", 1)[-1], module)
        parent = module
    parent.MambaCopySpec = MambaCopySpec
    parent.get_conv_copy_spec = get_conv_copy_spec
    parent.get_temporal_copy_spec = get_temporal_copy_spec
    parent.is_conv_state_dim_first = lambda: False
    return parent


try:
    import pytest
except ImportError:  # the benchmarks need no pytest
    pytest = None
if pytest is not None:

    @pytest.hookimpl(trylast=True)
    def pytest_configure(config):
        install()
