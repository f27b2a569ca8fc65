"""The copy audit's small run: what a release's align-mode code sends, driven by vLLM's real scheduler.

Run by `fork test` on each base, with that base's test environment and its unpatched tree
(`COPY_AUDIT_TREE`); by hand:

    COPY_AUDIT_TREE=build/base-0.30.0rc2 <test venv>/bin/python -m pytest benchmarks/test_copy_audit.py

Each test is a statement docs/root-cause.md makes about production. It fails when the release's code
sends a pair the docs say none sends.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import copy_audit

TREE = os.environ.get("COPY_AUDIT_TREE")
pytestmark = pytest.mark.skipif(not TREE, reason="COPY_AUDIT_TREE names the vllm-ascend tree to audit")


@pytest.fixture(scope="module")
def record():
    return copy_audit.run(Path(TREE).resolve(), scale=1, seed=0, layout="auto", num_specs=(1, 3))


def launches(record, prefix):
    """Every (result, counts) of the launch paths starting with `prefix`."""
    out = [(r, c) for r in record["results"] for path, c in r["launches"].items() if path.startswith(prefix)]
    assert out, f"no {prefix} launch recorded"
    return out


def test_the_release_runs_every_scenario(record):
    assert [r["error"] for r in record["results"] if "error" in r] == []
    assert Path(record["vllm_ascend"]) == Path(TREE).resolve()
    assert sum(r["preemptions"] for r in record["results"]) > 0  # the churn scenario preempts
    assert sum(r["prefix_hit_tokens"] for r in record["results"]) > 0  # the shared prefix hits


def test_preprocess_never_sends_an_overlapping_or_interacting_pair(record):
    """Pointer tables (batch_memcpy_kernel, bulk and per layer) and 310P tensor pairs alike."""
    for r, c in launches(record, "preprocess"):
        where = f"{r['scenario']} {r['binding']} spec={r['num_spec']} {r['drafter']}"
        assert (c["self_left"], c["self_right"], c["interacting_pairs"]) == (0, 0, 0), where
        assert c["same_block"] == c["self_identical"], where  # only a temporal state copied onto itself


def test_preprocess_addresses_stay_in_live_state_blocks(record):
    for r, c in launches(record, "preprocess"):
        keys = ("outside_state", "across_block", "unaligned", "null_src", "null_dst", "free_block", "src_new_block")
        bad = {k: c[k] for k in keys}
        assert not any(bad.values()), (r["scenario"], r["binding"], bad)


def test_preprocess_copies_a_temporal_state_onto_itself(record):
    """When the state moves one block and drafts were accepted, the temporal source column is the
    destination column: src == dst. A copy kernel must tolerate it (any kernel does)."""
    assert sum(c["self_identical"] for _, c in launches(record, "preprocess")) > 0


def test_postprocess_in_place_shift_overlaps_only_below_a_full_conv_window(record):
    """The fused postprocess's same-block conv shift moves rows by the number of drafts. With a conv
    state of CONV_WIDTH - 1 + k rows it overlaps itself when drafts < CONV_WIDTH - 1: always with
    1 speculative token, and with 3 only when a request is scheduled fewer drafts than 3."""
    overlapping = {(r["num_spec"], r["drafter"]): 0 for r, _ in launches(record, "postprocess")}
    for r, c in launches(record, "postprocess"):
        assert (c["self_right"], c["interacting_pairs"], c["outside_state"]) == (0, 0, 0)
        overlapping[(r["num_spec"], r["drafter"])] += c["self_left"]
    assert overlapping[(3, "mtp")] == 0
    assert overlapping[(1, "mtp")] > 0 and overlapping[(3, "ngram")] > 0


def test_kda_fallback_moves_whole_states_between_cache_and_packed_rows(record):
    """Kimi's prefill state gather and scatter (the KDA byte-copy fallback, where the release has it):
    one state per row between the cache and a packed tensor, padding rows moving nothing."""
    has_kda = (Path(TREE) / "vllm_ascend" / "ops" / "kda_state_copy_plan.py").is_file()
    audited = any(p.startswith("kda") for r in record["results"] for p in r["launches"])
    assert audited == has_kda
    if not has_kda:
        return  # a release without the KDA state copy (0.23.0.post1)
    for r, c in launches(record, "kda_fallback"):
        assert (c["interacting_pairs"], c["outside_state"], c["across_block"]) == (0, 0, 0), r["scenario"]
        assert not (c["null_src"] or c["free_block"] or c["src_new_block"]), r["scenario"]
