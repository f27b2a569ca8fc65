"""Experimental batch_memmove variants, timed by copy_paths.py --sweep (not product code).

`pipelined`: the non-overlapping (tiled) path keeps two blocks in flight per program: it loads
block i + step before storing block i. Overlapping pairs use the same walks as the product kernel.
"""

from vllm.triton_utils import tl, triton

from vllm_ascend.ops.triton.batch_memmove import _move_backward, _move_forward


@triton.jit
def _copy_strided_pipelined(src_ptr, dst_ptr, size, start, step, offsets, BLOCK_SIZE: tl.constexpr):
    if start < size:
        data = tl.load(src_ptr + start + offsets, mask=(start + offsets) < size)
        for i in range(start + step, size, step):
            nxt = tl.load(src_ptr + i + offsets, mask=(i + offsets) < size)
            prev = i - step
            tl.store(dst_ptr + prev + offsets, data, mask=(prev + offsets) < size)
            data = nxt
        last = start + ((size - 1 - start) // step) * step
        tl.store(dst_ptr + last + offsets, data, mask=(last + offsets) < size)


@triton.jit
def _move_pair_pipelined(src_ptr, dst_ptr, size, is_left, is_right, tile, num_tiles, offsets, BLOCK_SIZE: tl.constexpr):
    if is_left:
        if tile == 0:
            _move_forward(src_ptr, dst_ptr, size, offsets, BLOCK_SIZE)
    elif is_right:
        if tile == 0:
            _move_backward(src_ptr, dst_ptr, size, offsets, BLOCK_SIZE)
    else:
        _copy_strided_pipelined(src_ptr, dst_ptr, size, tile * BLOCK_SIZE, num_tiles * BLOCK_SIZE, offsets, BLOCK_SIZE)


@triton.jit
def batch_memmove_pipelined_kernel(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE: tl.constexpr):
    pair = tl.program_id(0)
    tile = tl.program_id(1)
    num_tiles = tl.num_programs(1)
    src = tl.load(src_ptrs + pair)
    dst = tl.load(dst_ptrs + pair)
    size = tl.load(sizes + pair).to(tl.int64)
    is_left = (dst < src) & ((dst + size) > src)
    is_right = (src < dst) & ((src + size) > dst)
    is_moving = (src != dst) & (size > 0)
    if is_moving:
        is_aligned = ((src | dst | size) % 16) == 0
        offsets = tl.arange(0, BLOCK_SIZE)
        if is_aligned:
            size_a = (size // 16) * 16
            src_ptr = tl.multiple_of(src.to(tl.pointer_type(tl.uint8)), 16)
            dst_ptr = tl.multiple_of(dst.to(tl.pointer_type(tl.uint8)), 16)
            _move_pair_pipelined(src_ptr, dst_ptr, size_a, is_left, is_right, tile, num_tiles, offsets, BLOCK_SIZE)
        else:
            src_ptr = src.to(tl.pointer_type(tl.uint8))
            dst_ptr = dst.to(tl.pointer_type(tl.uint8))
            _move_pair_pipelined(src_ptr, dst_ptr, size, is_left, is_right, tile, num_tiles, offsets, BLOCK_SIZE)


def batch_memmove_pipelined(src_ptrs, dst_ptrs, sizes, *, block_size, tiles, num_warps=None):
    kwargs = {} if num_warps is None else {"num_warps": num_warps}
    batch_memmove_pipelined_kernel[(src_ptrs.shape[0], tiles)](
        src_ptrs, dst_ptrs, sizes, BLOCK_SIZE=block_size, **kwargs
    )
