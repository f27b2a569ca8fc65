"""`deploy` into a vllm-ascend git checkout, and docker/deploy-installed.sh, on synthetic inputs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tools.fork.core import git
from tools.fork.tests.deploy_fixtures import *  # noqa: F401 (fixtures and helpers)
from tools.fork.tests.deploy_fixtures import _offline_cache  # noqa: F401 (an autouse fixture)

# ---------------------------------------------------------------------------------------------
# git checkout


def make_checkout(tmp: Path, version: str, files: dict[str, str]) -> Path:
    root = tmp / "vllm-ascend"
    write_tree(root, files)
    git.run(["init", "-q", "-b", "main"], root)
    git.run(["add", "-A"], root)
    git.run(["commit", "-q", "-m", f"release {version}"], root)
    git.run(["tag", f"v{version}"], root)
    return root


def test_checkout_deploy_verify_revert(repo, tmp_path, capsys):
    root = make_checkout(tmp_path, PIN, UPSTREAM)
    pre = git.out(["rev-parse", "HEAD"], root)
    before = snapshot(root / "vllm_ascend", root / "tests", root / "docs")

    code, out = deploy(repo, capsys, "--to", root)
    assert code == 0, out
    subjects = git.out(["log", "--format=%s", f"{pre}..HEAD"], root).splitlines()
    assert subjects == [s for s, _ in reversed(SERIES)]
    for rel, text in fork_files(UPSTREAM).items():  # tests and docs too: it is a checkout
        assert (root / rel).read_text() == text if text is not None else not (root / rel).exists(), rel
    assert git.is_clean(root)
    code, out = deploy(repo, capsys, "--verify", root)
    assert code == 0, out
    assert "tests/ut/worker/test_state_copy.py" in out

    refused(repo, capsys, root / "vllm_ascend", "--to", root, code=2, says="already deployed")

    code, out = deploy(repo, capsys, "--revert", root)
    assert code == 0, out
    assert git.out(["rev-parse", "HEAD"], root) == pre
    assert git.out(["symbolic-ref", "--short", "HEAD"], root) == "main"
    assert snapshot(root / "vllm_ascend", root / "tests", root / "docs") == before
    assert not (root / ".git" / "fork-deploy.json").exists()


def test_checkout_refusals(repo, tmp_path, capsys):
    root = make_checkout(tmp_path, PIN, UPSTREAM)
    refused(repo, capsys, root, "--revert", root, code=2, says="nothing to revert")
    (root / "vllm_ascend/envs.py").write_text("dirty\n")
    refused(repo, capsys, root, "--to", root, code=6, says="uncommitted changes")
    git.run(["checkout", "--", "."], root)
    git.run(["tag", "-d", f"v{PIN}"], root)
    refused(repo, capsys, root, "--to", root, code=2, says="pass --base VERSION")


def test_checkout_conflict_changes_nothing(repo, tmp_path, capsys):
    root = make_checkout(tmp_path, PIN, UPSTREAM)
    (root / "vllm_ascend/ops/copy.py").write_text("def copy(src, dst):\n    dst.copy_(src)\n")
    git.run(["commit", "-q", "-am", "local change"], root)
    git.run(["tag", "-f", f"v{PIN}"], root)
    head = git.out(["rev-parse", "HEAD"], root)
    before = snapshot(root / "vllm_ascend", root / "tests", root / "docs")
    code, out = deploy(repo, capsys, "--to", root)
    assert code == 1, out
    assert "patch 0002-" in out and "does not apply" in out, "the failing patch is named"
    assert git.out(["rev-parse", "HEAD"], root) == head, "the first patch, which applied, is rolled back too"
    assert not git.am_in_progress(root)
    assert git.is_clean(root)
    assert snapshot(root / "vllm_ascend", root / "tests", root / "docs") == before
    assert not (root / ".git" / "fork-deploy.json").exists()


def test_editable_install_from_git_checkout_is_patched_in_place(repo, tmp_path, capsys):
    """Upstream's images: `pip install -e` from a git checkout; the package dir is inside it."""
    root = make_checkout(tmp_path, PIN, UPSTREAM)
    (root / ".gitignore").write_text("/vllm_ascend/_version.py\n/vllm_ascend-fork-deploy/\n")
    git.run(["add", ".gitignore"], root)
    git.run(["commit", "-q", "-m", "ignore generated files"], root)
    (root / "vllm_ascend/_version.py").write_text(f"__version__ = version = '{PIN}'\n")
    head = git.out(["rev-parse", "HEAD"], root)
    before = snapshot(root / "vllm_ascend", root / "tests")
    code, out = deploy(repo, capsys, "--to", root / "vllm_ascend")
    assert code == 0, out
    assert "is a git checkout: files are patched in place" in out
    assert git.out(["rev-parse", "HEAD"], root) == head, "no commits in package mode"
    assert deploy(repo, capsys, "--verify", root / "vllm_ascend")[0] == 0
    assert deploy(repo, capsys, "--revert", root / "vllm_ascend")[0] == 0
    assert snapshot(root / "vllm_ascend", root / "tests") == before
    assert git.is_clean(root)


def test_deploy_installed_script(repo, tmp_path):
    """docker/deploy-installed.sh (what the Dockerfile runs) on a venv whose vllm_ascend is a fake install."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    site = make_site(tmp_path / "fake", PIN, UPSTREAM)
    shutil.copytree(site, purelib, dirs_exist_ok=True)
    before = snapshot(Path(purelib))
    env = dict(os.environ, FORK_REPO=str(repo["root"]))
    proc = subprocess.run(["sh", str(SCRIPT), str(python)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"imports vllm_ascend from {Path(purelib).resolve() / 'vllm_ascend'}" in proc.stdout
    assert "fork deploy --verify: OK" in proc.stdout
    assert (Path(purelib) / "vllm_ascend/worker/state_copy.py").read_text() == NEW_MODULE
    proc = subprocess.run(["sh", str(SCRIPT), str(python)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "already deployed" in proc.stderr, "a second run fails the image build"
    code = cli.main(["-C", str(repo["root"]), "deploy", "--revert", str(Path(purelib) / "vllm_ascend")])
    assert code == 0
    assert snapshot(Path(purelib)) == before
