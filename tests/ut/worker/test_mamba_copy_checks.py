#
# Copyright (c) 2026 Huawei Technologies Co., Ltd. All Rights Reserved.
# This file is a part of the vllm-ascend project.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
"""Host-side checks of Mamba state copy tables (vllm_ascend/worker/mamba_copy_checks.py).

Oracles: a numpy memmove of every pair in pair order, and a brute-force O(n^2)
conflict check. One launch is modelled by its pairs run in reverse pair order
(one legal schedule of an unordered launch, and the adversarial one for pair order).
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_ascend.worker.mamba_copy_checks import MambaCopyValidationError, conflicting_pairs, validate_copy_batch

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings.get_profile(os.environ.get("VLLM_ASCEND_FUZZ_PROFILE", "ci"))


def _conflict(a, b):
    (sa, da, za), (sb, db, zb) = a, b
    if za == 0 or zb == 0:
        return False

    def hit(x, y, n, m):
        return x < y + m and y < x + n

    return hit(da, db, za, zb) or hit(da, sb, za, zb) or hit(sa, db, za, zb)


def memmove_oracle(buf, pairs):
    out = buf.copy()
    for s, d, n in pairs:
        out[d : d + n] = out[s : s + n].copy()
    return out


def _run_launch_unordered(buf, pairs):
    """One launch: every pair is a memmove of its own, pairs in reverse order."""
    for s, d, n in reversed(pairs):
        buf[d : d + n] = buf[s : s + n].copy()


_pairs = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200), st.integers(0, 40)), min_size=0, max_size=12)


@FUZZ
@given(pairs=_pairs)
def test_fuzz_unmarked_pairs_in_one_launch_then_marked_pairs_equal_pair_order_memmove(pairs):
    columns = [np.array(c, dtype=np.int64) for c in zip(*pairs)] if pairs else [np.zeros(0, np.int64)] * 3
    bad = conflicting_pairs(*columns)
    for i in range(len(pairs)):  # every pair that conflicts with another one is marked
        if any(_conflict(pairs[i], pairs[j]) for j in range(len(pairs)) if j != i):
            assert bad[i]
    buf = np.arange(256, dtype=np.uint8)
    expected = memmove_oracle(buf, pairs)
    _run_launch_unordered(buf, [p for p, b in zip(pairs, bad) if not b])
    for p in [p for p, b in zip(pairs, bad) if b]:
        _run_launch_unordered(buf, [p])
    np.testing.assert_array_equal(buf, expected)


def test_shared_source_blocks_are_not_a_hazard():
    """Several requests reading one prefix-cache block is read-read."""
    src = np.array([1000, 1000, 1000], dtype=np.int64)
    dst = np.array([2000, 3000, 4000], dtype=np.int64)
    assert not conflicting_pairs(src, dst, np.array([512, 512, 512])).any()


def test_pairs_of_one_owner_do_not_conflict_with_each_other():
    # block ids: one request moves two states from blocks 3 and 4 into block 5, another 6 -> 7
    marks = conflicting_pairs([3, 4, 6], [5, 5, 7], [1, 1, 1], owners=[0, 0, 1])
    assert not marks.any()
    assert conflicting_pairs([3, 4, 5], [5, 5, 7], [1, 1, 1], owners=[0, 0, 1]).all()  # a chain


@pytest.mark.parametrize(
    ("src", "dst", "size", "what"),
    [
        (0, 4096, 16, "source address <= 0"),
        (4096, -8, 16, "destination address <= 0"),
        (4096, 8192, -1, r"size outside \[0, 2\*\*31\)"),
        (4096, 8192, 2**31, r"size outside \[0, 2\*\*31\)"),
        (4096, 4097, 16, r"destination overlaps its source from above \(dst > src\)"),
        (4096, 4111, 16, r"destination overlaps its source from above \(dst > src\)"),
    ],
)
def test_bad_metadata_is_refused_naming_the_pair(src, dst, size, what):
    src_ptrs, dst_ptrs, sizes = [4096, src], [4608, dst], [8, size]
    with pytest.raises(MambaCopyValidationError, match=rf"copy 1 of 2: {what} \(src=0x{src:x}, dst="):
        validate_copy_batch(src_ptrs, dst_ptrs, sizes)


@pytest.mark.parametrize(("src", "dst"), [(4112, 4096), (4096, 4112), (4096, 4096), (4112, 4100)])
def test_moves_a_forward_walk_copies_as_memmove_are_accepted(src, dst):
    """Left overlap (the conv shift), disjoint moves, a pair onto itself, a one-byte-left shift."""
    validate_copy_batch([src], [dst], [16])


def test_tables_of_different_lengths_are_refused():
    with pytest.raises(MambaCopyValidationError, match="different lengths"):
        validate_copy_batch([1, 2], [3], [4, 5])
