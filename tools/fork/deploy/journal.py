"""Deploy and revert of an installed package as journaled transactions that survive a kill at any step.

Everything the tool writes besides the package's own files lives beside the package, never inside
it (`<root>` is the folder holding `vllm_ascend/`, e.g. site-packages):

  <root>/vllm_ascend-fork-deploy/            the backup (B)
      original/<path>                        the original bytes of every file the deploy replaces
      new/<path>                             a deploy's new files, staged (gone once committed)
      plan.json                              the journal of a deploy in flight (not committed)
      manifest.json                          the commit point: the deploy is complete
      reverting                              a marker: a revert in flight (finished forward)
      disposing                              a marker: B is being deleted (what is left is garbage)

A deploy writes originals, staged files and plan.json first (the package untouched: a kill here
leaves B without plan.json, which is deleted), then renames the staged files into the package,
deletes what the series removes and the stale bytecode, replaces RECORD, and last renames
plan.json to manifest.json. A kill between the first rename and the commit leaves plan.json: the
next `deploy --to` or `--revert` rolls the package back from original/ by content hash (each step
idempotent), then B is deleted. A revert marks B `reverting` first, restores the originals by
renames, removes what the deploy added, then marks B `disposing` (its commit point) and deletes it:
a kill in between is finished forward by the next `--to` or `--revert`. B's state lives in marker
files, not in renames of B itself: in a container image B was made in an earlier layer, and
overlayfs refuses to rename such a folder (EXDEV, "Invalid cross-device link").
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tools.fork.core.errors import BadInput, ForkError
from tools.fork.core.journal import prune_empty_dirs
from tools.fork.deploy.expected import read, sha256

PLAN = "plan.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
REVERTING = "reverting"
DISPOSING = "disposing"


@dataclass(frozen=True)
class Dirs:
    backup: Path  # <root>/vllm_ascend-fork-deploy


def state(dirs: Dirs) -> str:
    """What a previous run left: "clean", "deployed", "deploying" (killed before its commit point),
    "junk" (a deploy killed before its journal: nothing in the package changed), "reverting" or "trash"."""
    b = dirs.backup
    if not b.exists():
        return "clean"
    if (b / DISPOSING).exists():
        return "trash"
    if (b / REVERTING).exists():
        return "reverting"
    if (b / MANIFEST).is_file():
        return "deployed"
    return "deploying" if (b / PLAN).is_file() else "junk"


def interrupted_message(dirs: Dirs, package: Path, st: str) -> str:
    from shlex import quote

    what = {
        "deploying": "a deploy was interrupted before it completed",
        "junk": "a deploy was interrupted before it changed the package",
        "reverting": "a revert was interrupted",
        "trash": "an interrupted revert or rollback left files to delete",
    }[st]
    return (
        f"{what} ({quote(str(dirs.backup))}); "
        f"`deploy --revert {quote(str(package))}` finishes it (the package as before the deploy), "
        f"`deploy --to {quote(str(package))}` finishes it and deploys"
    )


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_manifest(path: Path) -> dict:
    """A deploy's manifest (or plan), checked: BadInput naming what is wrong, never a KeyError."""
    from shlex import quote

    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{quote(str(path))} not found") from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"{quote(str(path))} is unreadable or truncated ({exc.__class__.__name__})") from None
    problems = []
    if not isinstance(data, dict):
        problems.append("not a JSON object")
    elif data.get("format") != MANIFEST_FORMAT:
        problems.append(f"unknown format {data.get('format')!r}")
    else:
        files = data.get("files")
        if not isinstance(files, list) or not all(
            isinstance(f, dict) and {"path", "original_sha256", "fork_sha256"} <= set(f) for f in files
        ):
            problems.append("'files' missing or without path/original_sha256/fork_sha256")
        pycache = data.get("pycache", [])
        if not isinstance(pycache, list) or not all(
            isinstance(p, dict) and {"path", "sha256"} <= set(p) for p in pycache
        ):
            problems.append("'pycache' without path/sha256")
        record = data.get("record")
        if record is not None and not (
            isinstance(record, dict) and {"path", "original_sha256", "deployed_sha256"} <= set(record)
        ):
            problems.append("'record' without path/original_sha256/deployed_sha256")
    if problems:
        raise BadInput(f"{quote(str(path))} is damaged: {'; '.join(problems)}")
    return data


def _entries(manifest: dict) -> list[tuple[str, str | None, str | None]]:
    """(path relative to root, original sha256 or None, deployed sha256 or None) of every file the deploy changed."""
    out = [(f["path"], f["original_sha256"], f["fork_sha256"]) for f in manifest["files"]]
    out += [(p["path"], p["sha256"], None) for p in manifest.get("pycache", [])]
    if manifest.get("record"):
        r = manifest["record"]
        out.append((r["path"], r["original_sha256"], r["deployed_sha256"]))
    return out


def prune_empty_dirs_below(d: Path) -> None:
    """Remove the empty folders under `d` and `d` itself, deepest first (a staging folder emptied by renames)."""
    if not d.is_dir():
        return
    for dirpath, _dirnames, _files in sorted(os.walk(d), key=lambda w: -len(Path(w[0]).parts)):
        if not any(Path(dirpath).iterdir()):
            Path(dirpath).rmdir()


def _compiled(path: Path) -> list[Path]:
    cache = path.parent / "__pycache__"
    return sorted(cache.glob(f"{path.stem}.*.pyc")) if path.suffix == ".py" and cache.is_dir() else []


def restore_originals(root: Path, holder: Path, manifest: dict) -> None:
    """Put every original back from `holder`/original (by rename), remove what the deploy added and what
    Python compiled from changed modules since. Idempotent: a file that already has its original
    content is left alone, so a second run after a kill finishes the first."""
    keep_pyc = {p["path"] for p in manifest.get("pycache", [])}
    for f in manifest["files"]:  # bytecode compiled from the fork's modules: stale once they go
        for pyc in _compiled(root / f["path"]):
            if pyc.relative_to(root).as_posix() not in keep_pyc:
                pyc.unlink()
                prune_empty_dirs(pyc.parent, root)
    for rel, original, _deployed in _entries(manifest):
        path = root / rel
        if sha256(read(path)) == original:
            if original is None:  # a folder made for it, just before a kill, goes too
                prune_empty_dirs(path.parent, root)
            continue
        if original is None:
            path.unlink(missing_ok=True)
            prune_empty_dirs(path.parent, root)
            continue
        saved = holder / "original" / rel
        if sha256(read(saved)) != original:
            raise ForkError(
                f"the backup of {rel} in {holder} is missing or damaged (sha256 mismatch) and {path} is not the "
                "original either; reinstall vllm-ascend (pip install --force-reinstall --no-deps)"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(saved, path)


def mark(backup: Path, marker: str) -> None:
    """Create an empty marker file in the backup: one step (its existence is the whole message)."""
    (backup / marker).touch()


def dispose(backup: Path) -> None:
    """Delete the backup so that a kill midway leaves a recognisable leftover: mark it `disposing`,
    drop its journal files (what is left then reads as garbage, marker or not), then delete it."""
    if not backup.exists():
        return
    mark(backup, DISPOSING)
    for name in (MANIFEST, PLAN, REVERTING):
        (backup / name).unlink(missing_ok=True)
    shutil.rmtree(backup)


_RECOVERED = {
    "deploying": "rolled back an interrupted deploy: the package is as it was before it",
    "junk": "removed what a deploy killed before it changed anything left",
    "reverting": "finished an interrupted revert: the package is as it was before the deploy",
    "trash": "removed what an interrupted revert or rollback left",
}


def recover(dirs: Dirs, root: Path) -> str | None:
    """Finish what a killed deploy or revert left: roll an uncommitted deploy back, finish a revert,
    delete leftovers. Returns what was done (None: nothing to do, or a committed deploy)."""
    st = state(dirs)
    if st in ("deploying", "reverting"):  # the originals go back: from the plan, or the manifest
        record = PLAN if st == "deploying" else MANIFEST
        restore_originals(root, dirs.backup, load_manifest(dirs.backup / record))
    if st in _RECOVERED:
        dispose(dirs.backup)
    return _RECOVERED.get(st)
