"""What a new user trips on: bad inputs, plain-python3 runs, output, apply safety."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tools.fork import cli
from tools.fork.tests.conftest import FIX_FILES, pr_message


def _one_line_error(proc: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for w in words:
        assert w in lines[0], lines[0]


def _state(fork) -> tuple:
    return fork.protected(), fork.git("rev-parse", "HEAD"), fork.git("status", "--porcelain")


# --- bad inputs: one line on stderr, a documented exit code, nothing changed --------------------


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["export", "--upstream", "/etc/passwd"], 2, ["/etc/passwd", "not a directory"]),
        (["export", "--upstream", "/etc/passwd/sub"], 2, ["not a directory"]),
        (["apply", "--sdist", "/etc/passwd"], 2, ["/etc/passwd", "not an sdist"]),
        (["apply", "--sdist", "/nonexistent.tar.gz"], 2, ["/nonexistent.tar.gz", "no such file"]),
        (["apply", "--sdist", "/etc"], 2, ["/etc", "not a file"]),
        (["apply", "--checkout", "/etc"], 2, ["/etc", "not a vllm-ascend source tree"]),
        (["apply", "--checkout", "/nonexistent"], 2, ["/nonexistent"]),
        (["deploy", "--to", ""], 2, ["--to", "empty"]),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(fork_with_patch, args, code, words):
    fork = fork_with_patch
    assert "up to date" in fork.run("apply").stdout  # the case that used to pass silently
    before = _state(fork)
    _one_line_error(fork.run(*args, check=False), code, *words)
    assert _state(fork) == before


def test_apply_checks_a_named_sdist_even_when_up_to_date(fork_with_patch, tmp_path):
    fork = fork_with_patch
    wrong = tmp_path / "vllm_ascend-1.0.0.tar.gz"
    subprocess.run(["tar", "czf", str(wrong), "-C", str(fork.root), "fork.toml"], check=True)
    before = _state(fork)
    proc = fork.run("apply", "--sdist", str(wrong), check=False)
    assert proc.returncode == 5 and "sha256 mismatch" in proc.stderr
    assert _state(fork) == before
    good = next((fork.cache / "sdists").glob("*.tar.gz"))
    assert "up to date" in fork.run("apply", "--sdist", str(good)).stdout


@pytest.mark.parametrize("verb", list(cli.VERBS))
def test_wrong_option_shows_the_verbs_own_usage(fork, verb):
    proc = fork.run(verb, "--no-such-option", check=False)
    assert proc.returncode == 2
    assert f"usage: python3 -m tools.fork {verb}" in proc.stderr
    assert f"python3 -m tools.fork {verb}: error: " in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_verb_summary_is_a_sentence(fork):
    out = fork.run("--help").stdout
    for verb, (_module, summary) in cli.VERBS.items():
        assert summary.endswith(".") and summary[0].isupper(), summary
        assert " ".join(summary.split()[:3]) in " ".join(out.split()), verb


# --- plain python3: no tools environment -------------------------------------------------------


def _plain(fork, *args: str) -> subprocess.CompletedProcess:
    """The tooling under this interpreter with no site-packages (-S): no setuptools-scm, pytest..."""
    return subprocess.run(
        [sys.executable, "-S", "-m", "tools.fork", "-C", str(fork.root), *args],
        cwd=fork.root,
        capture_output=True,
        text=True,
        env={**os.environ, "FORK_CACHE": str(fork.cache), "PYTHONPATH": str(fork.root)},
    )


def test_status_without_setuptools_scm(fork_with_patch):
    proc = _plain(fork_with_patch, "status")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "version  unknown: this Python lacks setuptools_scm" in proc.stdout


def test_build_without_tools_env_says_so_in_one_line(fork_with_patch):
    _one_line_error(_plain(fork_with_patch, "build"), 7, "setuptools_scm", "build/tools-venv/bin/python")


@pytest.mark.parametrize("args", [["apply"], ["check"], ["export"], ["pr", "1"], ["rebase", "--abort"]])
def test_plain_python_runs_the_light_verbs(fork_with_patch, args):
    proc = _plain(fork_with_patch, *args)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 2), proc.stderr


# --- output ------------------------------------------------------------------------------------


def test_pr_prints_only_the_text_to_paste(fork_with_patch):
    proc = fork_with_patch.run("pr", "1")
    assert proc.stdout.startswith("[Ops][BugFix] Guard the copy\n\n### What this PR does")
    assert "fork pr:" not in proc.stdout + proc.stderr


# --- apply never drops work that patches/ does not hold ----------------------------------------


def test_apply_refuses_to_drop_an_exported_then_discarded_commit(fork_with_patch):
    fork = fork_with_patch
    fork.git("add", "-A", cwd=fork.root)
    fork.git("commit", "-qm", "the series", cwd=fork.root)
    # a fixup commit in build/fork, exported, then the export thrown away in the repository
    fork.commit_in_tree("fixup! [Ops][BugFix] Guard the copy", {"vllm_ascend/ops/extra.py": "X = 1\n"})
    subprocess.run(
        ["git", "rebase", "-q", "-i", "--autosquash", "v1.0.0"],
        cwd=fork.tree,
        check=True,
        capture_output=True,
        env={**os.environ, "GIT_SEQUENCE_EDITOR": "true"},
    )
    fork.run("export")
    fork.git("checkout", "-q", ".", cwd=fork.root)
    fork.git("clean", "-qfd", cwd=fork.root)
    head = fork.git("rev-parse", "HEAD")
    assert "stale" in fork.run("status").stdout
    before = _state(fork)
    proc = fork.run("apply", check=False)
    assert proc.returncode == 6
    assert "[Ops][BugFix] Guard the copy" in proc.stderr and head[:7] in proc.stderr
    assert "export" in proc.stderr and "--force" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _state(fork) == before and fork.git("rev-parse", "HEAD") == head
    # keep it: export again (patches/ now holds it), and apply is content
    fork.run("export")
    assert "up to date" in fork.run("apply").stdout
    assert (fork.tree / "vllm_ascend/ops/extra.py").exists()
    # or drop it on purpose
    fork.git("checkout", "-q", ".", cwd=fork.root)
    fork.git("clean", "-qfd", cwd=fork.root)
    assert "reapplied" in fork.run("apply", "--force").stdout
    assert not (fork.tree / "vllm_ascend/ops/extra.py").exists()


def test_apply_reapplies_a_series_changed_by_a_pull(fork_with_patch):
    """patches/ changed in the repository (e.g. `git pull`): the tree's commits were committed once
    (git knows their patch files), so re-applying loses nothing and is not refused."""
    fork = fork_with_patch
    fork.git("add", "-A", cwd=fork.root)
    fork.git("commit", "-qm", "the series", cwd=fork.root)
    fork.commit_in_tree(pr_message("[Ops][Feature] Second"), {"vllm_ascend/ops/second.py": "Y = 2\n"})
    fork.run("export")
    fork.git("add", "-A", cwd=fork.root)
    fork.git("commit", "-qm", "second patch", cwd=fork.root)
    fork.git("reset", "-q", "--hard", "HEAD~1", cwd=fork.root)  # as if another branch were pulled
    fork.git("clean", "-qfd", cwd=fork.root)
    out = fork.run("apply").stdout
    assert "reapplied" in out
    assert (fork.tree / "vllm_ascend/ops/memmove.py").read_text() == FIX_FILES["vllm_ascend/ops/memmove.py"]
    assert not (fork.tree / "vllm_ascend/ops/second.py").exists()
