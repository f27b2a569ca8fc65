"""All-or-nothing updates of the fork's protected state.

`patches/`, `patches/series`, `fork.toml` and the overlay (`vllm_ascend/`, `tests/`) change only
when an operation completes. Writes are staged first: every new file is written in full
next to its target (a full disk or any error fails here, with nothing changed), then moved
into place by renames, which need no space, with SIGINT/SIGTERM held off until the last
rename is done.
"""

from __future__ import annotations

import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

_TMP_SUFFIX = ".fork-staged"


class StagedWrite:
    """Collects the new contents of files (or their removal), then applies them at once."""

    def __init__(self) -> None:
        self._writes: dict[Path, bytes] = {}
        self._deletes: set[Path] = set()

    def write(self, path: Path, data: bytes) -> None:
        self._deletes.discard(path)
        self._writes[path] = data

    def delete(self, path: Path) -> None:
        self._writes.pop(path, None)
        self._deletes.add(path)

    @property
    def changed(self) -> list[Path]:
        """Paths whose content would change (for reporting)."""
        out = [p for p, data in self._writes.items() if not p.exists() or p.read_bytes() != data]
        return sorted(out + [p for p in self._deletes if p.exists()])

    def commit(self) -> list[Path]:
        """Apply all staged changes; on any failure before the renames, change nothing."""
        changed = self.changed
        staged: list[tuple[Path, Path]] = []
        try:
            for path in changed:
                if path in self._writes:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_name(path.name + _TMP_SUFFIX)
                    with open(tmp, "wb") as f:
                        f.write(self._writes[path])
                        f.flush()
                        os.fsync(f.fileno())
                    staged.append((tmp, path))
        except BaseException:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
            raise
        with signals_deferred():
            for tmp, path in staged:
                os.replace(tmp, path)
            for path in changed:
                if path in self._deletes:
                    path.unlink(missing_ok=True)
                    _prune_empty_dirs(path.parent)
        return changed


def _prune_empty_dirs(d: Path) -> None:
    while d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


@contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM until the block ends (renames must not be cut in half)."""
    pending: list[int] = []
    sigs = [signal.SIGINT, signal.SIGTERM]
    try:
        old = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in sigs}
    except ValueError:  # not in the main thread: nothing to defer
        yield
        return
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in pending:
            signal.raise_signal(s)


def snapshot(paths: list[Path]) -> dict[Path, bytes]:
    """Contents of files, for tests and for verifying that nothing changed."""
    out = {}
    for root in paths:
        if root.is_file():
            out[root] = root.read_bytes()
        elif root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts:
                    out[p] = p.read_bytes()
    return out


TRASH_SUFFIX = ".fork-trash"


def discard(path: Path) -> None:
    """Delete a folder of the tool's own so that a kill midway leaves nothing half-deleted under its
    name: renamed to `<path>.fork-trash` first (one step), then removed. A trash a killed run left
    is removed too."""
    remove_trash(path)
    trash = path.with_name(path.name + TRASH_SUFFIX)
    if path.exists():
        os.replace(path, trash)
        shutil.rmtree(trash)


def remove_trash(path: Path) -> None:
    """Remove what a run killed inside `discard(path)` left (`<path>.fork-trash`)."""
    trash = path.with_name(path.name + TRASH_SUFFIX)
    if trash.exists():
        shutil.rmtree(trash)
