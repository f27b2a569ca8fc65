"""`deploy` into an installed package (fake site-packages with dist-info and RECORD), on synthetic inputs.

Oracles: the expected file contents are computed in Python from the series' edits (deploy_fixtures.py),
and "nothing changed" / "byte-identical" are snapshots of every file.
"""

from __future__ import annotations

import csv
import io
import os

import pytest

from tools.fork.core import txn
from tools.fork.deploy.dist_record import record_with
from tools.fork.deploy.target import BACKUP_DIR
from tools.fork.tests.deploy_fixtures import *  # noqa: F401 (fixtures and helpers)
from tools.fork.tests.deploy_fixtures import _offline_cache  # noqa: F401 (an autouse fixture)

# ---------------------------------------------------------------------------------------------
# installed package


def test_deploy_verify_revert_installed_package(repo, tmp_path, capsys):
    site = make_site(tmp_path, PIN, UPSTREAM)
    pkg = site / "vllm_ascend"
    before = snapshot(site)

    code, out = deploy(repo, capsys, "--to", pkg)
    assert code == 0, out
    for rel, text in package_expectation(UPSTREAM).items():
        if text is None:
            assert not (site / rel).exists(), rel
        else:
            assert (site / rel).read_text() == text, rel
    assert (site / "vllm_ascend/untouched.py").read_text() == UPSTREAM["vllm_ascend/untouched.py"]
    assert not (site / "tests").exists() and not (site / "docs").exists(), "tests and docs hunks are skipped"
    assert not (pkg / "__pycache__/envs.cpython-311.pyc").exists(), "bytecode of a patched file is dropped"
    assert (site / BACKUP_DIR / "manifest.json").is_file()
    # RECORD describes the fork: pip uninstall removes every file of the package and the backup.
    listed = record_paths(site)
    on_disk = {p.relative_to(site).as_posix() for p in txn.snapshot([pkg, site / BACKUP_DIR])}
    assert on_disk <= listed, on_disk - listed
    assert "vllm_ascend/old.py" not in listed
    (dist,) = site.glob("vllm_ascend-*.dist-info")
    rows = {r[0]: r for r in csv.reader(io.StringIO((dist / "RECORD").read_text())) if r}
    new = (site / "vllm_ascend/worker/state_copy.py").read_bytes()
    assert rows["vllm_ascend/worker/state_copy.py"][1:] == [record_hash(new), str(len(new))]

    code, out = deploy(repo, capsys, "--verify", pkg)
    assert code == 0, out
    assert "MISMATCH" not in out
    for rel in package_expectation(UPSTREAM):
        assert rel in out
    assert "tests/ut" not in out
    assert "deployed in place" in out

    # Python compiles the fork's modules when they are imported after the deploy.
    assert not (pkg / "__pycache__").exists(), "its only file was the stale bytecode"
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__/envs.cpython-311.pyc").write_bytes(b"bytecode of the fork's envs.py")
    (pkg / "worker/__pycache__").mkdir()
    (pkg / "worker/__pycache__/state_copy.cpython-311.pyc").write_bytes(b"bytecode of an added module")

    code, out = deploy(repo, capsys, "--revert", pkg)
    assert code == 0, out
    after = snapshot(site)
    assert after == before, "revert must restore every path and byte: package, dist-info, __pycache__, folders"
    assert (pkg / "__pycache__/envs.cpython-311.pyc").read_bytes() == b"stale bytecode of envs.py"
    assert not (site / BACKUP_DIR).exists()
    assert not (site / "vllm_ascend/worker").exists(), "a directory the deploy created is removed again"

    code, out = deploy(repo, capsys, "--verify", pkg)
    assert code == 1
    assert "MISMATCH" in out and "FAILED" in out


def test_site_packages_directory_is_accepted(repo, tmp_path, capsys):
    site = make_site(tmp_path, PIN, UPSTREAM)
    before = snapshot(site)
    assert deploy(repo, capsys, "--to", site)[0] == 0
    assert deploy(repo, capsys, "--verify", site)[0] == 0
    assert deploy(repo, capsys, "--revert", site)[0] == 0
    assert snapshot(site) == before


def test_older_base_gets_its_variant(repo, tmp_path, capsys):
    site = make_site(tmp_path, OLD, UPSTREAM_OLD)
    before = snapshot(site)
    code, out = deploy(repo, capsys, "--to", site / "vllm_ascend")
    assert code == 0, out
    assert (site / "vllm_ascend/ops/copy.py").read_text() == package_expectation(UPSTREAM_OLD)[
        "vllm_ascend/ops/copy.py"
    ]
    assert "dst[...] = src.clone()" in (site / "vllm_ascend/ops/copy.py").read_text()
    assert deploy(repo, capsys, "--verify", site / "vllm_ascend")[0] == 0
    assert deploy(repo, capsys, "--revert", site / "vllm_ascend")[0] == 0
    assert snapshot(site) == before


def test_editable_source_tree_without_dist_info(repo, tmp_path, capsys):
    """The package dir of an editable install from a source tree (no .git): version from _version.py."""
    tree = tmp_path / "vllm-ascend"
    write_tree(tree, dict(UPSTREAM, **{"vllm_ascend/_version.py": f"__version__ = version = '{PIN}'\n"}))
    before = snapshot(tree)
    code, out = deploy(repo, capsys, "--to", tree / "vllm_ascend")
    assert code == 0, out
    assert "RECORD is not updated" in out
    assert (tree / "vllm_ascend/envs.py").read_text() == package_expectation(UPSTREAM)["vllm_ascend/envs.py"]
    assert (tree / "tests/ut/test_envs.py").read_text() == UPSTREAM["tests/ut/test_envs.py"], "tests are skipped"
    assert deploy(repo, capsys, "--verify", tree / "vllm_ascend")[0] == 0
    assert deploy(repo, capsys, "--revert", tree / "vllm_ascend")[0] == 0
    assert snapshot(tree) == before


# ---------------------------------------------------------------------------------------------
# refusals: a clear message, a distinct exit code, nothing changed


def test_refuses_second_deploy(repo, tmp_path, capsys):
    site = make_site(tmp_path, PIN, UPSTREAM)
    assert deploy(repo, capsys, "--to", site / "vllm_ascend")[0] == 0
    refused(repo, capsys, site, "--to", site / "vllm_ascend", code=2, says="already deployed")


def test_refuses_when_fork_content_is_already_there(repo, tmp_path, capsys):
    """E.g. an image built from the fork's wheel: nothing to deploy, but --verify proves it."""
    fork_upstream = {p: t for p, t in {**UPSTREAM, **fork_files(UPSTREAM)}.items() if t is not None}
    site = make_site(tmp_path, PIN, fork_upstream)
    refused(repo, capsys, site, "--to", site / "vllm_ascend", code=2, says="already has the fork's content")
    code, out = deploy(repo, capsys, "--verify", site / "vllm_ascend")
    assert code == 0, out
    assert "no deploy record" in out


def test_the_forks_own_wheel_is_refused_and_verified(repo, tmp_path, capsys):
    """An image that installed the fork's wheel (`build`): deploy refuses, --verify proves the content."""
    fork_upstream = {p: t for p, t in {**UPSTREAM, **fork_files(UPSTREAM)}.items() if t is not None}
    site = make_site(tmp_path, PIN, fork_upstream, metadata_version=f"{PIN}+fork.3.gabcdef12")
    refused(repo, capsys, site, "--to", site / "vllm_ascend", code=2, says="the fork's own build")
    code, out = deploy(repo, capsys, "--verify", site / "vllm_ascend")
    assert code == 0, out
    assert "OK" in out and "the fork's own build" in out
    # and a "+fork" version whose files are upstream's fails verification
    site2 = make_site(tmp_path / "2", PIN, UPSTREAM, metadata_version=f"{PIN}+fork.3.gabcdef12")
    code, out = deploy(repo, capsys, "--verify", site2 / "vllm_ascend")
    assert code == 1 and "MISMATCH" in out


def test_refuses_unsupported_version(repo, tmp_path, capsys):
    site = make_site(tmp_path, "1.0.0", UPSTREAM)
    out = refused(repo, capsys, site, "--to", site / "vllm_ascend", code=2, says="1.0.0 is not a base")
    assert PIN in out and OLD in out, "the message lists the supported bases"


def test_refuses_modified_file(repo, tmp_path, capsys):
    site = make_site(tmp_path, PIN, UPSTREAM)
    with (site / "vllm_ascend/ops/copy.py").open("a") as f:
        f.write("# local hotfix\n")
    out = refused(
        repo, capsys, site, "--to", site / "vllm_ascend", code=6, says="vllm_ascend/ops/copy.py: differs from upstream"
    )
    assert "envs.py" not in out, "only the differing file is named"
    assert not (site / BACKUP_DIR).exists()


def test_refuses_missing_file_and_file_the_series_creates(repo, tmp_path, capsys):
    site = make_site(tmp_path, PIN, UPSTREAM)
    (site / "vllm_ascend/old.py").unlink()
    write_tree(site, {"vllm_ascend/worker/state_copy.py": "mine\n"})
    out = refused(repo, capsys, site, "--to", site / "vllm_ascend", code=6, says="vllm_ascend/old.py: missing")
    assert "vllm_ascend/worker/state_copy.py: exists, but upstream has no such file" in out


def test_refuses_revert_without_backup(repo, tmp_path, capsys):
    site = make_site(tmp_path, PIN, UPSTREAM)
    refused(repo, capsys, site, "--revert", site / "vllm_ascend", code=2, says="nothing to revert")


@pytest.mark.parametrize("kind", ["missing", "file", "empty dir", "other package"])
def test_refuses_what_is_not_a_package(repo, tmp_path, capsys, kind):
    site = make_site(tmp_path, PIN, UPSTREAM)
    path = {
        "missing": tmp_path / "nope",
        "file": site / "vllm_ascend/envs.py",
        "empty dir": tmp_path / "empty",
        "other package": site / "other_pkg",
    }[kind]
    if kind == "empty dir":
        path.mkdir()
    for verb in ("--to", "--verify", "--revert"):
        refused(repo, capsys, site, verb, path, code=2, says=str(path))


def test_revert_refuses_edits_made_after_deploy_unless_forced(repo, tmp_path, capsys):
    site = make_site(tmp_path, PIN, UPSTREAM)
    before = snapshot(site)
    assert deploy(repo, capsys, "--to", site / "vllm_ascend")[0] == 0
    with (site / "vllm_ascend/envs.py").open("a") as f:
        f.write("# edited after the deploy\n")
    refused(repo, capsys, site, "--revert", site / "vllm_ascend", code=6, says="vllm_ascend/envs.py")
    refused(repo, capsys, site, "--revert", site / "vllm_ascend", code=6, says="Pass --force to restore the originals")
    assert deploy(repo, capsys, "--force", "--revert", site / "vllm_ascend")[0] == 0
    assert snapshot(site) == before


@pytest.mark.parametrize("where", ["staging", "renames"])
def test_failed_write_leaves_package_and_no_backup(repo, tmp_path, capsys, monkeypatch, where):
    """A write that fails while staging (disk full) or halfway through the renames (an I/O error) is
    rolled back: the package as before, no backup, one line and exit 1."""
    from tools.fork.deploy import package

    site = make_site(tmp_path, PIN, UPSTREAM)
    before = snapshot(site)
    calls = []
    real = package.write_file if where == "staging" else os.replace

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28 if where == "staging" else 5, "injected", str(args[-1]))
        return real(*args, **kwargs)

    if where == "staging":
        monkeypatch.setattr(package, "write_file", failing)
    else:
        monkeypatch.setattr(package.os, "replace", failing)
    code, out = deploy(repo, capsys, "--to", site / "vllm_ascend")
    assert code == 1, out
    assert "nothing" in out.splitlines()[-1] and "Traceback" not in out, out
    assert snapshot(site) == before
    assert not (site / BACKUP_DIR).exists()


def test_record_with_keeps_other_rows():
    original = b"a.py,sha256=x,1\r\nb.py,sha256=y,2\r\nd-1.dist-info/RECORD,,\r\n"
    new = record_with(original, {"b.py": b"bb", "c.py": b"ccc", "a.py": None}, ["backup/m.json"])
    rows = list(csv.reader(io.StringIO(new.decode(), newline="")))
    assert rows == [
        ["d-1.dist-info/RECORD", "", ""],
        ["b.py", record_hash(b"bb"), "2"],
        ["c.py", record_hash(b"ccc"), "3"],
        ["backup/m.json", "", ""],
    ]
    assert new.count(b"\r\n") == 4, "the line terminator of the original is kept"


def test_deploy_check_work_that_is_a_file_is_refused_and_left_byte_identical(repo, tmp_path, capsys):
    from tools.fork.deploy import check

    victim = tmp_path / "work.txt"
    victim.write_bytes(b"not a folder\n")
    rc = check.main(["-C", str(repo["root"]), "--python", str(tmp_path / "no-python"), "--work", str(victim)])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines() == [
        f"--work {victim}: it exists and is not a directory; nothing was written (give a new or existing directory)"
    ]
    assert victim.read_bytes() == b"not a folder\n"


def test_an_installed_package_takes_the_changes_to_what_its_wheel_installs(tmp_path):
    """A release's wheel leaves out its op docs: a patch's change to one is not deployed (nor verified)
    into site-packages; Python files are, present or not, and so is installed package data."""
    from tools.fork.deploy.expected import Change, Expected
    from tools.fork.deploy.package import package_changes
    from tools.fork.deploy.target import Target

    write_tree(tmp_path, {"vllm_ascend/ops/copy.py": "old\n", "vllm_ascend/ops/table.json": "{}\n"})
    changes = [
        Change("vllm_ascend/ops/copy.py", b"old\n", b"new\n"),
        Change("vllm_ascend/ops/docs/copy.md", b"# copy\n", b"# copy, overlap-safe\n"),
        Change("vllm_ascend/ops/table.json", b"{}\n", b'{"a": 1}\n'),
        Change("vllm_ascend/worker/added.py", None, b"X = 1\n"),
    ]
    exp = Expected("9.9.9", tmp_path / "tree", [], changes)
    kept = package_changes(Target("package", tmp_path), exp).changes
    assert [ch.path for ch in kept] == [
        "vllm_ascend/ops/copy.py",
        "vllm_ascend/ops/table.json",
        "vllm_ascend/worker/added.py",
    ]
