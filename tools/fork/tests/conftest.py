"""Fixtures for the tooling's tests: a small synthetic upstream release and a fork pinned to it.

The release is an sdist with a known sha256 and the fork a throwaway repository, so the tooling can
be tested fast and without network."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# A developer identity for commits the tests make (independent of the machine's git config).
DEV_IDENTITY = {
    "GIT_AUTHOR_NAME": "Test Dev",
    "GIT_AUTHOR_EMAIL": "dev@example.com",
    "GIT_COMMITTER_NAME": "Test Dev",
    "GIT_COMMITTER_EMAIL": "dev@example.com",
}
# Every git command a test runs itself (the developer's part: commit, rebase -i, ...) has it: a fresh
# machine has no git identity, and a test must not depend on the one this machine happens to have.
os.environ.update(DEV_IDENTITY)
GIT_ENV = {**os.environ, **DEV_IDENTITY}
# What the tooling itself gets in Fork.run: no identity and no git config of the machine's user, as on a
# fresh machine (its own git calls fix their identity: tools/fork/core/git.py).
_NO_IDENTITY = {k: "" for k in DEV_IDENTITY}

UPSTREAM_FILES = {
    "setup.py": textwrap.dedent(
        """\
        import os
        from setuptools import find_packages, setup

        setup(
            name="vllm_ascend",
            version=os.environ.get("SETUPTOOLS_SCM_PRETEND_VERSION", "0.0.0"),
            packages=find_packages(exclude=("tests*",)),
        )
        """
    ),
    "README.md": "# synthetic upstream\n",
    ".gitignore": "build/\n*.egg-info/\n/vllm_ascend/_version.py\n",
    "vllm_ascend/__init__.py": "",
    "vllm_ascend/_version.py": "__version__ = 'generated'\n",
    "vllm_ascend/envs.py": "".join(f"# line {i}\n" for i in range(1, 41)),
    "vllm_ascend/ops/__init__.py": "",
    "vllm_ascend/ops/copy.py": textwrap.dedent(
        """\
        def copy(dst, src):
            # unguarded
            dst[:] = src
        """
    ),
    "tests/ut/test_smoke.py": "def test_smoke():\n    assert True\n",
}


def make_sdist(dest_dir: Path, version: str, files: dict[str, str], *, extra_pkg_info: bool = True) -> Path:
    """A deterministic sdist tar.gz of `files` (top folder vllm_ascend-<version>)."""
    top = f"vllm_ascend-{version}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries = dict(files)
        if extra_pkg_info:
            entries["PKG-INFO"] = f"Metadata-Version: 2.1\nName: vllm_ascend\nVersion: {version}\n"
        for rel, text in sorted(entries.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size, info.mtime, info.mode = len(data), 1_000_000_000, 0o644
            tar.addfile(info, io.BytesIO(data))
    path = dest_dir / f"{top}.tar.gz"
    import gzip

    with gzip.GzipFile(path, "wb", mtime=0) as gz:
        gz.write(buf.getvalue())
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Fork:
    root: Path
    cache: Path
    version: str

    def run(self, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "tools.fork", "-C", str(self.root), *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            env={
                **{k: v for k, v in os.environ.items() if k not in _NO_IDENTITY},
                "GIT_CONFIG_GLOBAL": os.devnull,
                "FORK_CACHE": str(self.cache),
                "PYTHONPATH": str(self.root),
                **(env or {}),
            },
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"fork {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    @property
    def tree(self) -> Path:
        return self.root / "build" / "fork"

    def git(self, *args: str, cwd: Path | None = None) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd or self.tree, check=True, capture_output=True, text=True, env=GIT_ENV
        ).stdout.strip()

    def commit_in_tree(self, message: str, files: dict[str, str | None], *, signoff: bool = True) -> None:
        """Edit files in the materialized tree and commit them as one patch."""
        for rel, text in files.items():
            path = self.tree / rel
            if text is None:
                path.unlink()
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        self.git("add", "-A")
        self.git("commit", "-q", *(["-s"] if signoff else []), "-m", message)

    def protected(self) -> dict:
        from tools.fork.core.txn import snapshot

        return snapshot(
            [self.root / "patches", self.root / "fork.toml", self.root / "vllm_ascend", self.root / "tests"]
        )


def pr_message(title: str, what: str = "Fixes a thing.") -> str:
    return (
        f"{title}\n\n### What this PR does / why we need it?\n{what}\n\n"
        "### Does this PR introduce _any_ user-facing change?\nNo.\n\n"
        "### How was this patch tested?\npytest tests/ut\n"
    )


def new_fork(tmp_path: Path, version: str = "1.0.0", files: dict | None = None) -> Fork:
    """A fork repository (tools/ copied from this repo) pinned to a synthetic sdist in its cache."""
    root, cache = tmp_path / "fork", tmp_path / "cache"
    (cache / "sdists").mkdir(parents=True)
    sdist = make_sdist(cache / "sdists", version, files or UPSTREAM_FILES)
    root.mkdir()
    shutil.copytree(REPO / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__", "tests"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "patches").mkdir()
    (root / "patches" / "series").write_text("")
    digest = sha256(sdist)
    (root / "fork.toml").write_text(
        f'[upstream]\ndist = "vllm-ascend"\nversion = "{version}"\nsha256 = "{digest}"\n\n'
        f'[[bases]]\nversion = "{version}"\nsha256 = "{digest}"\n'
    )
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "fork repo"]):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, env=GIT_ENV)
    return Fork(root, cache, version)


FIX_FILES = {
    "vllm_ascend/ops/copy.py": "def copy(dst, src):\n    # guarded: memmove semantics\n    dst[:] = list(src)\n",
    "vllm_ascend/ops/memmove.py": "def memmove(dst, src):\n    dst[:] = list(src)\n",
    "tests/ut/ops/test_memmove.py": "def test_memmove():\n    assert True\n",
}


@pytest.fixture
def fork(tmp_path) -> Fork:
    return new_fork(tmp_path)


@pytest.fixture
def fork_with_patch(fork) -> Fork:
    """A fork with one exported patch that edits an upstream file and adds two files."""
    fork.run("apply")
    fork.commit_in_tree(pr_message("[Ops][BugFix] Guard the copy"), FIX_FILES)
    fork.run("export")
    return fork
