"""Kernels that triton-ascend's front end is known to reject (a pointer cast inside the loop crashes
triton-adapter-opt); used to prove the ascend compile check can fail. Not product code."""

from vllm.triton_utils import tl, triton


@triton.jit
def cast_inside_loop_kernel(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE: tl.constexpr):
    # The int -> pointer cast inside the loop crashes triton-adapter-opt
    # (Assertion `idx < size()`); vllm-ascend hoists it out of the loop.
    pid = tl.program_id(0)
    src = tl.load(src_ptrs + pid)
    dst = tl.load(dst_ptrs + pid)
    size = tl.load(sizes + pid)
    offsets = tl.arange(0, BLOCK_SIZE)
    for i in range(0, size, BLOCK_SIZE):
        mask = (i + offsets) < size
        data = tl.load((src + i + offsets).to(tl.pointer_type(tl.uint8)), mask=mask)
        tl.store((dst + i + offsets).to(tl.pointer_type(tl.uint8)), data, mask=mask)
