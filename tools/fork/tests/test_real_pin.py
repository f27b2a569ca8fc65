"""The tooling on the real pinned release (downloads the sdist once into the cache)."""

from __future__ import annotations

import subprocess
import sys

from tools.fork.core import config, series
from tools.fork.tests.conftest import REPO


def _fork(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.fork", *args], cwd=REPO, capture_output=True, text=True, check=check
    )


def test_real_pin_applies_and_checks(tmp_path):
    cfg = config.load(REPO)
    tree = tmp_path / "fork"
    proc = _fork("apply", "--into", str(tree))
    assert f"vllm-ascend {cfg.pin.version}" in proc.stdout
    log = subprocess.run(["git", "log", "--format=%s"], cwd=tree, capture_output=True, text=True, check=True)
    subjects = log.stdout.splitlines()
    assert subjects[-1] == f"upstream {cfg.pin.version}"
    assert subjects[:-1][::-1] == [p.info.subject for p in series.read(cfg)]
    assert (tree / "vllm_ascend" / "patch" / "worker" / "patch_mamba_utils.py").exists()
    assert "up to date" in _fork("apply", "--into", str(tree)).stdout
    check = _fork("check", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
