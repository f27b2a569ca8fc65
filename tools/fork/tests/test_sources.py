"""Honest sources: a checkout's version is read and checked; verified sources are cached/remembered."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tools.fork.core import registry, upstream
from tools.fork.core.config import Base
from tools.fork.core.errors import BadInput
from tools.fork.tests.synthetic import UPSTREAM, Fork, make_sdist


def _tree(root: Path, files: dict[str, str] = UPSTREAM) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def _tagged(root: Path, tag: str) -> Path:
    _tree(root)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-q", "-m", "x")
    _git(root, "tag", tag)
    return root


def test_checkout_version_from_its_git_tag_and_a_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    tree = _tagged(tmp_path / "co", "v0.30.0rc2")
    assert upstream.checkout_version(tree) == ("0.30.0rc2", "git tag v0.30.0rc2")
    assert upstream._from_checkout(tree, "0.30.0rc2").checkout == tree
    with pytest.raises(BadInput, match=r"is vllm-ascend 0.30.0rc2 \(git tag v0.30.0rc2\), not 0.26.0rc1"):
        upstream._from_checkout(tree, "0.26.0rc1")


def test_checkout_version_from_pkg_info_or_the_version_its_build_reports(tmp_path):
    a = _tree(tmp_path / "a")
    (a / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm_ascend\nVersion: 0.26.0rc1\n")
    assert upstream.checkout_version(a)[0] == "0.26.0rc1"
    b = _tree(tmp_path / "b", {**UPSTREAM, "vllm_ascend/_version.py": "__version__ = version = '0.24.0rc1'\n"})
    assert upstream.checkout_version(b)[0] == "0.24.0rc1"


def test_a_checkout_of_unknown_version_is_refused_unless_version_unchecked(tmp_path, monkeypatch):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    tree = _tree(tmp_path / "co")
    with pytest.raises(BadInput, match="cannot tell which vllm-ascend version.*--version-unchecked"):
        upstream._from_checkout(tree, "0.30.0rc2")
    src = upstream._from_checkout(tree, "0.30.0rc2", version_unchecked=True)
    assert "NOT checked" in src.verified
    assert upstream._remembered_checkout("0.30.0rc2") is None  # an unchecked tree is never remembered


def test_a_verified_checkout_is_remembered_instead_of_downloading(tmp_path, monkeypatch):
    fork = Fork(tmp_path, monkeypatch, {"1.0": UPSTREAM}, "1.0", ["1.0"])
    for f in (fork.cache / "sdists").glob("*"):
        f.unlink()
    tree = _tagged(tmp_path / "co", "v1.0")
    fork.ok("apply", "--checkout", str(tree), "--base-only")
    # no sdist in the cache and no registry: the remembered checkout is used
    monkeypatch.setattr(registry, "_pip_download", lambda *a, **k: pytest.fail("downloaded"))
    from tools.fork.core import config

    release = upstream.obtain(config.load(fork.root), "1.0")
    src = release.source
    assert release.base == Base("1.0", fork.sha["1.0"]) and not release.first_use
    assert src.checkout == tree.resolve() and "remembered" in src.verified


def test_a_verified_sdist_is_cached(tmp_path, monkeypatch):
    fork = Fork(tmp_path, monkeypatch, {"1.0": UPSTREAM}, "1.0", ["1.0"])
    for f in (fork.cache / "sdists").glob("*"):
        f.unlink()
    path, _ = make_sdist(fork.elsewhere, "1.0", UPSTREAM)
    fork.ok("apply", "--sdist", str(path), "--base-only")
    assert (fork.cache / "sdists" / path.name).read_bytes() == path.read_bytes()


def test_any_release_resolves_with_its_version_checked(tmp_path, monkeypatch):
    fork = Fork(tmp_path, monkeypatch, {"1.0": UPSTREAM, "1.2rc1": UPSTREAM}, "1.0", ["1.0"])
    from tools.fork.core import config

    cfg = config.load(fork.root)
    with pytest.raises(BadInput, match="1.2rc1 is not a base of this fork"):
        upstream.obtain(cfg, "1.2rc1")  # the verbs that take only fork.toml's bases
    release = upstream.obtain(cfg, "1.2rc1", listed_only=False)
    assert release.first_use and release.base.sha256 == fork.sha["1.2rc1"] and release.source.sdist is not None
    wrong, _ = make_sdist(fork.elsewhere, "1.3", UPSTREAM)
    with pytest.raises(BadInput, match="is version 1.3, not 1.2rc1"):
        upstream.obtain(cfg, "1.2rc1", sdist=wrong, listed_only=False)
