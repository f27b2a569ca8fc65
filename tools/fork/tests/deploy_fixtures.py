"""Shared inputs of the deploy tests: a fake release, a throwaway fork repository, fake site-packages.

The fake upstream release is an sdist with a known sha256; the fork repository's series is made here.
Oracles: the expected file contents are computed from the edits below applied to the upstream
text in Python (not by git), and "nothing changed" / "byte-identical" are snapshots of every file.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import textwrap
from pathlib import Path

import pytest

from tools.fork import cli
from tools.fork.core import config, git
from tools.fork.core.materialize import create_base
from tools.fork.core.series import render
from tools.fork.core.upstream import Source
from tools.fork.deploy.check import tree_state
from tools.fork.tests.conftest import make_sdist, sha256

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


def refused(repo, capsys, site: Path, *args, code: int, says: str) -> str:
    before = snapshot(site)
    got, out = deploy(repo, capsys, *args)
    assert got == code, out
    assert says in out, out
    assert snapshot(site) == before, "a refusal must change nothing"
    return out
