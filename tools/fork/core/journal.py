"""The journaled write of the fork's protected files (`patches/`, `fork.toml`, the overlay).

One mechanism for every verb that rewrites them (`rebase` in build/rebase/write/, `export` in
build/export/): `stage` writes the new files (`new/<path>`), the ones they replace
(`old/<path>`) and then the list (`journal.json`, replaced atomically) into a folder of the tool's
own, outside the protected files; `apply` moves each new file into place and deletes what the
write removes; `restore` puts the old files back. A kill while staging changed nothing (no
`journal.json`, or a folder to throw away); after `journal.json` exists, `apply` and `restore`
may each be run again after a kill (a staged file that is gone was moved already).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from tools.fork.core.errors import InProgress, LocalEdits

LIST = "journal.json"
EXPORT_WORK = "export"  # build/export/: a running export's journal and EXPORT_FOLD (queue/cmd_export.py)
EXPORT_FOLD = "fold.json"  # the old and new HEAD of build/fork while export's overlay fold moves it


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` and sync it (its folders made as needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def stage(root: Path, journal: Path, changes: dict[str, bytes | None]) -> int:
    """Write `journal` for `changes` ({path relative to root: new bytes, or None to delete}); nothing
    under `root` changes. Returns how many files the write changes (unchanged ones are left out)."""
    if journal.exists():  # from a run killed while staging
        shutil.rmtree(journal)
    entries = {}
    for rel, data in changes.items():
        old = root / rel
        existed = old.is_file()
        if data is None and not existed:
            continue
        old_bytes = old.read_bytes() if existed else None
        if data is not None and old_bytes == data:
            continue
        if old_bytes is not None:
            write_file(journal / "old" / rel, old_bytes)
        if data is not None:
            write_file(journal / "new" / rel, data)
        entries[rel] = {
            "new": data is not None,
            "existed": existed,
            # what the file is before and after (None: absent), to tell a file the write left half
            # done from one someone edited since
            "old_sha256": _sha(old_bytes) if old_bytes is not None else None,
            "new_sha256": _sha(data) if data is not None else None,
        }
    tmp = journal / (LIST + ".tmp")
    write_file(tmp, (json.dumps(entries, indent=1) + "\n").encode())
    os.replace(tmp, journal / LIST)
    return len(entries)


def staged(journal: Path) -> bool:
    """True when `journal` holds a complete list: a write that `apply` finishes or `restore` undoes."""
    return (journal / LIST).is_file()


def entries(journal: Path) -> dict[str, dict]:
    return json.loads((journal / LIST).read_text())


def check_untouched(root: Path, journal: Path, drop: str) -> None:
    """Refuse to finish a write when a file it covers is neither as before it nor as it leaves it
    (edited since the run was cut short). `drop` is the command that gives up the write."""
    for rel, entry in entries(journal).items():
        dest = root / rel
        now = _sha(dest.read_bytes()) if dest.is_file() else None
        if now == entry.get("new_sha256", now):
            continue  # written already
        waiting = (journal / "new" / rel).exists() or not entry["new"]
        if now == entry.get("old_sha256", now) and waiting:
            continue  # not written yet
        raise LocalEdits(f"{rel} was changed after a write to it was cut short; keep a copy, then `{drop}`")


def left(root: Path, journal: Path) -> list[str]:
    """The files `apply` has still to write or delete."""
    out = []
    for rel, entry in entries(journal).items():
        dest = root / rel
        now = _sha(dest.read_bytes()) if dest.is_file() else None
        if now != entry.get("new_sha256"):
            out.append(rel)
    return out


def apply(root: Path, journal: Path) -> None:
    """Move the staged files into place and delete what the write removes; run again after a kill."""
    for rel, entry in entries(journal).items():
        _put(root, rel, journal / "new" / rel if entry["new"] else None)


def restore(root: Path, journal: Path) -> bool:
    """Put back every file the write replaced or deleted and remove the ones it added. False when
    no write was staged (nothing to restore)."""
    if not staged(journal):
        return False
    for rel, entry in entries(journal).items():
        _put(root, rel, journal / "old" / rel if entry["existed"] else None)
    return True


def _put(root: Path, rel: str, source: Path | None) -> None:
    """`root/rel` becomes `source` (renamed into place, unless an earlier run already did), or is
    removed with the folders it leaves empty when `source` is None."""
    dest = root / rel
    if source is None:
        dest.unlink(missing_ok=True)
        prune_empty_dirs(dest.parent, root)
    elif source.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, dest)


def prune_empty_dirs(d: Path, stop: Path) -> None:
    """Remove `d` and its parents while empty, up to (not including) `stop`."""
    while d != stop and stop in d.parents and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


def require_no_export_cut_short(build_dir: Path) -> None:
    """`apply` and `rebase` read patches/ and build/fork: not while a killed export left them half done."""
    work = build_dir / EXPORT_WORK
    if staged(work) or (work / EXPORT_FOLD).is_file():
        raise InProgress(
            "an export was cut short: patches/, fork.toml, the overlay or build/fork are partly written; "
            "`python3 -m tools.fork export` finishes it"
        )
