"""`rebase` on synthetic upstreams (tools/fork/tests/synthetic.py): every outcome, the conflict
flow, the support-matrix variants, and fault injection.

Oracles: the rebased tree must hold exactly the files computed in Python (the new release's files
with the patches' edits applied); "nothing changed" is a byte snapshot of patches/, fork.toml and
the overlay; outcomes and evidence are read from the tool's report.
"""

from __future__ import annotations

import builtins
import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tools.fork import cli, config, git, rebase, rebase_apply, series
from tools.fork.errors import (
    EXIT_BAD_INPUT,
    EXIT_CONFLICT,
    EXIT_FAILED,
    EXIT_IN_PROGRESS,
    EXIT_LOCAL_EDITS,
    EXIT_UPSTREAM,
)
from tools.fork.tests.synthetic import (
    P2_CODE,
    SERIES,
    UPSTREAM,
    Fork,
    const,
    edited,
    replace,
    staged_leftovers,
)

A, B, C = "1.0", "1.1", "1.2"
COPY, UTILS = "vllm_ascend/ops/copy.py", "vllm_ascend/patch/worker/patch_utils.py"
SNAPSHOT_TEST = "tests/ut/worker/test_snapshot.py"
REPO_ROOT = Path(__file__).resolve().parents[3]


def all_edits(patches=SERIES) -> dict:
    edits: dict = {}
    for _, e in patches:
        edits.update(e)
    return edits


def expected_tree(files: dict[str, str], patches=SERIES) -> dict[str, str]:
    out = dict(files)
    for _, edits in patches:
        out = edited(out, edits)
    return out


def make(tmp_path, monkeypatch, b_files: dict[str, str] | None, *, bases=(A, B), extra=None) -> Fork:
    releases = {A: UPSTREAM}
    if b_files is not None:
        releases[B] = b_files
    releases.update(extra or {})
    fork = Fork(tmp_path, monkeypatch, releases, A, [v for v in bases if v in releases])
    fork.names = fork.make_series()
    return fork


def outcomes(fork: Fork, text: str) -> dict[str, str]:
    """Patch name -> outcome, from the per-patch progress lines."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and "] " in line and ".patch: " in line:
            name, rest = line.split("] ", 1)[1].split(": ", 1)
            out[name] = rest
    return out


def assert_tree(fork: Fork, files: dict[str, str], tree: Path | None = None) -> None:
    got = fork.tree_files(tree or fork.tree)
    assert got == files


def assert_unchanged(fork: Fork, before: dict[Path, bytes]) -> None:
    assert fork.snapshot() == before
    assert staged_leftovers(fork.root) == []


# --- outcomes -------------------------------------------------------------------------------------


def test_clean_apply_moves_the_pin_and_keeps_patches(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {"README.md": const("# vllm-ascend 1.1\n")})
    fork = make(tmp_path, monkeypatch, b)
    old = {n: fork.patch(n) for n in fork.names}
    r = fork.ok("rebase", "--onto", B)
    assert set(outcomes(fork, r.out).values()) == {"applied cleanly"}
    assert "git range-diff" in r.out and "1:  " in r.out
    cfg = config.load(fork.root)
    assert cfg.pin.version == B and cfg.pin.sha256 == fork.sha[B]
    assert [b.version for b in cfg.bases] == [A, B]
    assert {n: fork.patch(n) for n in fork.series()} == old  # same blobs touched: same bytes
    assert fork.variants() == {}
    assert not fork.work.exists()
    assert_tree(fork, expected_tree(b))
    assert "up to date" in fork.ok("apply").out
    fork.ok("check", "--all-bases")


def test_moved_code_applies_with_an_offset(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace('"""\n\n\n', '"""\n\nCHUNK = 1024\nALIGN = 32\nMAX = 8\n\n\n')})
    fork = make(tmp_path, monkeypatch, b)
    r = fork.ok("rebase", "--onto", B)
    got = outcomes(fork, r.out)
    assert got[fork.names[0]] == f"applied cleanly (offset {COPY} +4 lines)"
    assert fork.variants() == {}  # an offset is not a semantic difference
    assert_tree(fork, expected_tree(b))
    fork.ok("check", "--all-bases")  # the new patch still applies on 1.0 (at an offset)


def test_three_way_merge_keeps_the_old_version_as_a_variant_and_round_trips(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        size = sizes[i]\n", "        size = int(sizes[i])\n")})
    fork = make(tmp_path, monkeypatch, b)
    original = fork.snapshot()
    r = fork.ok("rebase", "--onto", B)
    assert outcomes(fork, r.out)[fork.names[0]] == "applied with 3-way merge"
    assert_tree(fork, expected_tree(b))
    # The old pin stays in the matrix: its version of patch 1 differs (context), so it is kept.
    assert fork.variants() == {f"{A}/{fork.names[0]}": original[fork.root / "patches" / fork.names[0]]}
    fork.ok("check", "--all-bases")
    after_first = fork.snapshot()
    r = fork.ok("rebase", "--onto", A)  # and back: the variant applies cleanly
    assert outcomes(fork, r.out)[fork.names[0]] == f"applied cleanly ({A} variant)"
    assert {n: fork.patch(n) for n in fork.series()} == {n: original[fork.root / "patches" / n] for n in fork.names}
    assert list(fork.variants()) == [f"{B}/{fork.names[0]}"]
    fork.ok("check", "--all-bases")
    fork.ok("rebase", "--onto", B)
    assert fork.snapshot() == after_first  # lossless both ways


def test_conflict_stops_then_continue_after_resolution(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        store(dst[i], data)\n", "        store(dst[i], data, cache=False)\n")})
    fork = make(tmp_path, monkeypatch, b)
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_CONFLICT
    assert f"CONFLICT in patch 1/3 {fork.names[0]}" in r.out
    tree = fork.work / "tree"
    text = (tree / COPY).read_text()
    first = text.splitlines().index(next(x for x in text.splitlines() if x.startswith("<<<<<<<"))) + 1
    last = text.splitlines().index(next(x for x in text.splitlines() if x.startswith(">>>>>>>"))) + 1
    assert f"{COPY}: both modified; conflict markers at lines {first}-{last}" in r.out
    assert f"cd {tree}" in r.out and f"git add {COPY}" in r.out and "rebase --continue" in r.out
    assert_unchanged(fork, before)
    assert "rebase   in progress" in fork.ok("status").out
    # A second rebase while this one is open is refused.
    again = fork.cli("rebase", "--onto", B)
    assert again.rc == EXIT_IN_PROGRESS and "already in progress" in again.err and fork.names[0] in again.err
    # --continue before resolving says what is still unresolved.
    early = fork.cli("rebase", "--continue")
    assert early.rc == EXIT_CONFLICT and COPY in early.err
    assert_unchanged(fork, before)
    # Resolve: upstream's new store call, guarded.
    resolved = b[COPY].replace(
        "        store(dst[i], data, cache=False)\n",
        "        barrier()  # all loads before any store\n        store(dst[i], data, cache=False)\n",
    )
    (tree / COPY).write_text(resolved)
    git.run(["add", COPY], tree)
    r = fork.ok("rebase", "--continue")
    got = outcomes(fork, r.out)
    assert got[fork.names[0]].startswith("conflict resolved")
    assert got[fork.names[1]] == "applied cleanly"
    want = expected_tree(b, SERIES[1:])
    want = edited(want, {k: v for k, v in SERIES[0][1].items() if k != COPY})
    want[COPY] = resolved
    assert_tree(fork, want)
    assert f"{A}/{fork.names[0]}" in fork.variants()
    fork.ok("check", "--all-bases")


def test_conflict_then_abort_leaves_everything_byte_identical(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        store(dst[i], data)\n", "        put(dst[i], data)\n")})
    fork = make(tmp_path, monkeypatch, b)
    before = fork.snapshot()
    fork_tree_head = git.out(["rev-parse", "HEAD"], fork.tree)
    assert fork.cli("rebase", "--onto", B).rc == EXIT_CONFLICT
    r = fork.ok("rebase", "--abort")
    assert "not changed" in r.out
    assert_unchanged(fork, before)
    assert not fork.work.exists()
    assert git.out(["rev-parse", "HEAD"], fork.tree) == fork_tree_head
    assert fork.cli("rebase", "--abort").rc == EXIT_BAD_INPUT  # nothing left to abort
    assert fork.cli("rebase", "--continue").rc == EXIT_BAD_INPUT


def test_conflict_resolved_to_nothing_drops_the_patch(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        store(dst[i], data)\n", "        put(dst[i], data)\n")})
    fork = make(tmp_path, monkeypatch, b)
    original = fork.snapshot()
    assert fork.cli("rebase", "--onto", B).rc == EXIT_CONFLICT
    tree = fork.work / "tree"
    git.run(["reset", "-q", "--hard", "HEAD"], tree)  # take upstream's side of everything
    git.run(["clean", "-q", "-fd"], tree)
    r = fork.ok("rebase", "--continue")
    assert outcomes(fork, r.out)[fork.names[0]].startswith("dropped: resolved to nothing")
    # The pin no longer applies patch 1; 1.0 (still in the matrix) keeps it as a variant.
    assert fork.names[0] in fork.series()
    assert not (fork.root / "patches" / fork.names[0]).exists()
    assert fork.variants()[f"{A}/{fork.names[0]}"] == original[fork.root / "patches" / fork.names[0]]
    assert [p.name for p in series.read(config.load(fork.root))][0] != fork.names[0]
    assert [p.name for p in series.read(config.load(fork.root), A)][0] == fork.names[0]
    fork.ok("check", "--all-bases")


def test_already_upstream_is_dropped_with_patch_id_evidence_and_round_trips(tmp_path, monkeypatch):
    b = edited(UPSTREAM, SERIES[1][1])  # upstream took patch 2 exactly
    fork = make(tmp_path, monkeypatch, b)
    original = fork.snapshot()
    r = fork.ok("rebase", "--onto", B)
    line = next(x for x in r.out.splitlines() if fork.names[1] in x and "already upstream" in x)
    pid = series.patch_id(original[fork.root / "patches" / fork.names[1]])
    assert f"upstream's own diff {A}..{B} over {SNAPSHOT_TEST}, {UTILS} has the same patch-id {pid[:12]}" in line
    assert_tree(fork, expected_tree(b, [SERIES[0], SERIES[2]]))
    names = fork.series()
    # patch 2 stays listed for 1.0 (variant-only); patch 3 is renumbered, and fork.toml follows it.
    assert names[1] == fork.names[1] and not (fork.root / "patches" / fork.names[1]).exists()
    assert names[2].startswith("0002-Misc-Feature")
    assert list(config.load(fork.root).fork_only) == [names[2]]
    assert f"on {A}: {fork.names[1]} (own variant)" in fork.ok("status").out
    fork.ok("check", "--all-bases")
    r = fork.ok("rebase", "--onto", A)
    assert outcomes(fork, r.out)[fork.names[1]] == f"applied cleanly ({A} variant)"
    assert fork.series() == fork.names
    for n in fork.names:
        assert fork.patch(n) == original[fork.root / "patches" / n]
    assert (fork.root / "fork.toml").read_bytes() == original[fork.root / "fork.toml"]
    # 1.1 skips patch 2: an empty variant marks it already upstream there.
    assert fork.variants()[f"{B}/{fork.names[1]}"] == b""
    fork.ok("check", "--all-bases")


def test_already_upstream_with_other_changes_says_applying_changes_nothing(tmp_path, monkeypatch):
    b = edited(UPSTREAM, SERIES[1][1])
    b = edited(b, {UTILS: replace("    return None\n", "    return 0\n")})
    fork = make(tmp_path, monkeypatch, b)
    r = fork.ok("rebase", "--onto", B)
    line = next(x for x in r.out.splitlines() if fork.names[1] in x and "already upstream" in x)
    assert f"applying it changes nothing: {B} already has every change to {SNAPSHOT_TEST}, {UTILS}" in line


def test_partially_upstream_names_the_file_and_keeps_the_full_patch_for_the_old_base(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {UTILS: P2_CODE})  # upstream took the code change, not the test
    fork = make(tmp_path, monkeypatch, b)
    original = fork.snapshot()
    r = fork.ok("rebase", "--onto", B)
    got = outcomes(fork, r.out)[fork.names[1]]
    assert got.startswith("partially upstream")
    assert f"{UTILS}: change already in {B}; upstream's own diff {A}..{B} of it has the same patch-id" in got
    new = fork.patch(fork.names[1])
    assert set(series.file_sections(new)) == {SNAPSHOT_TEST}  # test-only on the new pin
    assert fork.variants()[f"{A}/{fork.names[1]}"] == original[fork.root / "patches" / fork.names[1]]
    fork.ok("check", "--all-bases")


def test_file_deleted_upstream_is_named_in_the_conflict(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {UTILS: const(None)})
    fork = make(tmp_path, monkeypatch, b)
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_CONFLICT
    assert f"CONFLICT in patch 2/3 {fork.names[1]}" in r.out
    assert f"{UTILS}: deleted upstream, modified by the patch (modify/delete); not in {B}" in r.out
    assert "git rm FILE" in r.out
    assert_unchanged(fork, before)
    tree = fork.work / "tree"
    git.run(["rm", "-q", UTILS], tree)  # accept the deletion; keep the test
    r = fork.ok("rebase", "--continue")
    # only the file that conflicted (not the patch's other, cleanly applied files)
    assert outcomes(fork, r.out)[fork.names[1]] == f"conflict resolved (by hand: {UTILS})"
    assert set(series.file_sections(fork.patch(fork.names[1]))) == {SNAPSHOT_TEST}


def test_file_renamed_upstream_is_followed(tmp_path, monkeypatch):
    b = dict(UPSTREAM)
    b["vllm_ascend/ops/copy_ops.py"] = b.pop(COPY)
    fork = make(tmp_path, monkeypatch, b)
    r = fork.ok("rebase", "--onto", B)
    got = outcomes(fork, r.out)[fork.names[0]]
    assert got == f"applied with 3-way merge (followed upstream's rename {COPY} -> vllm_ascend/ops/copy_ops.py)"
    want = expected_tree(UPSTREAM)
    want["vllm_ascend/ops/copy_ops.py"] = want.pop(COPY)
    assert_tree(fork, want)
    assert "vllm_ascend/ops/copy_ops.py" in series.file_sections(fork.patch(fork.names[0]))


def test_file_renamed_and_changed_upstream_conflicts_at_the_new_path(tmp_path, monkeypatch):
    b = dict(UPSTREAM)
    b["vllm_ascend/ops/copy_ops.py"] = b.pop(COPY).replace(
        "        store(dst[i], data)\n", "        put(dst[i], data)\n"
    )
    fork = make(tmp_path, monkeypatch, b)
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_CONFLICT
    assert f"vllm_ascend/ops/copy_ops.py: both modified; renamed upstream from {COPY}" in r.out


# --- the new release: known, first use, bad ----------------------------------------------------------


def test_first_use_sdist_is_recorded_loudly(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, None)
    path, sha = fork.sdist_elsewhere(C, edited(UPSTREAM, {"README.md": const("# 1.2\n")}))
    r = fork.ok("rebase", "--onto", C, "--sdist", str(path))
    assert "TRUST ON FIRST USE" in r.err and sha in r.err
    cfg = config.load(fork.root)
    assert (cfg.pin.version, cfg.pin.sha256) == (C, sha)
    assert [(b.version, b.sha256) for b in cfg.bases] == [(A, fork.sha[A]), (C, sha)]


def test_sdist_of_another_version_is_refused(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, None)
    path, _ = fork.sdist_elsewhere("1.3", UPSTREAM)
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", C, "--sdist", str(path))
    assert r.rc == EXIT_BAD_INPUT and "is version 1.3, not 1.2" in r.err
    assert_unchanged(fork, before)
    assert not fork.work.exists()


def test_hash_mismatch_of_the_base_is_refused(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    cached = fork.cache / "sdists" / f"vllm_ascend-{B}.tar.gz"
    cached.write_bytes(cached.read_bytes() + b"tampered")
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_UPSTREAM and "sha256 mismatch" in r.err and "Nothing was changed" in r.err
    assert_unchanged(fork, before)
    assert not fork.work.exists()


def test_registry_unreachable(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, None)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    before = fork.snapshot()
    r = fork.cli_subprocess("rebase", "--onto", "9.9.9")  # pip writes to the real stderr
    assert r.rc == EXIT_UPSTREAM and "could not download vllm-ascend==9.9.9" in r.err and "--sdist PATH" in r.err
    assert_unchanged(fork, before)
    assert not fork.work.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--onto", A], "already on vllm-ascend 1.0"),
        (["--onto", "latest"], "is not a release version"),
        (["--onto", C, "--checkout", "."], "not a vllm-ascend source tree"),
    ],
)
def test_bad_input(tmp_path, monkeypatch, argv, message):
    fork = make(tmp_path, monkeypatch, None)
    before = fork.snapshot()
    r = fork.cli("rebase", *argv)
    assert r.rc == EXIT_BAD_INPUT and message in r.err
    assert_unchanged(fork, before)


def test_unexported_edits_in_the_fork_tree_are_refused(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    (fork.tree / COPY).write_text("edited\n")
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_LOCAL_EDITS and "python -m tools.fork export" in r.err and COPY in r.err
    assert_unchanged(fork, before)
    assert (fork.tree / COPY).read_text() == "edited\n"


def test_drop_old_base(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {UTILS: P2_CODE})
    fork = make(tmp_path, monkeypatch, b)
    fork.ok("rebase", "--onto", B, "--drop-old-base")
    cfg = config.load(fork.root)
    assert [b.version for b in cfg.bases] == [B]
    assert fork.variants() == {}
    assert f'version = "{A}"' not in (fork.root / "fork.toml").read_text()


def test_test_option_runs_the_fork_tests_on_the_new_pin(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    calls = []
    monkeypatch.setattr(cli, "run_fork_tests", lambda cfg, version: calls.append(version) or 1)
    r = fork.cli("rebase", "--onto", B, "--test")
    assert calls == [B]
    assert r.rc == EXIT_FAILED and "tests FAILED" in r.out
    assert config.load(fork.root).pin.version == B  # the rebase itself is written


# --- fault injection --------------------------------------------------------------------------------


def test_failure_in_the_middle_changes_nothing(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    before = fork.snapshot()
    real, calls = rebase_apply.apply_one, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(rebase_apply, "apply_one", failing)
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_FAILED
    assert "rebase failed: RuntimeError: injected failure" in r.err and "Nothing was changed" in r.err
    assert "run the rebase again" in r.err
    assert_unchanged(fork, before)
    assert not fork.work.exists()
    monkeypatch.setattr(rebase_apply, "apply_one", real)
    fork.ok("rebase", "--onto", B)


def test_failure_during_continue_keeps_the_resolution(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        store(dst[i], data)\n", "        put(dst[i], data)\n")})
    fork = make(tmp_path, monkeypatch, b)
    before = fork.snapshot()
    assert fork.cli("rebase", "--onto", B).rc == EXIT_CONFLICT
    tree = fork.work / "tree"
    (tree / COPY).write_text(b[COPY])
    git.run(["add", COPY], tree)
    real = rebase_apply.apply_one

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error", "injected")

    monkeypatch.setattr(rebase_apply, "apply_one", failing)
    r = fork.cli("rebase", "--continue")
    assert r.rc == EXIT_FAILED and "Input/output error" in r.err and "still in progress" in r.err
    assert_unchanged(fork, before)
    assert fork.work.exists()
    monkeypatch.setattr(rebase_apply, "apply_one", real)
    r = fork.ok("rebase", "--continue")
    assert outcomes(fork, r.out)[fork.names[1]] == "applied cleanly"
    assert "conflict resolved" in r.out


def test_full_disk_on_the_final_write(tmp_path, monkeypatch):
    fork = make(
        tmp_path,
        monkeypatch,
        edited(UPSTREAM, {COPY: replace("        size = sizes[i]\n", "        size = int(sizes[i])\n")}),
    )
    before = fork.snapshot()
    real_open, opened = builtins.open, []

    def full_disk_open(file, mode="r", *args, **kwargs):
        if str(file).endswith(".fork-staged"):
            opened.append(file)
            if len(opened) >= 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk_open)
    r = fork.cli("rebase", "--onto", B)
    monkeypatch.setattr(builtins, "open", real_open)
    assert len(opened) == 2
    assert r.rc == EXIT_FAILED and "No space left on device" in r.err
    assert "not changed" in r.err and "rebase --continue" in r.err
    assert_unchanged(fork, before)
    r = fork.ok("rebase", "--continue")  # space is back: the same result is written
    assert config.load(fork.root).pin.version == B
    assert_tree(fork, expected_tree(fork.releases[B]))


def test_edits_to_patches_during_a_conflict_are_not_overwritten(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        store(dst[i], data)\n", "        put(dst[i], data)\n")})
    fork = make(tmp_path, monkeypatch, b)
    assert fork.cli("rebase", "--onto", B).rc == EXIT_CONFLICT
    tree = fork.work / "tree"
    (tree / COPY).write_text(b[COPY])
    git.run(["add", COPY], tree)
    series_file = fork.root / "patches" / "series"
    original = series_file.read_bytes()
    series_file.write_bytes(original + b"# a note\n")
    edited_state = fork.snapshot()
    r = fork.cli("rebase", "--continue")
    assert r.rc == EXIT_LOCAL_EDITS and "changed since the rebase started" in r.err
    assert_unchanged(fork, edited_state)
    series_file.write_bytes(original)
    fork.ok("rebase", "--continue")


_DRIVER = """
import sys, time
from pathlib import Path
import importlib
marker, target, seconds = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
module_name, _, target = target.rpartition(".")
module = importlib.import_module(f"tools.fork.{module_name}")
real = getattr(module, target)

if isinstance(real, type):  # a class: pause in its commit()
    class Paused(real):
        def commit(self):
            marker.write_text("here")
            time.sleep(seconds)
            return super().commit()
    setattr(module, target, Paused)
else:
    def paused(*args, **kwargs):
        marker.write_text("here")
        time.sleep(seconds)
        return real(*args, **kwargs)
    setattr(module, target, paused)
from tools.fork.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _interrupt(
    fork: Fork, tmp_path: Path, target: str, sig: int, *argv: str, pause: float = 60
) -> subprocess.CompletedProcess:
    marker = tmp_path / "marker"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(marker), target, str(pause), "-C", str(fork.root), *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=90)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_while_applying_changes_nothing(tmp_path, monkeypatch, sig):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    before = fork.snapshot()
    p = _interrupt(fork, tmp_path, "rebase_apply.apply_one", sig, "rebase", "--onto", B)
    assert p.returncode == EXIT_FAILED, p.stderr
    assert "rebase failed: interrupted (SIGINT/SIGTERM)" in p.stderr and "Nothing was changed" in p.stderr
    assert_unchanged(fork, before)
    assert not fork.work.exists()


def test_signal_before_the_final_write_keeps_the_work(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    before = fork.snapshot()
    p = _interrupt(fork, tmp_path, "rebase_write.plan", signal.SIGTERM, "rebase", "--onto", B)
    assert p.returncode == EXIT_FAILED, p.stderr
    assert "interrupted" in p.stderr and "rebase --continue` writes the result" in p.stderr
    assert_unchanged(fork, before)
    fork.ok("rebase", "--continue")
    assert config.load(fork.root).pin.version == B


def test_signal_during_the_final_write_is_held_until_it_is_complete(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    p = _interrupt(fork, tmp_path, "rebase_write.StagedWrite", signal.SIGTERM, "rebase", "--onto", B, pause=1)
    assert p.returncode == EXIT_FAILED, p.stderr
    assert "interrupted" in p.stderr and "The rebase IS written" in p.stderr
    assert config.load(fork.root).pin.version == B  # all of it: the write was not cut in half
    assert staged_leftovers(fork.root) == []
    r = fork.ok("rebase", "--continue")
    assert "done" in r.out and not fork.work.exists()
    assert_tree(fork, expected_tree(fork.releases[B]))


def test_help_lists_the_exit_codes():
    p = subprocess.run(
        [sys.executable, "-m", "tools.fork", "rebase", "--help"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert p.returncode == 0
    for code in ("0  done", "3  rebase stopped at a conflict", "4  a rebase is already in progress", "5  the upstream"):
        assert code in p.stdout
    assert textwrap.dedent(rebase.HELP).splitlines()[0] in p.stdout


# --- the series around a rebase: check --all-bases --test, export after a rebase ---------------------


def test_check_all_bases_test_runs_the_fork_tests_on_each_base(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {UTILS: P2_CODE}))
    fork.ok("rebase", "--onto", B)
    calls = []
    monkeypatch.setattr(
        cli, "run_fork_tests", lambda cfg, version: calls.append(version) or (1 if version == A else 0)
    )
    r = fork.cli("check", "--all-bases", "--test")
    assert calls == [A, B]
    assert r.rc == EXIT_FAILED and f"[{A}] the fork's tests failed (exit 1)" in r.out


def test_export_after_a_rebase_keeps_variants_attached_to_renamed_patches(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        size = sizes[i]\n", "        size = int(sizes[i])\n")})
    fork = make(tmp_path, monkeypatch, b)
    fork.ok("rebase", "--onto", B)
    variant = fork.variants()[f"{A}/{fork.names[0]}"]
    # A maintainer inserts a new first patch in the pin's tree (build/fork), then exports.
    tree, head = fork.tree, git.out(["rev-parse", "HEAD"], fork.tree)
    git.run(["reset", "-q", "--hard", f"v{B}"], tree)
    fork.commit(tree, "[Doc][Misc] Say what the fork is", {"README.md": const("# the fork\n")})
    git.run(["cherry-pick", f"v{B}..{head}"], tree)
    fork.ok("export")
    names = fork.series()
    assert [n[:5] for n in names] == ["0001-", "0002-", "0003-", "0004-"]
    assert names[1].endswith(fork.names[0][5:])
    assert fork.variants() == {f"{A}/{names[1]}": variant}  # the variant follows its patch's new name
    assert list(config.load(fork.root).fork_only) == [names[3]]
    fork.ok("check", "--all-bases")


def test_export_keeps_a_variant_only_patch_in_the_series(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, SERIES[1][1]))  # patch 2 already upstream in 1.1
    fork.ok("rebase", "--onto", B)
    listed = fork.series()
    fork.commit(
        fork.tree, "[Test][Misc] One more test", {"tests/ut/test_more.py": const("def test_more():\n    pass\n")}
    )
    fork.ok("export")
    assert fork.series()[:3] == listed and fork.series()[3].startswith("0003-Test-Misc")
    fork.ok("check", "--all-bases")


def test_empty_series_just_moves_the_pin(tmp_path, monkeypatch):
    fork = Fork(tmp_path, monkeypatch, {A: UPSTREAM, B: edited(UPSTREAM, {"README.md": const("x\n")})}, A, [A, B])
    r = fork.ok("rebase", "--onto", B)
    assert config.load(fork.root).pin.version == B and fork.series() == []
    assert "#  patch" in r.out


def test_onto_a_known_base_from_an_upstream_checkout(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {"README.md": const("# 1.1\n")})
    fork = make(tmp_path, monkeypatch, b)
    checkout = tmp_path / "checkout"
    for path, text in {**b, "PKG-INFO": f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {B}\n"}.items():
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        (checkout / path).write_text(text)
    r = fork.ok("rebase", "--onto", B, "--checkout", str(checkout))
    assert f"checkout at {B}" in r.out
    assert config.load(fork.root).pin == config.Base(B, fork.sha[B])  # the pin stays the sdist's sha256
    assert_tree(fork, expected_tree(b))


def test_workflow_giving_an_older_base_its_own_version_of_a_patch(tmp_path, monkeypatch):
    """The documented way to make a variant: rebase onto the older base, fold the base-specific
    change into the patch there, export, rebase back: `rebase` stores the variant."""
    code_upstream = edited(UPSTREAM, {UTILS: P2_CODE})  # the newer release already has patch 2's code
    test_only = [SERIES[0], (SERIES[1][0], {SNAPSHOT_TEST: SERIES[1][1][SNAPSHOT_TEST]}), SERIES[2]]
    fork = Fork(tmp_path, monkeypatch, {A: UPSTREAM, B: code_upstream}, B, [B, A])
    fork.names = fork.make_series(test_only)
    fork.ok("rebase", "--onto", A)
    assert fork.variants() == {}  # test-only patch 2 is the same change on both
    tree = fork.tree
    second = git.out(["rev-list", "--reverse", f"v{A}..HEAD"], tree).split()[1]
    (tree / UTILS).write_text(P2_CODE(UPSTREAM[UTILS]))
    git.run(["commit", "-q", "-a", f"--fixup={second}"], tree)
    git.run(["rebase", "-q", "-i", "--autosquash", f"v{A}"], tree, env={"GIT_SEQUENCE_EDITOR": "true"})
    fork.ok("export")
    assert set(series.file_sections(fork.patch(fork.names[1]))) == {SNAPSHOT_TEST, UTILS}
    r = fork.ok("rebase", "--onto", B)
    assert outcomes(fork, r.out)[fork.names[1]].startswith("partially upstream")
    assert set(series.file_sections(fork.patch(fork.names[1]))) == {SNAPSHOT_TEST}
    assert set(series.file_sections(fork.patch(fork.names[1], A))) == {SNAPSHOT_TEST, UTILS}
    fork.ok("check", "--all-bases")


def test_first_use_from_the_cache_and_from_the_registry(tmp_path, monkeypatch):
    from tools.fork import registry, upstream
    from tools.fork.tests.synthetic import make_sdist

    fork = make(tmp_path, monkeypatch, None)
    c_files = edited(UPSTREAM, {"README.md": const("# 1.2\n")})
    _, sha_c = make_sdist(fork.cache / "sdists", C, c_files)  # in the cache, not in fork.toml
    r = fork.ok("rebase", "--onto", C)
    assert "TRUST ON FIRST USE" in r.err and "the cached sdist (not yet in fork.toml)" in r.err
    assert config.load(fork.root).pin == config.Base(C, sha_c)

    downloads = []

    def fake_pip_download(cfg, version, dest):  # what pip leaves behind: one sdist in dest
        downloads.append(version)
        return make_sdist(dest, version, c_files)[0]

    monkeypatch.setattr(registry, "_pip_download", fake_pip_download)
    r = fork.ok("rebase", "--onto", "1.3")
    assert downloads == ["1.3"] and "downloaded from the package registry" in r.err
    cached = fork.cache / "sdists" / "vllm_ascend-1.3.tar.gz"
    assert config.load(fork.root).pin == config.Base("1.3", upstream.sha256_of(cached))
    assert [b.version for b in config.load(fork.root).bases] == [A, C, "1.3"]
