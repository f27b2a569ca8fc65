"""Import vllm-ascend Triton kernel modules from a tree without its heavy package `__init__`s.

`vllm_ascend/__init__.py` and friends import torch_npu and vLLM's platform
machinery. The kernel modules themselves only need `vllm.triton_utils`
(`tl`, `triton`) and torch. `register_tree()` puts light package objects for
`vllm_ascend`, `vllm_ascend.ops`, `vllm_ascend.ops.triton` and
`vllm_ascend.ops.triton.mamba` and `vllm_ascend.worker` (for the torch-only
copy modules `mamba_copy_groups` and `mamba_copy_batch`) into `sys.modules`, whose `__path__` lists the
real directories of the tree(s) under test, so `import
vllm_ascend.ops.triton.batch_memmove` loads just that file.

Several roots may be given (first wins), e.g. the fork's overlay and the
materialized tree.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

PACKAGES = (
    "vllm_ascend",
    "vllm_ascend.ops",
    "vllm_ascend.ops.triton",
    "vllm_ascend.ops.triton.mamba",
    "vllm_ascend.ops.triton.v2",
    "vllm_ascend.ops.triton.v2.mamba",
    "vllm_ascend.worker",
)
TREE_ENV = "KERNEL_TREE"


class HarnessError(RuntimeError):
    pass


def split_roots(value: str | os.PathLike | list | tuple) -> list[Path]:
    if isinstance(value, (list, tuple)):
        items = [str(v) for v in value]
    else:
        items = str(value).split(os.pathsep)
    return [Path(item).resolve() for item in items if item]


def no_accelerator() -> bool:
    """True when neither an NPU (torch_npu) nor a CUDA GPU is usable."""
    try:
        import torch
    except ImportError:
        return True
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return False
    except Exception:
        pass
    return not torch.cuda.is_available()


def prepare_interpreter_if_needed() -> bool:
    """On a machine with no GPU/NPU: CUDA_VISIBLE_DEVICES="" and TRITON_INTERPRET=1.

    Must run before any kernel module is imported (the `@triton.jit` decorator
    reads TRITON_INTERPRET). Returns True when the interpreter is in use.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        return True
    if no_accelerator():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return False


def provide_triton_utils() -> str:
    """Make `from vllm.triton_utils import tl, triton` give the real Triton.

    With vLLM installed, its own module is used (CUDA_VISIBLE_DEVICES="" makes
    it hand out real triton on a machine with no GPU); without vLLM (a GPU machine
    image, the triton-ascend env) a two-name shim is registered.
    """
    import triton
    import triton.language as tl

    if "vllm.triton_utils" in sys.modules:
        return "preloaded"
    if importlib.util.find_spec("vllm") is not None:
        # vLLM 0.30 loads its platform plugins when `vllm` is imported: the ascend one needs torch_npu
        # (and the light vllm_ascend package here has no `register`). Kernels need none of them.
        os.environ.setdefault("VLLM_PLUGINS", "none")
        from vllm.triton_utils import triton as vllm_triton

        if getattr(vllm_triton, "jit", None) is not triton.jit:
            raise HarnessError(
                "vllm.triton_utils hands out a Triton placeholder; set CUDA_VISIBLE_DEVICES='' "
                "before importing vLLM on a machine without a GPU"
            )
        return "vllm"
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []  # a namespace-like package: only triton_utils exists
    utils = types.ModuleType("vllm.triton_utils")
    utils.tl = tl
    utils.triton = triton
    utils.HAS_TRITON = True
    vllm.triton_utils = utils
    sys.modules["vllm"] = vllm
    sys.modules["vllm.triton_utils"] = utils
    return "shim"


def register_tree(roots: list[Path]) -> None:
    """Register light `vllm_ascend...` packages whose `__path__` points into `roots`."""
    if not roots:
        raise HarnessError(f"no kernel tree given (--kernel-tree or ${TREE_ENV})")
    for root in roots:
        if not (root / "vllm_ascend" / "ops" / "triton").is_dir():
            raise HarnessError(f"{root} is not a vllm-ascend tree (no vllm_ascend/ops/triton)")
    for name in PACKAGES:
        rel = Path(*name.split("."))
        paths = [str(root / rel) for root in roots if (root / rel).is_dir()]
        existing = sys.modules.get(name)
        if existing is not None and getattr(existing, "__kernel_harness__", False):
            if list(existing.__path__) != paths:
                raise HarnessError(f"{name} already registered for {list(existing.__path__)}, not {paths}")
            continue
        pkg = types.ModuleType(name)
        pkg.__path__ = paths
        pkg.__package__ = name
        pkg.__kernel_harness__ = True
        pkg.__file__ = None
        sys.modules[name] = pkg
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, pkg)


def setup(roots: list[Path]) -> dict:
    interp = prepare_interpreter_if_needed()
    source = provide_triton_utils()
    register_tree(roots)
    return {"interpreter": interp, "triton_utils": source, "roots": [str(r) for r in roots]}


def load_file(path: Path, name: str) -> types.ModuleType:
    """Load one kernel file as a standalone module (e.g. a second tree's copy)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise HarnessError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
