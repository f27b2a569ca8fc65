"""`rebase` on the REAL releases 0.23.0 and 0.23.0.post1 (slow: marked `slow`, ~1 minute).

Until the fix series lands this uses a faithful stand-in for it (the integrator re-runs it on the
real series): patch 1 edits vllm_ascend/ops/triton/batch_memcpy.py (identical in both releases)
and adds a module; patch 2 is the 310P snapshot patch, written on 0.23.0 where it is real code
(the fallback's `num_accepted_tokens = ...` line, replaced by exactly upstream's post1 lines) plus
its test. 0.23.0.post1 already has that code change.

Expected, and checked here:
  0.23.0 -> 0.23.0.post1: patch 2 is "partially upstream", naming patch_mamba_utils.py with
  patch-id evidence; on post1 it is test-only and 0.23.0 keeps the code+test version as its
  variant; `check --all-bases` is green on both.
  -> 0.23.0 -> 0.23.0.post1 again: each direction takes the stored variant ("applied cleanly"),
  and the round trip reproduces patches/, fork.toml and the overlay byte for byte.
The sdists must be in the cache (~/.cache/vllm-ascend-fork/sdists); otherwise the test is skipped.
These round trips test the patch mechanics (`--no-test`: the stand-in's test is never run);
the tests a rebase runs are exercised on a real newer release at the end of this file.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tools.fork.core import config, series, upstream
from tools.fork.core.config import OVERLAY_ROOTS, REPO_ROOT
from tools.fork.tests.synthetic import Fork, const, replace

pytestmark = pytest.mark.slow

POST1, V0 = "0.23.0.post1", "0.23.0"


def _sha256(version: str) -> str:
    """A release's sha256: fork.toml's where it lists the release, else the cached sdist's own (no
    hash of today's bases is written here: the tests must pass after any rebase)."""
    listed = {b.version: b.sha256 for b in config.load(REPO_ROOT).bases}
    if version in listed:
        return listed[version]
    return upstream.sha256_of(config.cache_dir() / "sdists" / f"vllm_ascend-{version}.tar.gz")


MAMBA_UTILS = "vllm_ascend/patch/worker/patch_mamba_utils.py"
SNAPSHOT_TEST = "tests/ut/_310p/test_mamba_align_fallback_310p_snapshot.py"

STANDIN = [
    (
        "[Ops][BugFix] Guard left-overlapping copies in batch_memcpy",
        {
            "vllm_ascend/ops/triton/batch_memcpy.py": replace(
                '        data = tl.load(curr_src_ptr, mask=mask, cache_modifier=".cg")\n',
                '        data = tl.load(curr_src_ptr, mask=mask, cache_modifier=".cg")\n'
                "        if is_left_overlap:\n"
                "            tl.debug_barrier()\n",
            ),
            "vllm_ascend/worker/mamba_state_copy.py": const('"""Stand-in for the fork\'s copy dispatch module."""\n'),
        },
    ),
    (
        "[Ops][BugFix] Make the 310P Mamba align fallback read the per-step accepted-token snapshot",
        {
            MAMBA_UTILS: replace(
                "    num_accepted_tokens = input_batch.num_accepted_tokens_cpu\n",
                "    # InputBatch rows may be condensed/reused by async scheduling before this\n"
                "    # fallback consumes the snapshot. Keep this step's accepted counts\n"
                "    # independent from those mutable request rows.\n"
                "    num_accepted_tokens = num_accepted_tokens_cpu_tensor\n",
            ),
            SNAPSHOT_TEST: const("# Stand-in for the regression test (rebase test data; never run).\n"),
        },
    ),
]


class RealFork(Fork):
    """A throwaway fork repository over the real releases in the real sdist cache."""

    def __init__(self, tmp: Path, pin: str | None):
        self.tmp, self.root = tmp, tmp / "repo"
        self.releases, self.sha = {}, {}
        (self.root / "patches").mkdir(parents=True)
        (self.root / "patches" / "series").write_text("")
        if pin is None:  # the caller copies the repository's fork.toml
            return
        (self.root / "fork.toml").write_text(
            f'[upstream]\ndist = "vllm-ascend"\nversion = "{pin}"\nsha256 = "{_sha256(pin)}"\n\n'
            f'[[bases]]\nversion = "{POST1}"\nsha256 = "{_sha256(POST1)}"\n\n'
            f'[[bases]]\nversion = "{V0}"\nsha256 = "{_sha256(V0)}"\n'
        )


@pytest.fixture
def real_fork(tmp_path, monkeypatch):
    monkeypatch.delenv("FORK_CACHE", raising=False)
    sdists = config.cache_dir() / "sdists"
    for v in (POST1, V0):
        if not (sdists / f"vllm_ascend-{v}.tar.gz").exists():
            pytest.skip(f"vllm-ascend {v} sdist is not in {sdists}")
    return RealFork(tmp_path, V0)


def _outcome(text: str, name: str) -> str:
    return next(line.split(f"{name}: ", 1)[1] for line in text.splitlines() if f"] {name}: " in line)


def test_snapshot_patch_across_0_23_0_and_post1_both_ways(real_fork):
    fork = real_fork
    names = fork.make_series(STANDIN, fork_only=())
    snapshot_patch = names[1]
    original = fork.patch(snapshot_patch)

    r = fork.ok("rebase", "--onto", POST1, "--no-test")
    assert _outcome(r.out, names[0]) == "applied cleanly"
    got = _outcome(r.out, snapshot_patch)
    assert got.startswith("partially upstream")
    assert (
        f"{MAMBA_UTILS}: change already in {POST1}; upstream's own diff {V0}..{POST1} of it has the same patch-id"
        in got
    )
    assert set(series.file_sections(fork.patch(snapshot_patch))) == {SNAPSHOT_TEST}  # test-only on post1
    assert fork.variants() == {f"{V0}/{snapshot_patch}": original}  # 0.23.0 keeps the code change
    assert config.load(fork.root).pin.version == POST1
    fork.ok("check", "--all-bases")
    on_post1 = fork.snapshot()

    r = fork.ok("rebase", "--onto", V0, "--no-test", "--older")
    assert _outcome(r.out, snapshot_patch) == f"applied cleanly ({V0} variant)"
    assert fork.patch(snapshot_patch) == original
    assert fork.variants() == {f"{POST1}/{snapshot_patch}": on_post1[fork.root / "patches" / snapshot_patch]}

    r = fork.ok("rebase", "--onto", POST1, "--no-test")
    assert _outcome(r.out, snapshot_patch) == f"applied cleanly ({POST1} variant)"
    assert fork.snapshot() == on_post1  # lossless round trip


def test_this_repository_series_round_trips_through_every_base(tmp_path, monkeypatch):
    """This repository's real series (patches/, fork.toml, the overlay), copied: green on every base,
    onto each other base in the matrix, `check --all-bases` there, and back onto the pin, byte for byte."""
    monkeypatch.delenv("FORK_CACHE", raising=False)
    here = config.load(REPO_ROOT)
    sdists = config.cache_dir() / "sdists"
    for b in here.bases:
        if not (sdists / f"vllm_ascend-{b.version}.tar.gz").exists():
            pytest.skip(f"vllm-ascend {b.version} sdist is not in {sdists}")
    fork = RealFork(tmp_path, None)
    shutil.copyfile(REPO_ROOT / "fork.toml", fork.root / "fork.toml")
    shutil.rmtree(fork.root / "patches")
    for rel in ("patches", *OVERLAY_ROOTS):
        if (REPO_ROOT / rel).is_dir():
            shutil.copytree(REPO_ROOT / rel, fork.root / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    original, changes = _main_files(fork), _changes_per_base(fork)
    # The round trip is lossless from a green matrix (every base's patches apply): check that first.
    fork.ok("check", "--all-bases")
    for other in [b.version for b in here.bases if b.version != here.pin.version]:
        r = fork.ok("rebase", "--onto", other, "--no-test", "--older")  # older or newer
        assert "CONFLICT" not in r.out
        fork.ok("check", "--all-bases")
        fork.ok("rebase", "--onto", here.pin.version, "--no-test", "--older")
        # The pin's series, fork.toml and the overlay come back byte for byte; every base applies the
        # same changes as before (a variant that differed from its base's patch only in index and
        # line-number lines may be gone: it held nothing of its own).
        assert _main_files(fork) == original
        assert _changes_per_base(fork) == changes


def _main_files(fork: Fork) -> dict:
    return {
        p.relative_to(fork.root): d for p, d in fork.snapshot().items() if "bases" not in p.relative_to(fork.root).parts
    }


def _changes_per_base(fork: Fork) -> dict:
    """Base -> [(patch name, its patch-id there, or None where the base skips it)]."""
    cfg = config.load(fork.root)
    return {
        b.version: [(n, series.patch_id(p.read_bytes()) if p else None) for n, p in series.resolve(cfg, b.version)]
        for b in cfg.bases
    }


NEWER = "0.24.0rc1"  # reads the live input_batch.num_accepted_tokens_cpu again, like 0.23.0


def test_rebase_onto_a_newer_release_picks_the_snapshot_variant_by_its_test(tmp_path, monkeypatch):
    """This repository's series onto 0.24.0rc1, a registry pre-release not in fork.toml: the pin's
    versions of most patches conflict there and the rebase takes the per-base versions that apply; by
    name, the snapshot patch is the pin's test-only version (0.30.0rc2 and 0.23.0.post1 have the
    fix), which would leave the fix out. It also deletes the source-text test it replaces, whose
    0.24.0rc1 copy differs, so git may already refuse it (a conflict: the rebase then takes the first
    other version that applies); where it applies, the rebase's tests
    must catch it. Either way it must end with the code+test version (patches/alternatives/) applied
    and its test passing, or stop naming
    the test. Slow the first time: the sdist download and 0.24.0rc1's own test environment (vLLM
    0.24.0), then cached under the user cache. Runs the series' own tests (upstream's CPU suite of
    0.24.0rc1 is left to `test --base`, to keep CI short)."""
    monkeypatch.delenv("FORK_CACHE", raising=False)
    monkeypatch.delenv("FORK_TEST_PYTHON", raising=False)
    monkeypatch.delenv("FORK_REBASE_NO_TEST", raising=False)
    here = config.load(REPO_ROOT)
    if NEWER in {b.version for b in here.bases}:
        pytest.skip(f"{NEWER} is a base of this repository now: this rebase is the round trip's")
    fork = RealFork(tmp_path, None)
    shutil.copyfile(REPO_ROOT / "fork.toml", fork.root / "fork.toml")
    shutil.rmtree(fork.root / "patches")
    for rel in ("patches", *OVERLAY_ROOTS, ".ci"):
        if (REPO_ROOT / rel).is_dir():
            shutil.copytree(REPO_ROOT / rel, fork.root / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    names = series.read_names(config.load(fork.root))
    snapshot_patch = next(n for n in names if SNAPSHOT_TEST.encode() in (fork.root / "patches" / n).read_bytes())
    before = fork.snapshot()
    r = fork.cli_subprocess("rebase", "--onto", NEWER, "--series-tests-only", "--older")
    print(r.text)  # the real flow's output (docs/rebase.md quotes it)
    # A patch that a base skips (a skip marker: already upstream there, or that release lacks the code
    # it changes) may stop the rebase in the same way here: drop it as a user would, resolving to no change.
    markers = (fork.root / "patches" / "bases").glob("*/*")
    skipped_somewhere = {p.name for p in markers if series.skip_reason(p.read_bytes()) is not None}
    printed = r.out  # what every invocation printed: the patches applied before a stop are told there
    while r.rc == 3 and (stopped := _stopped_at(r.out)) in skipped_somewhere:
        subprocess.run(["git", "reset", "-q", "--hard", "HEAD"], cwd=fork.root / "build/rebase/tree", check=True)
        r = fork.cli_subprocess("rebase", "--continue")
        print(r.text)
        printed += r.out
        assert f"{stopped}: dropped: resolved to nothing" in r.out, r.text[-3000:]
    test_name = "test_mamba_align_fallback_310p_snapshot"
    if r.rc != 0:  # a stop must name the test
        assert r.rc == 3 and test_name in r.out, r.text[-3000:]
        assert fork.snapshot() == before
        return
    by_tests = f"fails with patches/{snapshot_patch}" in printed
    by_conflict = f"; patches/alternatives/{snapshot_patch} applies" in printed
    assert by_tests or by_conflict, printed[-3000:]
    if by_tests:
        assert f"trying its other version patches/alternatives/{snapshot_patch}" in printed
        assert _last_outcome(printed, snapshot_patch).startswith("applied cleanly")
    assert "fork rebase: tested: the series' own tests" in r.out and " 0 failed, 0 errors, 0 skipped" in r.out
    assert "upstream's CPU suite NOT run (--series-tests-only)" in r.out
    # the fix is in the new pin's patch (named after the variant's subject now) and in the tree
    new_names = series.read_names(config.load(fork.root))
    new_patches = [fork.root / "patches" / n for n in new_names]  # the dropped ones are the old pin's variants now
    new_snapshot = next(p.name for p in new_patches if p.is_file() and SNAPSHOT_TEST.encode() in p.read_bytes())
    assert b"num_accepted_tokens = num_accepted_tokens_cpu_tensor" in fork.patch(new_snapshot)
    assert "num_accepted_tokens = num_accepted_tokens_cpu_tensor" in (fork.tree / MAMBA_UTILS).read_text()
    assert config.load(fork.root).pin.version == NEWER


def _last_outcome(text: str, name: str) -> str:
    return [line for line in text.splitlines() if f"] {name}: " in line][-1].split(f"{name}: ", 1)[1]


def _stopped_at(text: str) -> str | None:
    """The patch a rebase stopped at, from its `CONFLICT in patch N/M NAME` line."""
    for line in text.splitlines():
        if line.startswith("fork rebase: CONFLICT in patch "):
            return line.split()[6]
    return None
