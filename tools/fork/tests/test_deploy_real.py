"""`deploy` against a REAL pip-installed vllm-ascend (tools/fork/deploy/check.py), marked `real`.

Needs the CPU test environment (build/testenv/venv, or FORK_DEPLOY_PYTHON); skipped without it,
and unless selected with `-m real` (or FORK_DEPLOY_PYTHON is set).
  - the stand-in series: a small series made here on the real pinned base (an upstream file
    changed, a module added, a CPU test added, a docs file changed), so the mechanism is tested
    whatever state patches/ is in;
  - the repository's own series (patches/), once it changes anything under vllm_ascend/.
Run: `python -m pytest -m real tools/fork/tests/test_deploy_real.py` (about a minute warm).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tools.fork.core import config, git, upstream
from tools.fork.core.materialize import create_base
from tools.fork.core.series import render
from tools.fork.deploy import check as deploy_check
from tools.fork.deploy.expected import expected

pytestmark = pytest.mark.real

REAL = config.load()
PYTHON = deploy_check.default_python(REAL)
needs_env = pytest.mark.skipif(not PYTHON.exists(), reason=f"no test environment Python at {PYTHON}")


@pytest.fixture(autouse=True)
def _only_when_asked(request):
    """A minute each: run with `-m real` (or FORK_DEPLOY_PYTHON set); the `test` verb calls deploy_check itself."""
    if "real" not in (request.config.getoption("markexpr") or "") and not os.environ.get("FORK_DEPLOY_PYTHON"):
        pytest.skip("real deploy test: select it with `-m real`")


STANDIN_MODULE = '''\
"""Stand-in of a module the fork adds (tools/fork/tests/test_deploy_real.py)."""


def memmove_pairs(pairs):
    """Copy each (src, dst) tensor pair in order, overlap-safe."""
    for src, dst in pairs:
        dst.copy_(src.clone())
'''

STANDIN_TEST = """\
import numpy as np
import torch

from vllm_ascend import envs
from vllm_ascend.worker.deploy_standin import memmove_pairs


def test_env_registered(monkeypatch):
    monkeypatch.delenv("VLLM_ASCEND_DEPLOY_STANDIN", raising=False)
    assert envs.VLLM_ASCEND_DEPLOY_STANDIN == "torch"
    monkeypatch.setenv("VLLM_ASCEND_DEPLOY_STANDIN", "memmove")
    assert envs.VLLM_ASCEND_DEPLOY_STANDIN == "memmove"


def test_overlapping_moves_match_numpy_memmove():
    buf = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expect = buf.numpy().copy()
    pairs = [(4, 0, 200), (0, 9, 100), (30, 30, 10)]  # left shift, right shift, in place
    for src, dst, n in pairs:
        expect[dst : dst + n] = expect[src : src + n].copy()
    memmove_pairs([(buf[s : s + n], buf[d : d + n]) for s, d, n in pairs])
    assert np.array_equal(buf.numpy(), expect)
"""

ENV_LINE = '    "VLLM_ASCEND_DEPLOY_STANDIN": lambda: os.getenv("VLLM_ASCEND_DEPLOY_STANDIN", "torch"),\n'


def standin_repo(tmp: Path) -> config.ForkConfig:
    """A fork repository with the real pin and a stand-in series made on the real base."""
    root = tmp / "standin"
    (root / "patches").mkdir(parents=True)
    shutil.copy2(REAL.toml_path, root / "fork.toml")
    tree = tmp / "mat"
    create_base(upstream.obtain(REAL).source, tree)
    envs = tree / "vllm_ascend" / "envs.py"
    text = envs.read_text()
    anchor = "env_variables: dict[str, Callable[[], Any]] = {\n"
    assert anchor in text, "the pinned base's envs.py changed shape; update the stand-in"
    envs.write_text(text.replace(anchor, anchor + ENV_LINE, 1))
    (tree / "vllm_ascend/worker/deploy_standin.py").write_text(STANDIN_MODULE)
    (tree / "tests/ut/worker/test_deploy_standin.py").write_text(STANDIN_TEST)
    with (tree / "README.md").open("a") as f:
        f.write("\nStand-in change outside the package (skipped by an installed-package deploy).\n")
    git.run(["add", "-A"], tree)
    msg = "[Misc][Test] Deploy stand-in\n\nSigned-off-by: vllm-ascend-fork <fork@localhost>"
    git.run(["commit", "-q", "-m", msg], tree)
    names = []
    for name, data in render(tree, REAL.pin.version):
        (root / "patches" / name).write_bytes(data)
        names.append(name)
    (root / "patches" / "series").write_text("".join(f"{n}\n" for n in names))
    return config.load(root)


@needs_env
def test_standin_series_on_real_installed_package(tmp_path):
    cfg = standin_repo(tmp_path)
    result = deploy_check.check(cfg, PYTHON, work=REAL.build_dir / "deploy-check")
    print(result.summary())
    assert result.changed == ["M vllm_ascend/envs.py", "A vllm_ascend/worker/deploy_standin.py"]
    assert result.test_files == ["tests/ut/worker/test_deploy_standin.py"]
    assert result.tests == {"passed": 2, "failed": 0, "error": 0, "skipped": 0}


@needs_env
def test_repository_series_on_real_installed_package():
    exp = expected(REAL, REAL.pin.version)
    if not any(ch.status != "=" for ch in exp.changes):
        pytest.skip("patches/ changes nothing under vllm_ascend/ yet")
    result = deploy_check.check(REAL, PYTHON)
    print(result.summary())
    assert result.tests.get("passed", 0) > 0 or not result.test_files
