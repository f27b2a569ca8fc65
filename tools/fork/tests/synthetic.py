"""Synthetic upstreams and throwaway fork repositories for the tooling's tests (no network).

An upstream release is a dict {path: text}; `make_sdist` packs it as a vllm-ascend sdist
(deterministic tar.gz, PKG-INFO with the version) whose sha256 is then known. A `Fork` is a
fork repository in a temporary directory: fork.toml pinning one release, the sdists in its own
cache (FORK_CACHE), and a series made the way a maintainer makes one: `apply`, commit in the
materialized tree, `export`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools.fork import cli
from tools.fork.core import git, txn
from tools.fork.core.config import OVERLAY_ROOTS
from tools.fork.core.materialize import PARTIAL_SUFFIX

AUTHOR_NAME, AUTHOR_EMAIL = "Fork Dev", "dev@example.com"
AUTHOR_DATE = "2026-01-02T03:04:05+0000"

COPY_PY = '''"""Copy kernels (synthetic upstream)."""


def batch_copy(src, dst, sizes):
    n = len(sizes)
    for i in range(n):
        size = sizes[i]
        data = load(src[i], size)
        store(dst[i], data)
    return n


def helper_one(x):
    return x + 1


def helper_two(x):
    return x * 2


def helper_three(x):
    return x - 3
'''

PATCH_UTILS_PY = '''"""Worker patches (synthetic upstream)."""


def fallback(batch, snapshot, num_reqs):
    """The 310P fallback."""
    out = []
    num_accepted = batch.num_accepted_cpu
    for i in range(num_reqs):
        out.append(num_accepted[i])
    return out


def unrelated():
    return None
'''

ENVS_PY = """env_variables = {
    "VLLM_ASCEND_A": lambda: 1,
}
"""

UPSTREAM: dict[str, str] = {
    "setup.py": "from setuptools import setup\n\nsetup()\n",
    "README.md": "# vllm-ascend (synthetic)\n",
    "vllm_ascend/__init__.py": "",
    "vllm_ascend/envs.py": ENVS_PY,
    "vllm_ascend/ops/__init__.py": "",
    "vllm_ascend/ops/copy.py": COPY_PY,
    "vllm_ascend/patch/worker/patch_utils.py": PATCH_UTILS_PY,
    "tests/ut/test_envs.py": "def test_envs():\n    assert True\n",
}

Edit = Callable[[str | None], str | None]  # old text (None: absent) -> new text (None: delete)


def replace(old: str, new: str) -> Edit:
    def edit(text: str | None) -> str:
        assert text is not None and text.count(old) == 1, f"{old!r} must occur once"
        return text.replace(old, new)

    return edit


def const(text: str | None) -> Edit:
    return lambda _old: text


# The series: three patches, the last fork-only.
P1_CODE = replace(
    "        store(dst[i], data)\n", "        barrier()  # all loads before any store\n        store(dst[i], data)\n"
)
P2_CODE = replace(
    "    num_accepted = batch.num_accepted_cpu\n",
    "    # Rows may be condensed or reused: read this step's snapshot.\n    num_accepted = snapshot\n",
)
MEMMOVE_PY = "def memmove(pairs):\n    for src, dst in pairs:\n        dst[:] = src.copy()\n"
SERIES = [
    (
        "[Ops][BugFix] Guard overlapping copies in batch_copy",
        {
            "vllm_ascend/ops/copy.py": P1_CODE,
            "vllm_ascend/ops/memmove.py": const(MEMMOVE_PY),
            "tests/ut/ops/test_memmove.py": const("def test_memmove():\n    assert True\n"),
        },
    ),
    (
        "[Worker][BugFix] Read the per-step snapshot in the fallback",
        {
            "vllm_ascend/patch/worker/patch_utils.py": P2_CODE,
            "tests/ut/worker/test_snapshot.py": const("def test_snapshot():\n    assert True\n"),
        },
    ),
    (
        "[Misc][Feature] Honour the deployment alias",
        {
            "vllm_ascend/envs.py": replace("}\n", '    "GLM53_BATCH_MEMCPY": lambda: 0,\n}\n'),
            "vllm_ascend/worker/alias.py": const("ALIAS = 'GLM53_BATCH_MEMCPY'\n"),
        },
    ),
]


def edited(files: dict[str, str], edits: dict[str, Edit]) -> dict[str, str]:
    """`files` with `edits` applied (the oracle for what a tree should hold)."""
    out = dict(files)
    for path, edit in edits.items():
        new = edit(out.get(path))
        if new is None:
            out.pop(path, None)
        else:
            out[path] = new
    return out


def message(subject: str, tested: str = "pytest tests/ut (all passed)") -> str:
    return (
        f"{subject}\n\n"
        "### What this PR does / why we need it?\n"
        f"{subject.split('] ')[-1]}.\n\n"
        "### Does this PR introduce _any_ user-facing change?\n"
        "No.\n\n"
        "### How was this patch tested?\n"
        f"{tested}\n\n"
        f"Signed-off-by: {AUTHOR_NAME} <{AUTHOR_EMAIL}>\n"
    )


def make_sdist(dest: Path, version: str, files: dict[str, str]) -> tuple[Path, str]:
    """A deterministic sdist of `files` (conftest's maker); returns (path, sha256)."""
    from tools.fork.tests.conftest import make_sdist as make

    dest.mkdir(parents=True, exist_ok=True)
    path = make(dest, version, files)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Run:
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


class Fork:
    """A throwaway fork repository over synthetic releases."""

    def __init__(self, tmp: Path, monkeypatch, releases: dict[str, dict[str, str]], pin: str, bases: list[str]):
        self.tmp = tmp
        self.root = tmp / "repo"
        self.cache = tmp / "cache"
        self.elsewhere = tmp / "elsewhere"  # sdists not in the cache (for --sdist)
        monkeypatch.setenv("FORK_CACHE", str(self.cache))
        # A rebase tests the tree before it writes: with this Python (pytest, tree on PYTHONPATH) where a
        # test turns that on (test_rebase_gate.py); the mechanics tests skip it (3 pytest runs a rebase).
        monkeypatch.setenv("FORK_TEST_PYTHON", sys.executable)
        monkeypatch.setenv("FORK_REBASE_NO_TEST", "1")
        self.sha: dict[str, str] = {}
        self.releases = releases
        for version, files in releases.items():
            _, self.sha[version] = make_sdist(self.cache / "sdists", version, files)
        self.root.mkdir(parents=True)
        (self.root / "patches").mkdir()
        (self.root / "patches" / "series").write_text("")
        lines = [
            "# A synthetic fork (tests).",
            "",
            "[upstream]",
            'dist = "vllm-ascend"',
            f'version = "{pin}"',
            f'sha256 = "{self.sha[pin]}"',
            "",
            "# Bases the series is kept green on.",
        ]
        for b in bases:
            lines += ["[[bases]]", f'version = "{b}"', f'sha256 = "{self.sha[b]}"', ""]
        (self.root / "fork.toml").write_text("\n".join(lines))

    # --- running the tooling -------------------------------------------------------------------

    def cli(self, *argv: str) -> Run:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(["-C", str(self.root), *argv])
        return Run(rc, out.getvalue(), err.getvalue())

    def cli_subprocess(self, *argv: str) -> Run:
        root = Path(__file__).resolve().parents[3]
        env = dict(os.environ, PYTHONPATH=str(root))
        p = subprocess.run(
            [sys.executable, "-m", "tools.fork", "-C", str(self.root), *argv],
            capture_output=True, text=True, cwd=root, env=env,
        )  # fmt: skip
        return Run(p.returncode, p.stdout, p.stderr)

    def ok(self, *argv: str) -> Run:
        r = self.cli(*argv)
        assert r.rc == 0, f"{argv} exited {r.rc}:\n{r.text}"
        return r

    # --- making the series ----------------------------------------------------------------------

    @property
    def tree(self) -> Path:
        return self.root / "build" / "fork"

    def commit(self, tree: Path, subject: str, edits: dict[str, Edit], msg: str | None = None) -> None:
        for path, edit in edits.items():
            target = tree / path
            new = edit(target.read_text() if target.exists() else None)
            if new is None:
                target.unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(new)
        git.run(["add", "-A", "."], tree)
        env = {"GIT_AUTHOR_NAME": AUTHOR_NAME, "GIT_AUTHOR_EMAIL": AUTHOR_EMAIL, "GIT_AUTHOR_DATE": AUTHOR_DATE}
        git.run(["commit", "-q", "--no-verify", "-m", msg or message(subject)], tree, env=env)

    def make_series(self, patches=SERIES, fork_only: tuple[int, ...] = (3,)) -> list[str]:
        self.ok("apply")
        for subject, edits in patches:
            self.commit(self.tree, subject, edits)
        self.ok("export")
        names = self.series()
        for n in fork_only:
            with open(self.root / "fork.toml", "a") as f:
                f.write(f'\n[patches."{names[n - 1]}"]\nfork_only = true\nreason = "deployment alias"\n')
        return names

    def series(self) -> list[str]:
        return [line for line in (self.root / "patches" / "series").read_text().splitlines() if line.strip()]

    def add_base(self, version: str) -> None:
        with open(self.root / "fork.toml", "a") as f:
            f.write(f'\n[[bases]]\nversion = "{version}"\nsha256 = "{self.sha[version]}"\n')

    def sdist_elsewhere(self, version: str, files: dict[str, str]) -> tuple[Path, str]:
        return make_sdist(self.elsewhere, version, files)

    # --- observing ----------------------------------------------------------------------------

    def protected(self) -> list[Path]:
        return [self.root / "patches", self.root / "fork.toml", *(self.root / r for r in OVERLAY_ROOTS)]

    def snapshot(self) -> dict[Path, bytes]:
        return txn.snapshot(self.protected())

    def patch(self, name: str, base: str | None = None) -> bytes:
        d = self.root / "patches" if base is None else self.root / "patches" / "bases" / base
        return (d / name).read_bytes()

    def variants(self) -> dict[str, bytes]:
        root = self.root / "patches" / "bases"
        return (
            {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.patch"))}
            if root.exists()
            else {}
        )

    @property
    def work(self) -> Path:
        return self.root / "build" / "rebase"

    def tree_files(self, tree: Path) -> dict[str, str]:
        files = git.out(["ls-files"], tree).splitlines()
        return {f: (tree / f).read_text() for f in files}


def staged_leftovers(root: Path) -> list[Path]:
    """What a cut-short write leaves: an export's journal (build/export), trash or partial folders."""
    marks = (txn.TRASH_SUFFIX, PARTIAL_SUFFIX)
    export = root / "build" / "export"
    return [p for p in root.rglob("*") if p.name.endswith(marks)] + ([export] if export.exists() else [])


def env_without_git() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}


# --- rebase tests: the releases, and oracles ------------------------------------------------------

A, B, C = "1.0", "1.1", "1.2"
COPY, UTILS = "vllm_ascend/ops/copy.py", "vllm_ascend/patch/worker/patch_utils.py"
SNAPSHOT_TEST = "tests/ut/worker/test_snapshot.py"
REPO_ROOT = Path(__file__).resolve().parents[3]


def all_edits(patches=SERIES) -> dict:
    edits: dict = {}
    for _, e in patches:
        edits.update(e)
    return edits


def expected_tree(files: dict[str, str], patches=SERIES) -> dict[str, str]:
    out = dict(files)
    for _, edits in patches:
        out = edited(out, edits)
    return out


def make(tmp_path, monkeypatch, b_files: dict[str, str] | None, *, bases=(A, B), extra=None) -> Fork:
    releases = {A: UPSTREAM}
    if b_files is not None:
        releases[B] = b_files
    releases.update(extra or {})
    fork = Fork(tmp_path, monkeypatch, releases, A, [v for v in bases if v in releases])
    fork.names = fork.make_series()
    return fork


def outcomes(fork: Fork, text: str) -> dict[str, str]:
    """Patch name -> outcome, from the per-patch progress lines."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and "] " in line and ".patch: " in line:
            name, rest = line.split("] ", 1)[1].split(": ", 1)
            out[name] = rest
    return out


def assert_tree(fork: Fork, files: dict[str, str], tree: Path | None = None) -> None:
    got = fork.tree_files(tree or fork.tree)
    assert got == files


def assert_unchanged(fork: Fork, before: dict[Path, bytes]) -> None:
    assert fork.snapshot() == before
    assert staged_leftovers(fork.root) == []
