"""Import vllm-ascend Triton kernel modules from a tree without its heavy package `__init__`s.

`vllm_ascend/__init__.py` and friends import torch_npu and vLLM's platform
machinery. The kernel modules themselves only need `vllm.triton_utils`
(`tl`, `triton`) and torch. `register_tree()` puts light package objects for
`vllm_ascend`, `vllm_ascend.ops`, `vllm_ascend.ops.triton` and
`vllm_ascend.ops.triton.mamba` and `vllm_ascend.worker` (for the torch-only
copy modules `mamba_copy_groups` and `mamba_copy_batch`), and `vllm_ascend.patch` and
`vllm_ascend.patch.worker` (upstream's test_postprocess_mamba.py imports
`patch_mamba_utils`; the real package `__init__` applies every worker patch, some of which
import torch_npu) into `sys.modules`, whose `__path__` lists the
real directories of the tree(s) under test, so `import
vllm_ascend.ops.triton.batch_memmove` loads just that file.

Several roots may be given (first wins), e.g. the fork's overlay and the
materialized tree.

Some releases' kernel files import `vllm_ascend.utils` (0.27.1rc1's postprocess
kernel picks one of two bodies with `vllm_version_is`), and that module imports
torch_npu, vLLM's engine and the Ascend config: none of it loads off an NPU, and
the triton-ascend venv has no vLLM at all. Upstream's CPU tests stub torch_npu
for the same reason (tests/ut/conftest.py). The harness stubs the one module
that needs it instead: `stub_utils()` puts a `vllm_ascend.utils` holding only
`vllm_version_is` and `is_310p` into `sys.modules`, in the harness's own process.

Under the interpreter, `setup()` also gives Triton triton-ascend's extension ops
(`ascend_ops.py`), which `ops/triton/triton_utils.py` resolves at import time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from pathlib import Path

UTILS = "vllm_ascend.utils"
PACKAGES = (
    "vllm_ascend",
    "vllm_ascend.ops",
    "vllm_ascend.ops.triton",
    "vllm_ascend.ops.triton.mamba",
    "vllm_ascend.ops.triton.v2",
    "vllm_ascend.ops.triton.v2.mamba",
    "vllm_ascend.worker",
    "vllm_ascend.patch",
    "vllm_ascend.patch.worker",
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
    """Register light `vllm_ascend...` packages whose `__path__` points into `roots`, and the utils stub."""
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
    stub_utils(roots)


def vllm_version(roots: list[Path]) -> str:
    """The vLLM release the kernels are loaded for, as `vllm_version_is` sees it.

    $VLLM_VERSION (upstream's own override), else the installed vLLM, else (the triton-ascend
    venv has none) the X.Y.Z of the tree's own version: vllm-ascend X.Y.Z[rcN|.postN] pairs
    with vLLM X.Y.Z.
    """
    if os.environ.get("VLLM_VERSION"):
        return os.environ["VLLM_VERSION"]
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    for root in roots:
        generated = root / "vllm_ascend" / "_version.py"  # setuptools-scm's, shipped in the sdist
        if generated.is_file():
            found = re.search(r"^__version__ = version = '(\d+\.\d+\.\d+)", generated.read_text(), re.M)
            if found:
                return found.group(1)
    raise HarnessError(f"no vLLM installed and no vllm_ascend/_version.py in {roots}: set VLLM_VERSION")


def stub_utils(roots: list[Path]) -> types.ModuleType:
    """Register the `vllm_ascend.utils` stub: `vllm_version_is` and `is_310p` (see the module docstring).

    The vLLM version is looked up when a kernel asks. A kernel file that takes another name from
    vllm_ascend.utils fails with an ImportError naming this stub: add that name here, torch_npu-free.
    """

    def vllm_version_is(target_vllm_version: str) -> bool:
        # as written: upstream compares packaging Versions, which the triton-ascend venv lacks;
        # both sides are plain X.Y.Z releases here
        return vllm_version(roots) == target_vllm_version

    utils = types.ModuleType(UTILS, f"kernel harness stub of {UTILS}: vllm_version_is and is_310p")
    utils.__spec__ = importlib.util.spec_from_loader(UTILS, loader=None)
    utils.__file__ = f"<kernel harness stub: {__file__}>"  # named by `cannot import name ...` errors
    utils.__kernel_harness__ = True
    utils.vllm_version_is = vllm_version_is
    utils.is_310p = lambda: False  # 0.23.0.post1's patch_mamba_utils picks its 310P fallback with it: no NPU here
    sys.modules[UTILS] = utils
    sys.modules["vllm_ascend"].utils = utils
    return utils


def tree_root(path: Path) -> Path | None:
    """The vllm-ascend tree a kernel file lies in (None for a file outside any tree)."""
    return next((p for p in path.resolve().parents if (p / "vllm_ascend" / "ops" / "triton").is_dir()), None)


def setup(roots: list[Path]) -> dict:
    interp = prepare_interpreter_if_needed()
    source = provide_triton_utils()
    register_tree(roots)
    info = {"interpreter": interp, "triton_utils": source, "roots": [str(r) for r in roots]}
    if interp:  # triton_utils.py resolves triton-ascend's extension ops at import time
        from tools.kernel_harness import ascend_ops

        if ascend_ops.install():
            info["ascend_ops"] = "interpreter versions (tools/kernel_harness/ascend_ops.py)"
    return info


def load_file(path: Path, name: str) -> types.ModuleType:
    """Load one kernel file as a standalone module (e.g. a second tree's copy)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise HarnessError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
