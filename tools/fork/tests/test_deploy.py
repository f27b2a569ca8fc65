"""`deploy` on synthetic inputs: a fake upstream release (sdist with a known sha256), a throwaway
fork repository whose series is made here, fake site-packages (package + dist-info) and a fake
upstream git checkout.

Oracles: the expected file contents are computed from the edits below applied to the upstream
text in Python (not by git), and "nothing changed" / "byte-identical" are snapshots of every file.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.fork import cli, config, git, txn
from tools.fork.deploy import BACKUP_DIR, record_with
from tools.fork.deploy_check import tree_state
from tools.fork.export import render
from tools.fork.materialize import create_base
from tools.fork.tests.conftest import make_sdist, sha256
from tools.fork.upstream import Source

PIN, OLD = "9.9.9", "9.9.8"
SCRIPT = config.REPO_ROOT / "docker" / "deploy-installed.sh"

UPSTREAM = {
    "setup.py": "from setuptools import setup\nsetup()\n",
    "vllm_ascend/__init__.py": "def register():\n    return 'vllm_ascend.platform.NPUPlatform'\n",
    "vllm_ascend/envs.py": "env_variables = {\n    'VLLM_ASCEND_A': lambda: 1,\n}\n",
    "vllm_ascend/ops/__init__.py": "",
    "vllm_ascend/ops/copy.py": "def copy(src, dst):\n    dst[:] = src\n",
    "vllm_ascend/old.py": "OLD = True\n",
    "vllm_ascend/untouched.py": "X = 1\n",
    "tests/ut/test_envs.py": "def test_envs():\n    assert True\n",
    "docs/index.md": "# vllm-ascend\n",
}
# The older base differs in a line the second patch touches: it needs a per-base variant.
UPSTREAM_OLD = dict(UPSTREAM, **{"vllm_ascend/ops/copy.py": "def copy(src, dst):\n    dst[...] = src\n"})

NEW_MODULE = "def copy_pairs(pairs):\n    for src, dst in pairs:\n        dst.copy_(src.clone())\n"

# The series: (subject, {path: edit}); an edit maps the old text (None: absent) to the new one (None: delete).
SERIES = [
    (
        "[Ops][BugFix] Add the state copy module",
        {
            "vllm_ascend/envs.py": lambda t: t.replace(
                "}\n", "    'VLLM_ASCEND_MAMBA_COPY_BACKEND': lambda: 'torch',\n}\n"
            ),
            "vllm_ascend/worker/state_copy.py": lambda t: NEW_MODULE,
            "tests/ut/worker/test_state_copy.py": lambda t: "def test_it():\n    assert True\n",
            "docs/index.md": lambda t: t + "\nState copies are overlap-safe.\n",
        },
    ),
    (
        "[Ops][BugFix] Clone before copying and drop the old module",
        {
            "vllm_ascend/ops/copy.py": lambda t: t.replace("= src\n", "= src.clone()\n"),
            "vllm_ascend/old.py": lambda t: None,
            "vllm_ascend/envs.py": lambda t: "# patched by the fork\n" + t,
        },
    ),
    ("[Test][Misc] Tests only", {"tests/ut/test_envs.py": lambda t: t + "\n\ndef test_more():\n    assert 1\n"}),
]


def fork_files(upstream: dict[str, str]) -> dict[str, str | None]:
    """The oracle: every path the series touches -> its content after the series (None: absent)."""
    files: dict[str, str | None] = dict(upstream)
    touched = set()
    for _, edits in SERIES:
        for path, edit in edits.items():
            files[path] = edit(files.get(path))
            touched.add(path)
    return {p: files[p] for p in touched}


def package_expectation(upstream):
    return {p: c for p, c in fork_files(upstream).items() if p.startswith("vllm_ascend/")}


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def build_series(tree: Path, version: str) -> list[tuple[str, bytes]]:
    for subject, edits in SERIES:
        for rel, edit in edits.items():
            p = tree / rel
            new = edit(p.read_text() if p.exists() else None)
            if new is None:
                p.unlink()
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(new)
        git.run(["add", "-A"], tree)
        git.run(["commit", "-q", "-m", f"{subject}\n\nSigned-off-by: vllm-ascend-fork <fork@localhost>"], tree)
    return render(tree, version)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> dict:
    """A fork repository: fork.toml (two bases), patches/ (+ a variant for the older base), sdists."""
    tmp = tmp_path_factory.mktemp("fork")
    cache = tmp / "cache" / "sdists"  # FORK_CACHE: the tooling finds the sdists here, never on the network
    cache.mkdir(parents=True)
    sdists = {PIN: make_sdist(cache, PIN, UPSTREAM), OLD: make_sdist(cache, OLD, UPSTREAM_OLD)}
    root = tmp / "repo"
    (root / "patches").mkdir(parents=True)
    (root / "fork.toml").write_text(
        textwrap.dedent(f"""\
        [upstream]
        dist = "vllm-ascend"
        version = "{PIN}"
        sha256 = "{sha256(sdists[PIN])}"

        [[bases]]
        version = "{PIN}"
        sha256 = "{sha256(sdists[PIN])}"

        [[bases]]
        version = "{OLD}"
        sha256 = "{sha256(sdists[OLD])}"
        """)
    )
    rendered = {}
    for version, sdist in sdists.items():
        tree = tmp / f"mat-{version}"
        create_base(Source(version, sdist=sdist), tree)
        rendered[version] = build_series(tree, version)
    for name, data in rendered[PIN]:
        (root / "patches" / name).write_bytes(data)
    (root / "patches" / "series").write_text("".join(f"{name}\n" for name, _ in rendered[PIN]))
    variants = [(n, d) for (n, d), (_, pin_d) in zip(rendered[OLD], rendered[PIN]) if d != pin_d]
    assert variants, "the older base must need a variant of the copy.py patch"
    (root / "patches" / "bases" / OLD).mkdir(parents=True)
    for name, data in variants:
        (root / "patches" / "bases" / OLD / name).write_bytes(data)
    return {"root": root, "sdists": sdists, "cache": cache.parent}


@pytest.fixture(autouse=True)
def _offline_cache(repo, monkeypatch):
    monkeypatch.setenv("FORK_CACHE", str(repo["cache"]))


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_site(tmp: Path, version: str, upstream: dict[str, str], *, metadata_version: str | None = None) -> Path:
    """A site-packages holding vllm_ascend as pip installs a wheel: package, dist-info, RECORD, pycache."""
    site = tmp / "site-packages"
    pkg_files = {p: t for p, t in upstream.items() if p.startswith("vllm_ascend/")}
    pkg_files["vllm_ascend/_version.py"] = f"__version__ = version = '{version}'\n"
    write_tree(site, pkg_files)
    pyc = site / "vllm_ascend/__pycache__/envs.cpython-311.pyc"
    pyc.parent.mkdir()
    pyc.write_bytes(b"stale bytecode of envs.py")
    dist = site / f"vllm_ascend-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {metadata_version or version}\n\nlong text\n"
    )
    (dist / "INSTALLER").write_text("pip\n")
    rows = [[p, record_hash((site / p).read_bytes()), str(len((site / p).read_bytes()))] for p in sorted(pkg_files)]
    rows += [
        [f"{dist.name}/METADATA", "", ""],
        [f"{dist.name}/INSTALLER", "", ""],
        [pyc.relative_to(site).as_posix(), "", ""],
    ]
    rows.append([f"{dist.name}/RECORD", "", ""])
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    (dist / "RECORD").write_text(buf.getvalue())
    # Something else installed beside it, which must never be touched.
    write_tree(site, {"other_pkg/__init__.py": "Y = 2\n"})
    return site


def deploy(repo, capsys, *args) -> tuple[int, str]:
    code = cli.main(["-C", str(repo["root"]), "deploy", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out + out.err


def snapshot(*roots: Path) -> dict[str, dict[str, str]]:
    """Every path under the roots, folders and __pycache__ included, with its sha256."""
    return {str(root): tree_state(root) if root.is_dir() else {} for root in roots}


def record_paths(site: Path) -> set[str]:
    (dist,) = site.glob("vllm_ascend-*.dist-info")
    return {row[0] for row in csv.reader(io.StringIO((dist / "RECORD").read_text())) if row}


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


def refused(repo, capsys, site: Path, *args, code: int, says: str) -> str:
    before = snapshot(site)
    got, out = deploy(repo, capsys, *args)
    assert got == code, out
    assert says in out, out
    assert snapshot(site) == before, "a refusal must change nothing"
    return out


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
    assert deploy(repo, capsys, "--force", "--revert", site / "vllm_ascend")[0] == 0
    assert snapshot(site) == before


def test_failed_write_leaves_package_and_no_backup(repo, tmp_path, capsys, monkeypatch):
    """The package changes are one StagedWrite; if it fails before its renames, the backup goes too."""
    site = make_site(tmp_path, PIN, UPSTREAM)
    before = snapshot(site)
    calls = []
    real_commit = txn.StagedWrite.commit

    def commit(self):
        calls.append(1)
        if len(calls) == 2:  # the backup is written first; the package write fails (disk full)
            raise OSError(28, "No space left on device")
        return real_commit(self)

    monkeypatch.setattr(txn.StagedWrite, "commit", commit)
    with pytest.raises(OSError):
        cli.main(["-C", str(repo["root"]), "deploy", "--to", str(site / "vllm_ascend")])
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
