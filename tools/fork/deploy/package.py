"""Deploy into an installed vllm_ascend package: `git apply` of its hunks, a backup, RECORD; verify; revert."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from shlex import quote

from tools.fork.core import git
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput, ForkError, LocalEdits
from tools.fork.core.journal import write_file
from tools.fork.core.txn import signals_deferred
from tools.fork.deploy import journal
from tools.fork.deploy.dist_record import record_hash, record_rows, record_with
from tools.fork.deploy.expected import PACKAGE, Change, Expected, expected, read, sha256
from tools.fork.deploy.target import (
    BACKUP_DIR,
    MANIFEST,
    MANIFEST_FORMAT,
    AlreadyDeployed,
    Target,
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


def package_changes(target: Target, exp: Expected) -> Expected:
    """The series' changes an installed package takes. A release's wheel leaves out some files of its
    source tree (the op docs, `*.md`): a change to a file that is neither Python nor installed here
    stays in the source tree and in the wheel the fork builds."""
    keep = [ch for ch in exp.changes if ch.path.endswith(".py") or target.file(ch.path).exists()]
    return dataclasses.replace(exp, changes=keep)


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
        args = ["apply", "-p1", *(f"--include={ch.path}" for ch in exp.changes), "--whitespace=nowarn"]
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
    exp = package_changes(target, expected(cfg, version, sdist=sdist))
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

    # The transaction (journal.py): originals, staged files and the plan in the backup, then the
    # package by renames, then the commit point (manifest.json).
    dirs = journal.Dirs(target.backup)
    files, pycache, originals, staged, removed = [], [], {}, {}, []
    for ch in changing:
        if ch.base is not None:
            originals[ch.path] = ch.base
        if result[ch.path] is None:
            removed.append(ch.path)
        else:
            staged[ch.path] = result[ch.path]
        files.append(
            {"path": ch.path, "status": ch.status, "original_sha256": sha256(ch.base), "fork_sha256": sha256(ch.fork)}
        )
        # compiled files of the changed modules: stale once the source changes, so removed, and kept
        # in the backup, so that --revert puts back every byte (and folder)
        for pyc in _pycache(target.file(ch.path)):
            rel = pyc.relative_to(target.root).as_posix()
            data = pyc.read_bytes()
            originals[rel] = data
            pycache.append({"path": rel, "sha256": sha256(data)})
            removed.append(rel)
    backup_files = [f"{BACKUP_DIR}/{MANIFEST}"] + [f"{BACKUP_DIR}/original/{rel}" for rel in originals]
    record = None
    if target.dist_info is not None:
        rec_path = target.dist_info / "RECORD"
        rec_rel = rec_path.relative_to(target.root).as_posix()
        original = rec_path.read_bytes()
        new = record_with(
            original,
            {ch.path: result[ch.path] for ch in changing},
            backup_files + [f"{BACKUP_DIR}/original/{rec_rel}"],
        )
        originals[rec_rel] = original
        staged[rec_rel] = new
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
    try:
        target.backup.mkdir()
        for rel, data in originals.items():
            write_file(target.backup / "original" / rel, data)
        for rel, data in staged.items():
            write_file(target.backup / "new" / rel, data)
    except BaseException as exc:  # e.g. disk full, read-only: the package was not touched
        journal.dispose(target.backup)
        if isinstance(exc, OSError):
            raise _unwritable(exc, target) from None
        raise
    journal.write_json_atomic(target.backup / journal.PLAN, manifest)
    try:
        with signals_deferred():
            for rel in staged:  # RECORD last among the renames (dict order: files, then RECORD)
                dest = target.root / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(target.backup / "new" / rel, dest)
            for rel in removed:
                (target.root / rel).unlink()
                journal.prune_empty_dirs((target.root / rel).parent, target.package)
            journal.prune_empty_dirs_below(target.backup / "new")
            os.replace(target.backup / journal.PLAN, target.backup / MANIFEST)  # the commit point
    except BaseException as exc:
        try:
            journal.recover(dirs, target.root)
        except BaseException:
            raise ForkError(
                f"deploy into {target.package} failed ({exc.__class__.__name__}: {exc}) and could not be rolled "
                f"back; `deploy --revert {quote(str(target.package))}` finishes the rollback"
            ) from None
        raise ForkError(
            f"deploy into {target.package} failed ({exc.__class__.__name__}: {exc}); rolled back, nothing changed"
        ) from None
    return [f"{ch.status} {ch.path}" for ch in changing]


_REINSTALL = "reinstall vllm-ascend (pip install --force-reinstall --no-deps vllm-ascend==VERSION), then rm -rf"


def _unwritable(exc: OSError, target: Target) -> ForkError:
    where = quote(str(exc.filename or target.root))
    return ForkError(
        f"cannot write beside {target.package} ({exc.strerror or exc}: {where}); nothing was changed. "
        "Run the deploy as the user that owns the environment."
    )


def recover(target: Target) -> str | None:
    """Finish what a killed deploy or revert left (journal.py), reporting a broken backup in one line."""
    try:
        return journal.recover(journal.Dirs(target.backup), target.root)
    except OSError as exc:
        raise _unwritable(exc, target) from None


def revert_package(target: Target, *, force: bool = False, recovered: bool = False) -> list[str]:
    """Undo a committed deploy (what a killed one left is finished by `recover` first; `recovered`: it was)."""
    dirs = journal.Dirs(target.backup)
    if journal.state(dirs) == "clean":
        if recovered:
            return []
        raise BadInput(
            f"no deploy backup for {target.package} ({quote(str(target.backup / MANIFEST))} not found): nothing "
            "to revert. Only what `deploy --to` changed can be reverted."
        )
    try:
        manifest = journal.load_manifest(target.backup / MANIFEST)
    except BadInput as exc:
        raise BadInput(f"{exc}; it cannot be reverted from there: {_REINSTALL} {quote(str(target.backup))}") from None
    edited, done = [], []
    for f in manifest["files"]:
        have = sha256(read(target.file(f["path"])))
        if have not in (f["fork_sha256"], f["original_sha256"]):
            edited.append(f["path"])
        done.append(f"{'restored' if f['original_sha256'] else 'removed'} {f['path']}")
    if manifest.get("pycache"):
        done.append(f"restored {len(manifest['pycache'])} compiled file(s) (__pycache__)")
    record = manifest.get("record")
    if record:
        if sha256(read(target.root / record["path"])) not in (record["deployed_sha256"], record["original_sha256"]):
            edited.append(record["path"])
        done.append(f"restored {record['path']}")
    for rel, original, _ in journal._entries(manifest):
        saved = target.backup / "original" / rel
        if original is not None and sha256(read(saved)) != original:
            state = "missing" if not saved.is_file() else "damaged (sha256 mismatch)"
            raise ForkError(
                f"the backup of {rel} is {state} ({quote(str(saved))}); not reverting, nothing was changed. "
                f"{_REINSTALL} {quote(str(target.backup))}"
            )
    if edited and not force:
        raise LocalEdits.revert_refused(
            f"files changed since the deploy into {target.package}; reverting would discard that",
            edited,
            "restore the originals",
        )
    try:
        journal.mark(target.backup, journal.REVERTING)  # from here the revert is finished forward
        journal.restore_originals(target.root, target.backup, manifest)
        journal.dispose(target.backup)  # the commit point: marked disposing
    except OSError as exc:
        raise _unwritable(exc, target) from None
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
