"""Steps that a kill must not cut in half: signals held off, folders deleted via a trash name.

The protected files (`patches/`, `fork.toml`, the overlay) are written as a journal
(core/journal.py), whose renames run with SIGINT/SIGTERM held off (`signals_deferred`).
"""

from __future__ import annotations

import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path


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
