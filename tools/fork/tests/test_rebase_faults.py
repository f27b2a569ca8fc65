"""`rebase` under faults: a failure, a full disk, edits meanwhile and signals change nothing or keep the work."""

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

from tools.fork.core import config, git
from tools.fork.core.errors import (
    EXIT_CONFLICT,
    EXIT_FAILED,
    EXIT_LOCAL_EDITS,
)
from tools.fork.rebase import apply as rebase_apply
from tools.fork.rebase import cmd_rebase as rebase
from tools.fork.tests.synthetic import (
    COPY,
    REPO_ROOT,
    UPSTREAM,
    B,
    Fork,
    assert_tree,
    assert_unchanged,
    const,
    edited,
    expected_tree,
    make,
    outcomes,
    replace,
    staged_leftovers,
)

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
        if "/build/rebase/write/new/" in str(file) and "w" in mode:  # the final write's staged files
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
    # A shell's background job (`cmd &`, nohup) inherits SIGINT ignored, and Python then keeps it
    # ignored: give the child the default, as an interactive terminal would.
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(marker), target, str(pause), "-C", str(fork.root), *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
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
    p = _interrupt(fork, tmp_path, "rebase.apply.apply_one", sig, "rebase", "--onto", B)
    assert p.returncode == EXIT_FAILED, p.stderr
    assert "rebase failed: interrupted (SIGINT/SIGTERM)" in p.stderr and "Nothing was changed" in p.stderr
    assert_unchanged(fork, before)
    assert not fork.work.exists()


def test_signal_before_the_final_write_keeps_the_work(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    before = fork.snapshot()
    p = _interrupt(fork, tmp_path, "rebase.write.plan", signal.SIGTERM, "rebase", "--onto", B)
    assert p.returncode == EXIT_FAILED, p.stderr
    assert "interrupted" in p.stderr and "rebase --continue` writes the result" in p.stderr
    assert_unchanged(fork, before)
    fork.ok("rebase", "--continue")
    assert config.load(fork.root).pin.version == B


def test_signal_during_the_final_write_is_held_until_it_is_complete(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    p = _interrupt(fork, tmp_path, "core.journal.apply", signal.SIGTERM, "rebase", "--onto", B, pause=1)
    assert p.returncode == EXIT_FAILED, p.stderr
    assert "interrupted" in p.stderr and "The rebase IS written" in p.stderr
    assert config.load(fork.root).pin.version == B  # all of it: the write was not cut in half
    assert staged_leftovers(fork.root) == []
    r = fork.ok("rebase", "--continue")
    assert "done" in r.out and not fork.work.exists()
    assert_tree(fork, expected_tree(fork.releases[B]))


def test_signal_during_an_exports_write_is_held_until_the_export_is_complete(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, None)
    fork.commit(fork.tree, "[Misc][Feature] Add a knob", {"vllm_ascend/knob.py": const("KNOB = 1\n")})
    p = _interrupt(fork, tmp_path, "core.journal.apply", signal.SIGINT, "export", pause=1)
    assert p.returncode == EXIT_FAILED and p.stderr == "fork export: interrupted\n", p.stderr
    assert (fork.root / "vllm_ascend/knob.py").read_text() == "KNOB = 1\n"  # all of it: not cut in half
    assert "0004-Misc-Feature-Add-a-knob.patch" in fork.series() and staged_leftovers(fork.root) == []
    assert "up to date" in fork.ok("export").out


def test_help_lists_the_exit_codes():
    p = subprocess.run(
        [sys.executable, "-m", "tools.fork", "rebase", "--help"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert p.returncode == 0
    for code in ("0  done", "3  rebase stopped at a conflict", "4  a rebase is already in progress", "5  the upstream"):
        assert code in p.stdout
    assert textwrap.dedent(rebase.HELP).splitlines()[0] in p.stdout
