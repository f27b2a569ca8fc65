"""Deploy into an installed vllm_ascend package: `git apply` of its hunks, a backup, RECORD; verify; revert."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tools.fork.core import git
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput, ForkError, LocalEdits
from tools.fork.core.txn import StagedWrite
from tools.fork.deploy.dist_record import record_hash, record_rows, record_with
from tools.fork.deploy.expected import PACKAGE, Change, Expected, expected, read, sha256
from tools.fork.deploy.target import (
    BACKUP_DIR,
    MANIFEST,
    MANIFEST_FORMAT,
    AlreadyDeployed,
    Target,
    load_json,
    refuse_if_deployed,
)


def _pycache(path: Path) -> list[Path]:
    cache = path.parent / "__pycache__"
    return sorted(cache.glob(f"{path.stem}.*.pyc")) if path.suffix == ".py" and cache.is_dir() else []


def _states(target: Target, exp: Expected) -> dict[str, str]:
    """path -> "upstream" | "fork" | "other" for every file the series touches."""
    out = {}
    for ch in exp.changes:
        have = read(target.file(ch.path))
        out[ch.path] = "upstream" if have == ch.base else "fork" if have == ch.fork else "other"
    return out


def _describe(have: bytes | None, ch: Change) -> str:
    if have == ch.fork:
        return "already has the fork's content" if have is not None else "missing (the fork removes it)"
    if have is None:
        return "missing"
    if ch.base is None:
        return "exists, but upstream has no such file (the series creates it)"
    return "differs from upstream"


def _apply_in_staging(target: Target, exp: Expected) -> dict[str, bytes | None]:
    """Run `git apply` for every patch's vllm_ascend/ hunks on copies of the touched files."""
    with tempfile.TemporaryDirectory(prefix="fork-deploy-") as tmp:
        stage = Path(tmp) / "stage"
        stage.mkdir()
        for ch in exp.changes:
            if ch.base is not None:
                dest = stage / ch.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(target.file(ch.path).read_bytes())
        env = {"GIT_CEILING_DIRECTORIES": tmp}  # never let git find a repository above the stage
        args = ["apply", "-p1", f"--include={PACKAGE}/*", "--whitespace=nowarn"]
        for patch in exp.patches:
            path = str(patch.path.resolve())
            proc = git.run([*args, "--check", path], stage, check=False, env=env)
            if proc.returncode != 0:
                raise ForkError(
                    f"patch {patch.name} does not apply to {target.package} (nothing was changed):\n  "
                    + "\n  ".join(proc.stderr.strip().splitlines()[-10:])
                )
            git.run([*args, path], stage, env=env)
        result = {ch.path: read(stage / ch.path) for ch in exp.changes}
    wrong = [ch.path for ch in exp.changes if result[ch.path] != ch.fork]
    if wrong:
        raise ForkError(
            f"`git apply` gave other content than the materialized fork ({exp.tree}) for: {', '.join(wrong)}; "
            "nothing was changed"
        )
    return result


def deploy_package(cfg: ForkConfig, target: Target, version: str, *, sdist: Path | None = None) -> list[str]:
    refuse_if_deployed(target)
    exp = expected(cfg, version, sdist=sdist)
    if not any(ch.status != "=" for ch in exp.changes):
        raise BadInput(f"the series changes nothing under {PACKAGE}/ on vllm-ascend {version}: nothing to deploy")
    states = _states(target, exp)
    changing = [ch for ch in exp.changes if ch.status != "="]
    if all(states[ch.path] == "fork" for ch in changing):
        raise AlreadyDeployed(
            f"{target.package} already has the fork's content for every file the series changes "
            "(installed from the fork's wheel?); nothing to do. `deploy --verify` shows it."
        )
    bad = [ch for ch in exp.changes if states[ch.path] != "upstream"]
    if bad:
        lines = [f"{ch.path}: {_describe(read(target.file(ch.path)), ch)}" for ch in bad]
        raise LocalEdits(
            f"{target.package} is not plain vllm-ascend {version}: files the series touches differ from the "
            f"release (compared with its sdist):\n  - " + "\n  - ".join(lines) + "\nNothing was changed."
        )
    result = _apply_in_staging(target, exp)

    # 1. the backup (outside the package), 2. the package and RECORD; undo 1 if 2 fails untouched.
    backup = StagedWrite()
    files = []
    for ch in changing:
        if ch.base is not None:
            backup.write(target.backup / "original" / ch.path, ch.base)
        files.append(
            {"path": ch.path, "status": ch.status, "original_sha256": sha256(ch.base), "fork_sha256": sha256(ch.fork)}
        )
    record = None
    changes = StagedWrite()
    pycache = []  # compiled files of the changed modules: stale once the source changes, so removed,
    for ch in changing:  # and kept in the backup, so that --revert puts back every byte (and folder)
        if result[ch.path] is None:
            changes.delete(target.file(ch.path))
        else:
            changes.write(target.file(ch.path), result[ch.path])
        for pyc in _pycache(target.file(ch.path)):
            rel = pyc.relative_to(target.root).as_posix()
            data = pyc.read_bytes()
            backup.write(target.backup / "original" / rel, data)
            pycache.append({"path": rel, "sha256": sha256(data)})
            changes.delete(pyc)
    backup_files = (
        [f"{BACKUP_DIR}/{MANIFEST}"]
        + [f"{BACKUP_DIR}/original/{ch.path}" for ch in changing if ch.base is not None]
        + [f"{BACKUP_DIR}/original/{p['path']}" for p in pycache]
    )
    if target.dist_info is not None:
        rec_path = target.dist_info / "RECORD"
        rec_rel = rec_path.relative_to(target.root).as_posix()
        original = rec_path.read_bytes()
        new = record_with(
            original,
            {ch.path: result[ch.path] for ch in changing},
            backup_files + [f"{BACKUP_DIR}/original/{rec_rel}"],
        )
        backup.write(target.backup / "original" / rec_rel, original)
        changes.write(rec_path, new)
        record = {"path": rec_rel, "original_sha256": sha256(original), "deployed_sha256": sha256(new)}
    manifest = {
        "format": MANIFEST_FORMAT,
        "tool": "python -m tools.fork deploy",
        "base": version,
        "installed_version": target.version,
        "package": PACKAGE,
        "series": [[p.name, p.sha256] for p in exp.patches],
        "files": files,
        "pycache": pycache,
        "record": record,
    }
    backup.write(target.backup / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    backup.commit()
    try:
        changes.commit()
    except BaseException:
        untouched = all(s == "upstream" for s in _states(target, exp).values()) and (
            record is None or sha256(read(target.root / record["path"])) == record["original_sha256"]
        )
        if untouched:  # failed while staging (e.g. disk full): nothing to undo but the backup
            shutil.rmtree(target.backup, ignore_errors=True)
            raise
        raise ForkError(
            f"deploy into {target.package} was interrupted after some files changed; the backup is in "
            f"{target.backup}: run `deploy --revert {target.package}`"
        ) from None
    return [f"{ch.status} {ch.path}" for ch in changing]


def revert_package(target: Target, *, force: bool = False) -> list[str]:
    manifest = load_json(target.backup / MANIFEST)
    if manifest is None:
        raise BadInput(
            f"no deploy backup for {target.package} ({target.backup / MANIFEST} not found): nothing to revert. "
            "Only what `deploy --to` changed can be reverted."
        )
    if manifest.get("format") != MANIFEST_FORMAT:
        raise BadInput(f"{target.backup / MANIFEST}: unknown format {manifest.get('format')!r}")
    restore = StagedWrite()
    edited, done = [], []
    for f in manifest["files"]:
        path = target.file(f["path"])
        have = sha256(read(path))
        if have not in (f["fork_sha256"], f["original_sha256"]):
            edited.append(f["path"])
        if f["original_sha256"] is None:
            restore.delete(path)
        else:
            original = (target.backup / "original" / f["path"]).read_bytes()
            if sha256(original) != f["original_sha256"]:
                raise ForkError(f"backup of {f['path']} in {target.backup} is damaged (sha256 mismatch); not reverting")
            restore.write(path, original)
        for pyc in _pycache(path):  # compiled since the deploy, or left by an interrupted one
            restore.delete(pyc)
        done.append(f"{'restored' if f['original_sha256'] else 'removed'} {f['path']}")
    for p in manifest.get("pycache", []):  # the compiled files pip installed, as they were
        original = (target.backup / "original" / p["path"]).read_bytes()
        if sha256(original) != p["sha256"]:
            raise ForkError(f"backup of {p['path']} in {target.backup} is damaged (sha256 mismatch); not reverting")
        restore.write(target.root / p["path"], original)
    if manifest.get("pycache"):
        done.append(f"restored {len(manifest['pycache'])} compiled file(s) (__pycache__)")
    record = manifest.get("record")
    if record:
        path = target.root / record["path"]
        if sha256(read(path)) not in (record["deployed_sha256"], record["original_sha256"]):
            edited.append(record["path"])
        restore.write(path, (target.backup / "original" / record["path"]).read_bytes())
        done.append(f"restored {record['path']}")
    if edited and not force:
        raise LocalEdits.revert_refused(
            f"files changed since the deploy into {target.package}; reverting would discard that",
            edited,
            "restore the originals",
        )
    restore.commit()
    shutil.rmtree(target.backup)
    return done


@dataclass
class Row:
    path: str
    expected: str | None  # sha256, None: must be absent
    actual: str | None

    @property
    def ok(self) -> bool:
        return self.expected == self.actual


def verify_rows(target: Target, exp: Expected) -> list[Row]:
    return [Row(ch.path, sha256(ch.fork), sha256(read(target.file(ch.path)))) for ch in exp.changes]


def record_problems(target: Target, exp: Expected) -> list[str]:
    """Whether the dist-info RECORD describes the fork's files (so pip uninstall removes them)."""
    if target.dist_info is None:
        return []
    listed = {row[0]: row for row in record_rows((target.dist_info / "RECORD").read_bytes())}
    problems = []
    for ch in exp.changes:
        row = listed.get(ch.path)
        if ch.fork is None and row is not None:
            problems.append(f"{ch.path}: listed, but the fork removes it")
        elif ch.fork is not None and (row is None or (len(row) > 1 and row[1] and row[1] != record_hash(ch.fork))):
            problems.append(f"{ch.path}: {'not listed' if row is None else 'listed with another sha256'}")
    return problems
