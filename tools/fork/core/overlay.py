"""The overlay: files the fork adds, kept in the repository at their upstream paths.

Rule: the overlay holds each added file as the whole series leaves it. Later patches may change
files earlier patches added; an edit made in the overlay is folded into the last patch that
touched the file (git-absorb semantics), and `check` verifies overlay == end of series.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.core import git
from tools.fork.core.config import OVERLAY_ROOTS, ForkConfig
from tools.fork.core.series import base_tag


@dataclass
class Ownership:
    """Who touches what in a materialized series: commit index (0-based) lists per path."""

    commits: list[str]
    created: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    modified: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    deleted: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))

    def added_in_overlay(self) -> set[str]:
        """Paths created by the series under the overlay roots and still present at HEAD."""
        return {p for p in self.created if in_overlay(p) and self.final_exists(p)}

    def final_exists(self, path: str) -> bool:
        last_create = max(self.created.get(path, [-1]))
        last_delete = max(self.deleted.get(path, [-1]))
        return last_create > last_delete


def in_overlay(path: str) -> bool:
    return path.split("/", 1)[0] in OVERLAY_ROOTS


def ownership(tree: Path, version: str) -> Ownership:
    log = git.out(
        ["log", "--reverse", "--no-renames", "--format=commit %H", "--name-status", f"{base_tag(version)}..HEAD"],
        tree,
    )
    own = Ownership(commits=[])
    for line in log.splitlines():
        if line.startswith("commit "):
            own.commits.append(line.split()[1])
        elif line.strip():
            status, path = line.split("\t", 1)
            index = len(own.commits) - 1
            {"A": own.created, "D": own.deleted}.get(status[0], own.modified)[path].append(index)
    return own


def repo_files(cfg: ForkConfig) -> set[str]:
    """Overlay files present in the repository (working tree), as upstream-relative paths."""
    out = set()
    for root in OVERLAY_ROOTS:
        base = cfg.root / root
        if base.is_dir():
            for p in base.rglob("*"):
                if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
                    out.add(p.relative_to(cfg.root).as_posix())
    return out


def blob(tree: Path, rev: str, path: str) -> bytes | None:
    proc = git.run(["show", f"{rev}:{path}"], tree, check=False, binary=True)
    return proc.stdout if proc.returncode == 0 else None


def changes(cfg: ForkConfig, tree: Path, version: str) -> dict[str, bytes | None]:
    """What writing the overlay from a materialized tree changes: {repo-relative path: the file as
    the series leaves it, or None to remove a file no patch adds any more}."""
    added = ownership(tree, version).added_in_overlay()
    out: dict[str, bytes | None] = {path: blob(tree, "HEAD", path) or b"" for path in sorted(added)}
    out.update((path, None) for path in sorted(repo_files(cfg) - added))
    return out
