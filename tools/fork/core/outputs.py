"""Output directories given on the command line (--dist, --into, --report-dir, --work).

A verb creates such a directory or writes into an existing one; it never writes over a file. A path
that is a file (or lies under one) is refused before any work: exit 2, one line, the file untouched.
"""

from __future__ import annotations

from pathlib import Path

from tools.fork.core.errors import BadInput


def output_dir(path: Path, option: str) -> Path:
    """`path`, checked as a directory to create or write into; BadInput when it or a parent is not one."""
    path = Path(path)
    for p in (path, *path.absolute().parents):
        if p.exists() and not p.is_dir():
            where = "it" if p == path else f"{p}"
            raise BadInput(
                f"{option} {path}: {where} exists and is not a directory; nothing was written "
                "(give a new or existing directory)"
            )
    return path
