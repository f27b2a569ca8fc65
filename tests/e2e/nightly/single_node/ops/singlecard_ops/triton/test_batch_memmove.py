# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""batch_memmove (batch_memcpy_kernel at vllm-ascend's block of 8 KiB, one program a pair, in
launches of at most MAX_PROGRAMS programs) against a numpy memmove oracle.

The pairs are the moves Mamba makes: a destination below an overlapping source (the conv
shift), a pair onto itself, moves between disjoint ranges; a right overlap is refused on the
host before staging (tests/ut/worker/test_mamba_copy_checks.py). Pairs that touch another
pair's ranges are passed as ``ordered``. The batch then has one defined result: numpy memmove
applied pair by pair to a byte snapshot of the pool. The pool is poisoned and randomised first;
the whole pool must equal the oracle, so bytes outside the destinations must be unchanged.
"""

import os

import numpy as np
import pytest
import torch

from vllm_ascend.ops.triton import batch_memmove as bm
from vllm_ascend.ops.triton.batch_memmove import batch_memmove

DEVICE = "npu"
pytestmark = pytest.mark.skipif(not hasattr(torch, "npu") or not torch.npu.is_available(), reason="NPU required")
BLOCK = bm.BLOCK_SIZE
POISON = 0xA5
KINDS = ("left", "exact", "disjoint")
# Longer random runs: KERNEL_FUZZ_EXAMPLES=500 pytest ...
FUZZ_EXAMPLES = int(os.environ.get("KERNEL_FUZZ_EXAMPLES", "25"))


def memmove_oracle(pool: np.ndarray, pairs) -> np.ndarray:
    """numpy memmove applied in pair order to a snapshot of the pool."""
    out = pool.copy()
    for src, dst, size in pairs:
        out[dst : dst + size] = out[src : src + size].copy()
    return out


class Arena:
    """Hands out disjoint, aligned regions of one byte pool, one region per pair."""

    def __init__(self, align: int = 16, gap: int = 48):
        self.align = align
        self.gap = gap
        self.end = 0

    def take(self, nbytes: int) -> int:
        start = -(-(self.end + self.gap) // self.align) * self.align
        self.end = start + nbytes
        return start

    def pair(self, kind: str, size: int, shift: int) -> tuple[int, int, int]:
        """(src, dst, size) of one kind of Mamba move; shift > 0 bytes for left/disjoint."""
        if kind == "exact":
            start = self.take(size)
            return start, start, size
        if kind == "disjoint":
            start = self.take(2 * size + shift)
            return start, start + size + shift, size
        start = self.take(size + shift)
        if kind == "left":  # dst < src < dst + size
            return start + shift, start, size
        raise ValueError(kind)


def make_pool(nbytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pool = np.full(nbytes, POISON, dtype=np.uint8)
    # Random payload on every other 16-byte granule leaves poison visible too.
    data = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    keep = (np.arange(nbytes) // 16) % 2 == 0
    pool[keep] = data[keep]
    return pool


def run_pairs(pool: np.ndarray, pairs, ordered=None) -> np.ndarray:
    """Copy pool to the device, run batch_memmove over all pairs, return the pool bytes."""
    dev = torch.from_numpy(pool.copy()).to(DEVICE)
    base = dev.data_ptr()
    src = torch.tensor([base + s for s, _, _ in pairs], dtype=torch.int64, device=DEVICE)
    dst = torch.tensor([base + d for _, d, _ in pairs], dtype=torch.int64, device=DEVICE)
    sizes = torch.tensor([n for _, _, n in pairs], dtype=torch.int32, device=DEVICE)
    batch_memmove(src, dst, sizes, ordered)
    torch.npu.synchronize()
    return dev.cpu().numpy()


def bad_pairs(result: np.ndarray, expected: np.ndarray, pairs) -> list:
    bad = []
    for idx, (src, dst, size) in enumerate(pairs):
        if not np.array_equal(result[dst : dst + size], expected[dst : dst + size]):
            bad.append((idx, src, dst, size))
    return bad


def assert_memmove(pool: np.ndarray, pairs, ordered=None) -> None:
    result = run_pairs(pool, pairs, ordered)
    expected = memmove_oracle(pool, pairs)
    bad = bad_pairs(result, expected, pairs)
    assert not bad, f"{len(bad)} of {len(pairs)} pairs differ from memmove, first (idx, src, dst, size): {bad[:5]}"
    outside = np.ones(pool.size, dtype=bool)
    for _, dst, size in pairs:
        outside[dst : dst + size] = False
    changed = np.flatnonzero(result[outside] != pool[outside])
    assert changed.size == 0, f"{changed.size} bytes outside the destinations changed"
    assert np.array_equal(result, expected)


@pytest.mark.parametrize("elem_size", [1, 2, 8])
def test_sizes_around_block_boundaries_every_kind(elem_size):
    """Sizes from one element to three blocks, around block boundaries, every kind, one launch."""
    blk = BLOCK // elem_size
    counts = [1, 3, blk - 1, blk, blk + 1, 2 * blk + 3]
    arena = Arena(align=16)
    pairs = []
    for count in counts:
        size = count * elem_size
        for kind in KINDS:
            for shift in sorted({1, 16, count - 1}) if kind != "exact" else [0]:
                if kind == "left" and not 0 < shift < count:
                    continue  # not overlapping; "disjoint" covers it
                pairs.append(arena.pair(kind, size, shift * elem_size))
    pool = make_pool(arena.end + 64, seed=elem_size)
    assert_memmove(pool, pairs)


@pytest.mark.parametrize("offset", [0, 1, 8])
def test_unaligned_pairs(offset):
    arena = Arena(align=16)
    pairs = []
    for size in (16, 1000, BLOCK + 24):
        for kind, shift in (("left", 16), ("disjoint", 16), ("left", 5)):
            src, dst, n = arena.pair(kind, size, shift)
            pairs.append((src + offset, dst + offset, n))
        arena.take(offset)
    pool = make_pool(arena.end + 64, seed=offset)
    assert_memmove(pool, pairs)


def test_exact_and_empty_pairs_leave_pool_untouched():
    arena = Arena()
    pairs = [arena.pair("exact", 300, 0), arena.pair("exact", 1, 0), (arena.take(8), arena.take(8), 0)]
    pool = make_pool(arena.end + 64, seed=7)
    result = run_pairs(pool, pairs)
    assert np.array_equal(result, pool)


def test_ordered_pairs_run_apart_in_pair_order(monkeypatch):
    """A chain (b -> c, then d -> b) and one destination (c) written twice: the unmarked pairs in one
    launch, then one launch per marked pair, in pair order; the pool equals memmove in pair order."""
    kernel, grids = bm.batch_memcpy_kernel, []

    class RecordingKernel:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(bm, "batch_memcpy_kernel", RecordingKernel())
    a, b, c, d, e = (4096 * i for i in range(5))
    pairs = [(a + 512, a, 1024), (b, c, 2048), (d, b, 2048), (e, c, 100), (e + 4096 + 8, e + 4096, 64)]
    ordered = np.array([False, True, True, True, False])
    pool = make_pool(6 * 4096, seed=11)
    assert_memmove(pool, pairs, ordered)
    assert grids == [(2,), (1,), (1,), (1,)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_mamba_conv_shift_every_bias_and_temporal_moves(dtype):
    """Align-mode moves on Mamba-like pools: state[blk, bias:] -> state[blk, :width - bias] for every
    bias, plus conv and temporal moves between distinct blocks, all in one launch with the launcher's defaults."""
    num_blocks, width, conv_dim, temporal_shape = 16, 4, 24, (2, 8, 8)
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(num_blocks, width, conv_dim, generator=gen).to(dtype).to(DEVICE)
    temporal = torch.randn(num_blocks, *temporal_shape, generator=gen).to(torch.float32).to(DEVICE)
    conv_ref, temporal_ref = conv.cpu().clone(), temporal.cpu().clone()

    src_ptrs, dst_ptrs, sizes = [], [], []

    def add(state, ref, src_view_fn, dst_view_fn):
        src_view, dst_view = src_view_fn(state), dst_view_fn(state)
        src_ptrs.append(src_view.data_ptr())
        dst_ptrs.append(dst_view.data_ptr())
        sizes.append(src_view.numel() * src_view.element_size())
        dst_view_ref = dst_view_fn(ref)
        dst_view_ref.copy_(src_view_fn(ref).clone())

    for bias in range(1, width):  # same block: the overlapping shift
        blk = bias
        add(conv, conv_ref, lambda s, b=blk, o=bias: s[b, o:], lambda s, b=blk, o=bias: s[b, : width - o])
    for bias, (src_blk, dst_blk) in zip(range(0, width), [(8, 9), (10, 11), (12, 5), (13, 6)]):
        add(
            conv,
            conv_ref,
            lambda s, b=src_blk, o=bias: s[b, o:],
            lambda s, b=dst_blk, o=bias: s[b, : width - o],
        )
        add(temporal, temporal_ref, lambda s, b=src_blk: s[b], lambda s, b=dst_blk: s[b])

    def t(values, dt):
        return torch.tensor(values, dtype=dt, device=DEVICE)

    batch_memmove(t(src_ptrs, torch.int64), t(dst_ptrs, torch.int64), t(sizes, torch.int32))
    torch.npu.synchronize()
    assert torch.equal(conv.cpu().view(torch.uint8), conv_ref.view(torch.uint8))
    assert torch.equal(temporal.cpu().view(torch.uint8), temporal_ref.view(torch.uint8))


def test_fuzz_random_geometry():
    """Random pair sets (hypothesis): any kind of Mamba move, size, element size and offset."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    pair_strategy = st.tuples(
        st.sampled_from(KINDS),
        st.sampled_from((1, 2, 4, 8)),  # element size
        st.integers(1, 40),  # elements
        st.integers(1, 40),  # shift in elements
        st.integers(0, 3),  # misalignment in elements
    )

    @hypothesis.settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(st.lists(pair_strategy, min_size=1, max_size=12))
    def check(specs):
        arena = Arena(align=16, gap=8)
        pairs = []
        for kind, elem, count, shift, misalign in specs:
            arena.take(misalign * elem)
            shift = min(shift, count - 1) if kind == "left" else shift
            pairs.append(arena.pair("disjoint" if kind == "left" and shift == 0 else kind, count * elem, shift * elem))
        pool = make_pool(arena.end + 32, seed=len(specs))
        assert_memmove(pool, pairs)

    check()


def test_large_batches_launch_in_chunks_within_the_grid_limit(monkeypatch):
    """No launch has more than MAX_PROGRAMS programs (triton-ascend's coreDim limit)."""
    kernel, grids = bm.batch_memcpy_kernel, []

    class RecordingKernel:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(bm, "MAX_PROGRAMS", 4)
    monkeypatch.setattr(bm, "batch_memcpy_kernel", RecordingKernel())
    arena = Arena()
    pairs = [arena.pair(KINDS[i % 3], 40, 3 if i % 3 != 1 else 0) for i in range(9)]
    assert_memmove(make_pool(arena.end + 64, seed=3), pairs)
    assert grids == [(4,), (4,), (1,)]
