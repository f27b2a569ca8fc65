# SPDX-License-Identifier: Apache-2.0
"""Host-side checks of Mamba state copy metadata, before anything is launched.

* ``validate_copy_batch``: a pointer kernel trusts its ``(src_ptrs, dst_ptrs,
  sizes)`` tables, and a bad address corrupts device memory instead of raising.
  It walks a pair forwards, so a destination overlapping its own source from
  above (``src < dst < src + size``; no Mamba move does that) would be corrupted.
  Such tables raise ``MambaCopyValidationError`` naming the pair.
* ``conflicting_pairs``: the pairs of one launch (or of one grouped copy) run in
  no defined order, so a pair whose ranges overlap another pair's, where one of
  the two ranges is written, must run on its own, in pair order. Reading one
  range from several pairs (a shared prefix-cache block) is safe.
"""

import numpy as np

_MAX_SIZE = 2**31  # sizes are int32 on the device


class MambaCopyValidationError(ValueError):
    pass


def validate_copy_batch(src_ptrs, dst_ptrs, sizes) -> None:
    """Refuse copy metadata a forward-walking pointer kernel cannot copy as memmove."""
    src, dst, size = (np.asarray(a, dtype=np.int64) for a in (src_ptrs, dst_ptrs, sizes))
    if not (src.shape == dst.shape == size.shape) or src.ndim != 1:
        raise MambaCopyValidationError(
            f"Mamba state copy metadata of different lengths: src_ptrs {src.shape}, "
            f"dst_ptrs {dst.shape}, sizes {size.shape}"
        )
    checks = [
        ("size outside [0, 2**31)", (size < 0) | (size >= _MAX_SIZE)),
        ("source address <= 0", src <= 0),
        ("destination address <= 0", dst <= 0),
        ("destination overlaps its source from above (dst > src)", (src < dst) & (dst < src + size)),
    ]
    for what, bad in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise MambaCopyValidationError(
                f"Invalid Mamba state copy {i} of {src.size}: {what} "
                f"(src=0x{int(src[i]):x}, dst=0x{int(dst[i]):x}, size={int(size[i])})"
            )


def conflicting_pairs(src, dst, sizes, owners=None) -> np.ndarray:
    """Mask of the pairs that may not run unordered beside the others.

    Ranges (every live source and destination) that overlap, directly or through
    a chain of overlaps, form one run along the address line. A run holding a
    destination and ranges of more than one owner (default: each pair its own)
    marks all its pairs. Conservative, and O(n log n).
    """
    src, dst, size = (np.asarray(a, dtype=np.int64) for a in (src, dst, sizes))
    owner = np.arange(size.size) if owners is None else np.asarray(owners, dtype=np.int64)
    live = np.flatnonzero(size > 0)
    start = np.concatenate([src[live], dst[live]])
    order = np.argsort(start, kind="stable")
    start, end = start[order], (start + np.tile(size[live], 2))[order]
    pair, writes = np.tile(live, 2)[order], (np.arange(2 * live.size) >= live.size)[order]
    run = np.cumsum(np.r_[True, start[1:] >= np.maximum.accumulate(end)[:-1]]) - 1 if start.size else start
    lo, hi = np.full(start.size, np.iinfo(np.int64).max), np.full(start.size, -1)
    np.minimum.at(lo, run, owner[pair])
    np.maximum.at(hi, run, owner[pair])
    bad_run = (np.bincount(run, weights=writes, minlength=start.size) > 0) & (lo != hi)
    mask = np.zeros(size.size, dtype=bool)
    mask[pair[bad_run[run]]] = True
    return mask
