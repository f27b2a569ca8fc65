"""triton-ascend's language extensions, for upstream Triton's interpreter on the CPU.

vllm-ascend's `ops/triton/triton_utils.py` takes `insert_slice`, `extract_slice` and `get_element`
from `triton.language.extra.cann.extension` (triton-ascend) at import time, and raises
("Failed to resolve Triton op 'insert_slice'") where upstream Triton has neither that module nor
the ops. Every module that imports it (the fla kernels, and through them the package
`vllm_ascend.patch.worker`, which upstream's `test_postprocess_mamba.py` imports) then fails to load.

`install()` registers that module with the three ops, written after triton-ascend's API docs
(`docs/zh/triton_api/Extension_Ops/`) and its own interpreter (`runtime/ascend_interpreter.py`):

- `extract_slice(ful, offsets, sizes, strides)`: the tensor `ful[o : o + n * s : s]` per dimension;
- `insert_slice(ful, sub, offsets, sizes, strides)`: a new tensor, `ful` with that region set to `sub`
  (`ful` itself is unchanged);
- `get_element(src, indice)`: the scalar `src[indice]`.

Offsets and indices may be ints, constexprs or scalar tensors; sizes and strides are ints. They run
only under the interpreter (`TRITON_INTERPRET=1`), where a kernel's tensors hold numpy arrays; the
triton-ascend venv of the compile check has the real module and never loads this one.
"""

from __future__ import annotations

import sys
import types

MODULE = "triton.language.extra.cann.extension"


def _int(value) -> int:
    value = getattr(value, "value", value)  # tl.constexpr
    handle = getattr(value, "handle", None)  # a scalar tl.tensor under the interpreter
    if handle is not None:
        return int(handle.data.reshape(-1)[0])
    return int(value)


def _region(ful, offsets, sizes, strides) -> tuple:
    offsets, sizes, strides = (tuple(getattr(v, "value", v)) for v in (offsets, sizes, strides))
    if not len(offsets) == len(sizes) == len(strides) == len(ful.shape):
        raise ValueError(f"offsets, sizes and strides need one entry per dimension of a {list(ful.shape)} tensor")
    region = []
    for dim, offset, size, stride in zip(ful.shape, offsets, sizes, strides):
        start, size, stride = _int(offset), _int(size), _int(stride)
        if start < 0 or size < 1 or stride < 1 or start + (size - 1) * stride >= dim:
            raise ValueError(f"slice [{start}:{start + size * stride}:{stride}] outside a dimension of {dim}")
        region.append(slice(start, start + size * stride, stride))
    return tuple(region)


def _tensor(data, like, shape):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    ty = tl.block_type(like.dtype, list(shape)) if shape else like.dtype
    return tl.tensor(TensorHandle(data, like.handle.dtype.scalar), ty)


def extract_slice(ful, offsets, sizes, strides, **_):
    region = _region(ful, offsets, sizes, strides)
    data = ful.handle.data[region].copy()
    return _tensor(data, ful, data.shape)


def insert_slice(ful, sub, offsets, sizes, strides, **_):
    region = _region(ful, offsets, sizes, strides)
    data = ful.handle.data.copy()
    if tuple(sub.shape) != data[region].shape:
        raise ValueError(f"insert_slice: a {list(sub.shape)} tensor into a {list(data[region].shape)} region")
    data[region] = sub.handle.data
    return _tensor(data, ful, data.shape)


def get_element(src, indice, **_):
    index = tuple(_int(i) for i in getattr(indice, "value", indice))
    if len(index) != len(src.shape):
        raise ValueError(f"get_element: {len(index)} indices for a {list(src.shape)} tensor")
    import numpy as np

    return _tensor(np.array([src.handle.data[index]]), src, ())


def install() -> bool:
    """Register `triton.language.extra.cann.extension` where this Triton has none; False if it has one."""
    import importlib.util

    import triton.language.extra as extra

    try:
        if importlib.util.find_spec(MODULE) is not None:
            return False
    except ModuleNotFoundError:
        pass
    cann = sys.modules.get("triton.language.extra.cann") or types.ModuleType("triton.language.extra.cann")
    cann.__path__ = getattr(cann, "__path__", [])
    ext = types.ModuleType(MODULE, "kernel harness: triton-ascend's extension ops for the Triton interpreter")
    ext.__kernel_harness__ = True
    ext.insert_slice, ext.extract_slice, ext.get_element = insert_slice, extract_slice, get_element
    cann.extension = ext
    extra.cann = cann
    sys.modules["triton.language.extra.cann"] = cann
    sys.modules[MODULE] = ext
    return True
