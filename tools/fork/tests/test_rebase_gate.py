"""`rebase` tests the rebased tree before it writes (synthetic releases, fast).

The shape of the real case: the 310P snapshot fix is code on 1.0, upstream on 1.1 (so the
pin's patch becomes test-only there and 1.0 keeps the code+test variant), and code again on 1.2.
Moving the series from 1.1 onto 1.2 by name alone would apply the test-only patch "cleanly" with
the fix missing; the tests catch it and the rebase takes the code+test variant instead.
"""

from __future__ import annotations

from tools.fork.core import config, git
from tools.fork.core.errors import EXIT_CONFLICT
from tools.fork.tests.synthetic import P2_CODE, SERIES, UPSTREAM, Fork, const, edited, replace

A, B, C, D = "1.0", "1.1", "1.2", "1.3"
UTILS = "vllm_ascend/patch/worker/patch_utils.py"
TEST_FILE = "tests/ut/worker/test_snapshot.py"
SNAPSHOT_TEST = """\
from types import SimpleNamespace

from vllm_ascend.patch.worker.patch_utils import fallback


def test_fallback_reads_the_snapshot():
    batch = SimpleNamespace(num_accepted_cpu=[9, 9])  # live rows, condensed or reused
    assert fallback(batch, [1, 2], 2) == [1, 2]
"""
REAL_SERIES = [SERIES[0], (SERIES[1][0], {UTILS: P2_CODE, TEST_FILE: const(SNAPSHOT_TEST)}), SERIES[2]]
FIXED = edited(UPSTREAM, {UTILS: P2_CODE})  # upstream took the fix
OLD_AGAIN = edited(UPSTREAM, {"README.md": const("# vllm-ascend 1.2\n")})  # a later line without it
BROKEN = edited(
    UPSTREAM, {UTILS: replace("        out.append(num_accepted[i])\n", "        out.append(num_accepted[i] + 1)\n")}
)


def fork_that_tests(tmp_path, monkeypatch, releases: dict) -> Fork:
    """A synthetic fork whose rebases run the tests (with this Python, see synthetic.Fork)."""
    fork = Fork(tmp_path, monkeypatch, releases, A, [A])
    monkeypatch.delenv("FORK_REBASE_NO_TEST")
    return fork


def fork_on_fixed_release(tmp_path, monkeypatch, extra: dict) -> Fork:
    """Pin 1.0 with the code+test patch, then rebased onto 1.1 (where it becomes test-only)."""
    fork = fork_that_tests(tmp_path, monkeypatch, {A: UPSTREAM, B: FIXED, **extra})
    fork.names = fork.make_series(REAL_SERIES)
    r = fork.ok("rebase", "--onto", B)
    assert "partially upstream" in r.out
    assert b"num_accepted = snapshot" not in fork.patch(fork.names[1])  # test-only on the pin
    assert b"num_accepted = snapshot" in fork.variants()[f"{A}/{fork.names[1]}"]  # code+test on 1.0
    return fork


def outcome(text: str, name: str) -> str:
    """The patch's last reported outcome (a patch applied again with another version reports twice)."""
    return [line for line in text.splitlines() if f"] {name}: " in line][-1].split(f"{name}: ", 1)[1]


def test_the_tests_choose_the_variant_that_carries_the_fix(tmp_path, monkeypatch):
    fork = fork_on_fixed_release(tmp_path, monkeypatch, {C: OLD_AGAIN})
    r = fork.ok("rebase", "--onto", C)
    p2 = fork.names[1]
    assert f"test_fallback_reads_the_snapshot fails with patches/{p2}" in r.out
    assert f"trying its other version patches/bases/{A}/{p2}" in r.out
    assert outcome(r.out, p2).startswith(f"applied cleanly ({A} variant)")
    assert "chosen by the tests" in r.out
    assert "fork rebase: tested: the series' own tests (2 file(s)): 2 passed" in r.out
    assert "tested: upstream's CPU suite" in r.out
    # the new pin's patch 2 carries the code change, and the tree has the fix
    assert config.load(fork.root).pin.version == C
    assert b"num_accepted = snapshot" in fork.patch(p2)
    assert "num_accepted = snapshot" in (fork.tree / UTILS).read_text()
    # 1.1 keeps its test-only version as a variant
    assert b"num_accepted = snapshot" not in fork.variants()[f"{B}/{p2}"]
    fork.ok("check", "--all-bases")


def test_no_test_reports_the_rebase_as_untested(tmp_path, monkeypatch):
    fork = fork_on_fixed_release(tmp_path, monkeypatch, {C: OLD_AGAIN})
    r = fork.ok("rebase", "--onto", C, "--no-test")
    assert "this rebase is UNTESTED (--no-test)" in r.text
    assert "fork rebase: [tests]" not in r.out  # nothing ran
    # by name alone the test-only patch went in: exactly what the tests are there to catch
    assert outcome(r.out, fork.names[1]) == "applied cleanly"
    assert "num_accepted = snapshot" not in (fork.tree / UTILS).read_text()


def test_a_failing_test_with_no_other_version_stops_like_a_conflict(tmp_path, monkeypatch):
    fork = fork_that_tests(tmp_path, monkeypatch, {A: UPSTREAM, D: BROKEN})
    fork.names = fork.make_series(REAL_SERIES)
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", D)
    assert r.rc == EXIT_CONFLICT
    p2 = fork.names[1]
    assert f"TESTS FAILED on vllm-ascend {D}" in r.out
    assert f"{TEST_FILE}::test_fallback_reads_the_snapshot: failed (patch {p2})" in r.out
    assert "assert [2, 3] == [1, 2]" in r.out  # the assertion
    assert fork.snapshot() == before  # nothing written
    status = fork.ok("status").out
    assert f"rebase   in progress onto vllm-ascend {D}" in status
    assert "TESTS FAILED" in status and "test_fallback_reads_the_snapshot" in status and p2 in status
    # a fix made in the rebase tree (committed into the patch) lets --continue finish
    tree = fork.work / "tree"
    (tree / UTILS).write_text((tree / UTILS).read_text().replace("num_accepted[i] + 1", "num_accepted[i]"))
    r = fork.cli("rebase", "--continue")
    assert r.rc == EXIT_CONFLICT and "uncommitted changes" in r.err
    git.run(["commit", "-q", "-a", "--fixup=HEAD~1"], tree)
    git.run(["-c", "sequence.editor=true", "rebase", "-q", "-i", "--autosquash", f"v{D}"], tree)
    r = fork.ok("rebase", "--continue")
    assert "fork rebase: tested: the series' own tests (2 file(s)): 2 passed" in r.out
    assert config.load(fork.root).pin.version == D


def test_status_names_target_patch_and_files_of_a_conflict(tmp_path, monkeypatch):
    clash = edited(
        UPSTREAM, {UTILS: replace("    num_accepted = batch.num_accepted_cpu\n", "    num_accepted = list(batch.x)\n")}
    )
    fork = fork_that_tests(tmp_path, monkeypatch, {A: UPSTREAM, D: clash})
    fork.names = fork.make_series(REAL_SERIES)
    r = fork.cli("rebase", "--onto", D)
    assert r.rc == EXIT_CONFLICT
    status = fork.ok("status").out
    assert f"rebase   in progress onto vllm-ascend {D} (from {A}" in status
    assert f"stopped at a CONFLICT in patch 2/3 {fork.names[1]}" in status
    assert f"files: {UTILS}" in status
    fork.ok("rebase", "--abort")
