"""What the series does to a base: the fork materialized on it, and every file a patch touches, before and after."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from tools.fork.core import git, lock, overlay, series, upstream
from tools.fork.core.config import ForkConfig
from tools.fork.core.materialize import materialize
from tools.fork.core.series import base_tag

PACKAGE = "vllm_ascend"


@dataclass(frozen=True)
class Change:
    """One file the series touches: its upstream and its fork content (None: absent)."""

    path: str  # upstream-relative, e.g. vllm_ascend/envs.py
    base: bytes | None
    fork: bytes | None

    @property
    def status(self) -> str:
        if self.base is None:
            return "A"
        if self.fork is None:
            return "D"
        return "M" if self.base != self.fork else "="


@dataclass(frozen=True)
class Expected:
    version: str
    tree: Path
    patches: list[series.Patch]
    changes: list[Change]  # every file any patch touches under the scope, sorted by path


def expected(cfg: ForkConfig, version: str, *, sdist: Path | None = None, scope: str | None = PACKAGE) -> Expected:
    """The fork of base `version`, materialized in build/deploy/<version> (owned by this verb)."""
    patches = series.read(cfg, version)
    tree = (cfg.build_dir / "deploy" / version).resolve()
    # Deploys into different environments share this tree: the second waits for the first to make it.
    with lock.exclusive(tree.with_name(f".{version}.lock"), f"{tree}", wait=True):
        materialize(tree, lambda: upstream.obtain(cfg, version, sdist=sdist).source, version, patches, force=True)
    paths = ["--", f"{scope}/"] if scope else []
    log = git.out(["log", "--format=", "--name-only", "--no-renames", f"{base_tag(version)}..HEAD", *paths], tree)
    changes = [
        Change(path, overlay.blob(tree, base_tag(version), path), overlay.blob(tree, "HEAD", path))
        for path in sorted(set(filter(None, log.splitlines())))
    ]
    return Expected(version, tree, patches, changes)


def sha256(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None
