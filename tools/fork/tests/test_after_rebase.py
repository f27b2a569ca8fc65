"""The tooling's tests pass right after any successful rebase: none may pin today's pin, bases or hashes.

A scratch copy of this repository is rebased onto another base fork.toml stores (its sdist from the
cache), then the tooling tests that read the repository's own state (its fork.toml, patches/,
README) run there. A test that hard-codes today's pin or a base's sha256 fails in that copy.
Marked `slow` (a real rebase and a second pytest run: a few minutes); `make test` runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.fork.core import config

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[3]
# A test module reads the repository's own state when it names its root or loads its fork.toml.
_READS_THE_REPOSITORY = re.compile(r"\bREPO(_ROOT)?\b|config\.load\(\)")


def _scratch_copy(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, files):
        src = REPO_ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def test_the_tooling_tests_pass_after_a_rebase_onto_another_stored_base(tmp_path, monkeypatch):
    monkeypatch.delenv("FORK_CACHE", raising=False)
    here = config.load(REPO_ROOT)
    sdists = config.cache_dir() / "sdists"
    others = [
        b.version for b in here.bases
        if b.version != here.pin.version and (sdists / f"vllm_ascend-{b.version}.tar.gz").exists()
    ]  # fmt: skip
    if not others:
        pytest.skip(f"no other base's sdist in {sdists}")
    clone = tmp_path / "clone"
    _scratch_copy(clone)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FORK_CACHE", "FORK_TEST_PYTHON")}
    env.update(PYTHONPATH=str(clone), FORK_REBASE_NO_TEST="1")

    def commit(message: str) -> None:  # as the maintainer commits the rebase (README's tests clone it)
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "--no-verify", "-m", message]):
            subprocess.run(["git", *args], cwd=clone, check=True, capture_output=True, env=env)

    commit("the repository as it is")
    rebase = subprocess.run(
        [sys.executable, "-m", "tools.fork", "rebase", "--onto", others[0], "--older"],
        cwd=clone, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert rebase.returncode == 0, rebase.stdout[-3000:] + rebase.stderr[-3000:]
    assert config.load(clone).pin.version == others[0]
    commit(f"rebase onto {others[0]}")

    tests = sorted(
        p.relative_to(clone).as_posix()
        for p in (clone / "tools" / "fork" / "tests").glob("test_*.py")
        if p.name != Path(__file__).name and _READS_THE_REPOSITORY.search(p.read_text())
    )
    assert tests, "no tooling test reads the repository's state?"
    venv = REPO_ROOT / "build" / "tools-venv"  # what `make` made here; README's commands use it
    if venv.is_dir():
        (clone / "build").mkdir(exist_ok=True)
        (clone / "build" / "tools-venv").symlink_to(venv)
    # Left out: `real` tests (an installed vllm-ascend), and the rebase that builds a release's own test
    # environment (test_rebase_real's last test: minutes, and the same in any clone).
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not real",
         "-k", "not picks_the_snapshot_variant_by_its_test", *tests],
        cwd=clone, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
