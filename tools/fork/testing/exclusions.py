"""Read .ci/ut-exclusions.txt (what upstream routes to NPU runners, upstream tests that hang) and match it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tools.fork.core.errors import BadInput

EXCLUSIONS_FILE = ".ci/ut-exclusions.txt"


@dataclass(frozen=True)
class Exclusion:
    # a path relative to the tree, may hold glob wildcards (`**` for any depth); or a pytest node id
    # prefix `path::name` (its path without wildcards), deselected rather than ignored
    pattern: str
    reason: str
    lineno: int


def parse_exclusions(text: str, source: str = EXCLUSIONS_FILE) -> list[Exclusion]:
    """One path a line, each with its reason as a trailing `# comment`; `#` lines are comments."""
    out: list[Exclusion] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        path, sep, reason = line.partition("#")
        path, reason = path.strip(), reason.strip()
        if not sep or not reason:
            raise BadInput(f"{source}:{lineno}: {path!r} has no reason: add it as a trailing '# comment'")
        if " " in path or "\t" in path:
            raise BadInput(f"{source}:{lineno}: one path a line, got {path!r}")
        if path.startswith("/") or ".." in Path(path).parts:
            raise BadInput(f"{source}:{lineno}: {path!r} must be relative to the tree, without '..'")
        norm = path.rstrip("/")
        if norm in seen:
            raise BadInput(f"{source}:{lineno}: {path!r} is listed twice")
        seen.add(norm)
        out.append(Exclusion(path, reason, lineno))
    return out


def resolve_exclusions(exclusions: list[Exclusion], tree: Path) -> list[tuple[Exclusion, list[str]]]:
    """Each exclusion with the paths (relative, posix) it matches in `tree`; a trailing `/` means directories."""
    resolved = []
    for ex in exclusions:
        path, sep, node = ex.pattern.partition("::")
        if sep:
            resolved.append((ex, [ex.pattern] if (tree / path).is_file() else []))
            continue
        pattern = ex.pattern.rstrip("/")
        matches = sorted(
            p.relative_to(tree).as_posix() for p in tree.glob(pattern) if not ex.pattern.endswith("/") or p.is_dir()
        )
        resolved.append((ex, matches))
    return resolved


def load_exclusions(root: Path) -> list[Exclusion]:
    path = root / EXCLUSIONS_FILE
    if not path.is_file():
        raise BadInput(f"{path} not found: it lists what upstream routes to NPU runners")
    return parse_exclusions(path.read_text(), EXCLUSIONS_FILE)


def ignored_paths(resolved: list[tuple[Exclusion, list[str]]]) -> list[str]:
    """Every path (or node id) the resolved exclusions match, sorted, once each (pytest's --ignore / --deselect)."""
    return sorted({p for _, paths in resolved for p in paths})


def is_excluded(path: str, ignores: list[str]) -> bool:
    """Whether `path` is one of `ignores` or lies under one."""
    return any(path == p or path.startswith(p + "/") for p in ignores)
