"""Deploy the fork into an existing vllm-ascend, verify it by content hash, and revert it.

  deploy --to PATH       apply the series for the vllm-ascend version found at PATH
  deploy --verify PATH   a per-file table: every file the series touches has the fork's content
  deploy --revert PATH   undo `deploy --to PATH`, byte for byte

PATH is one of:
  - an upstream git checkout (clean): the series (with the per-base variants of its version) is
    applied with `git am -3`, one commit per patch; the HEAD before is kept in
    .git/fork-deploy.json, and --revert resets to it;
  - an installed `vllm_ascend` package directory (site-packages, from a wheel; or the source tree
    of an editable install; site-packages itself is accepted too): only the hunks under
    vllm_ascend/ are applied (tests and docs are skipped), with `git apply`, after every file the
    series touches was compared with the base release's own file (the sha256-checked sdist).
    The original bytes of every file changed are kept in <dir of the package>/vllm_ascend-fork-deploy/
    (outside the package), and the dist-info RECORD lists the fork's files and that backup, so
    `pip uninstall vllm-ascend` removes them too.
Refused with the reason, and nothing changed: a version that is not a base in fork.toml, a tree that
is already patched, a file that differs from upstream, a dirty checkout, a revert with no backup.
The expected content comes from the fork materialized on that base in build/deploy/<version>.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork import git, series, upstream
from tools.fork.config import ForkConfig
from tools.fork.errors import EXIT_FAILED, EXIT_OK, BadInput, ForkError, LocalEdits
from tools.fork.materialize import base_tag, materialize
from tools.fork.txn import StagedWrite

HELP = __doc__

PACKAGE = "vllm_ascend"
BACKUP_DIR = "vllm_ascend-fork-deploy"  # beside the package directory, never inside it
MANIFEST = "manifest.json"
CHECKOUT_STATE = "fork-deploy.json"  # in the checkout's .git/
MANIFEST_FORMAT = 1
# Where the installed package is, without importing it (the Dockerfile and docs/deploy.md use this too).
FIND_PACKAGE = (
    'python3 -I -c \'import importlib.util as u, sys; s = u.find_spec("vllm_ascend"); '
    "print(s.submodule_search_locations[0]) if s else "
    'sys.exit(sys.executable + " has no vllm_ascend: install vllm-ascend into it first")\''
)


class AlreadyDeployed(BadInput):
    """The target already carries the fork (a backup exists, or the fork's content is there)."""


def _target_path(text: str) -> Path:
    if not text.strip():  # e.g. "$PKG" when the command that should have found the package failed
        raise BadInput("the PATH given to --to/--verify/--revert is empty: nothing to deploy into")
    return Path(text)


def add_arguments(p) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--to", type=_target_path, metavar="PATH", help="deploy the series into PATH")
    what.add_argument(
        "--verify", type=_target_path, metavar="PATH", help="check PATH has the fork's content; exit 1 if not"
    )
    what.add_argument("--revert", type=_target_path, metavar="PATH", help="restore what `deploy --to PATH` changed")
    p.add_argument(
        "--base",
        metavar="VERSION",
        help="the vllm-ascend version at PATH, when it cannot be read there (checked if it can)",
    )
    p.add_argument(
        "--sdist", type=Path, metavar="PATH", help="the base's sdist (sha256-checked) instead of cache/registry"
    )
    p.add_argument("--force", action="store_true", help="--revert: restore even files edited after the deploy")


# ---------------------------------------------------------------------------------------------
# What the series does to a base: the fork materialized on it


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
    materialize(tree, lambda: upstream.resolve(cfg, version, sdist=sdist), version, patches, force=True)
    paths = ["--", f"{scope}/"] if scope else []
    log = git.out(["log", "--format=", "--name-only", "--no-renames", f"{base_tag(version)}..HEAD", *paths], tree)
    changes = [
        Change(path, _blob(tree, base_tag(version), path), _blob(tree, "HEAD", path))
        for path in sorted(set(filter(None, log.splitlines())))
    ]
    return Expected(version, tree, patches, changes)


def _blob(tree: Path, rev: str, path: str) -> bytes | None:
    proc = git.run(["cat-file", "blob", f"{rev}:{path}"], tree, check=False, binary=True)
    return proc.stdout if proc.returncode == 0 else None


def sha256(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


# ---------------------------------------------------------------------------------------------
# The target


@dataclass
class Target:
    kind: str  # "checkout" or "package"
    root: Path  # checkout: its root; package: the directory holding vllm_ascend/ (site-packages)
    version: str | None = None  # the version found there (None: not found)
    version_from: str = ""
    dist_info: Path | None = None  # package: the dist-info whose RECORD lists the package's files
    notes: list[str] = field(default_factory=list)

    @property
    def package(self) -> Path:
        return self.root / PACKAGE

    @property
    def backup(self) -> Path:
        return self.root / BACKUP_DIR

    def file(self, rel: str) -> Path:
        return self.root / rel


def find_target(path: Path) -> Target:
    """Tell a git checkout from a package directory; anything else is refused."""
    if not path.exists():
        raise BadInput(f"{path}: no such directory")
    if not path.is_dir():
        raise BadInput(f"{path}: not a directory (give a vllm-ascend checkout or the installed vllm_ascend directory)")
    path = path.resolve()
    if git.is_repo(path) and (path / PACKAGE / "__init__.py").is_file():
        target = Target("checkout", path)
        target.version, target.version_from = _checkout_version(path)
        return target
    if path.name == PACKAGE and (path / "__init__.py").is_file():
        root = path.parent
    elif (path / PACKAGE / "__init__.py").is_file():
        root = path
    else:
        raise BadInput(
            f"{path} is neither a vllm-ascend git checkout nor an installed vllm_ascend package directory "
            f"(no {PACKAGE}/__init__.py); find the installed one with: {FIND_PACKAGE}"
        )
    target = Target("package", root)
    target.dist_info = _owning_dist_info(root)
    target.version, target.version_from = _package_version(target)
    if target.dist_info is None:
        target.notes.append(
            f"no dist-info beside {root} lists the package's files (an editable install?): RECORD is not updated"
        )
    if git.is_repo(root):  # the package of an editable install from a git checkout
        target.notes.append(
            f"{root} is a git checkout: files are patched in place, not committed "
            f"(`deploy --to {root}` would commit the series with `git am` instead)"
        )
    return target


def _owning_dist_info(root: Path) -> Path | None:
    owners = []
    for d in sorted(root.glob("*.dist-info")):
        if re.sub(r"[-_.]+", "_", d.name.split("-", 1)[0]).lower() != PACKAGE:
            continue
        record = d / "RECORD"
        if record.is_file() and any(
            row and row[0] == f"{PACKAGE}/__init__.py" for row in _record_rows(record.read_bytes())
        ):
            owners.append(d)
    if len(owners) > 1:
        raise BadInput(
            f"{root}: several dist-infos list {PACKAGE}/ ({', '.join(d.name for d in owners)}); fix the installation"
        )
    return owners[0] if owners else None


_VERSION_PY = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


def _package_version(target: Target) -> tuple[str | None, str]:
    if target.dist_info is not None:
        for line in (target.dist_info / "METADATA").read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip(), f"{target.dist_info.name}/METADATA"
            if not line.strip():
                break
    version_py = target.package / "_version.py"
    if version_py.is_file():
        m = _VERSION_PY.search(version_py.read_text(errors="replace"))
        if m:
            return m.group(1), f"{PACKAGE}/_version.py"
    return None, ""


def _checkout_version(root: Path) -> tuple[str | None, str]:
    state = _load_json(root / ".git" / CHECKOUT_STATE)
    if state:
        return state.get("base"), f".git/{CHECKOUT_STATE}"
    tag = git.run(["describe", "--tags", "--exact-match", "HEAD"], root, check=False).stdout.strip()
    if tag:
        return tag.removeprefix("v"), f"tag {tag}"
    version_py = root / PACKAGE / "_version.py"
    m = _VERSION_PY.search(version_py.read_text(errors="replace")) if version_py.is_file() else None
    return (m.group(1), f"{PACKAGE}/_version.py") if m else (None, "")


def base_version(cfg: ForkConfig, target: Target, given: str | None, *, fork_build_ok: bool = False) -> str:
    """The base in fork.toml that the target is; refused with the reason otherwise.

    The fork's own wheel (`<base>+fork...`) is refused for a deploy, accepted for --verify.
    """
    found = target.version
    if found is None:
        if given is None:
            raise BadInput(f"cannot tell which vllm-ascend version {target.root} is; pass --base VERSION")
        found, target.version_from = given, "--base"
    public, _, local = found.partition("+")
    if local.startswith("fork") and fork_build_ok:
        local = ""
    elif local.startswith("fork"):
        raise AlreadyDeployed(
            f"{target.root} is the fork's own build (vllm-ascend {found}, {target.version_from}): already patched"
        )
    if given is not None and given != public:
        raise BadInput(f"{target.root} is vllm-ascend {found} ({target.version_from}), not {given} (--base)")
    if local:
        raise BadInput(
            f"{target.root} is vllm-ascend {found} ({target.version_from}), a local build, not a release in fork.toml"
        )
    try:
        return cfg.base(public).version
    except BadInput as exc:
        raise BadInput(f"{target.root}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# dist-info RECORD


def _record_rows(data: bytes) -> list[list[str]]:
    return [row for row in csv.reader(io.StringIO(data.decode())) if row]


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record_with(data: bytes, files: dict[str, bytes | None], extra: list[str]) -> bytes:
    """RECORD with `files` (path -> new content, None: removed) and `extra` paths (listed, no hash)."""
    text = data.decode()
    newline = "\r\n" if "\r\n" in text else "\n"
    rows = [row for row in _record_rows(data) if row[0] not in files and row[0] not in extra]
    for path, content in sorted(files.items()):
        if content is not None:
            rows.append([path, record_hash(content), str(len(content))])
    rows += [[path, "", ""] for path in extra]
    buf = io.StringIO()
    csv.writer(buf, lineterminator=newline).writerows(rows)
    return buf.getvalue().encode()


# ---------------------------------------------------------------------------------------------
# Installed package: deploy, verify, revert


def _pycache(path: Path) -> list[Path]:
    cache = path.parent / "__pycache__"
    return sorted(cache.glob(f"{path.stem}.*.pyc")) if path.suffix == ".py" and cache.is_dir() else []


def _states(target: Target, exp: Expected) -> dict[str, str]:
    """path -> "upstream" | "fork" | "other" for every file the series touches."""
    out = {}
    for ch in exp.changes:
        have = _read(target.file(ch.path))
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
        result = {ch.path: _read(stage / ch.path) for ch in exp.changes}
    wrong = [ch.path for ch in exp.changes if result[ch.path] != ch.fork]
    if wrong:
        raise ForkError(
            f"`git apply` gave other content than the materialized fork ({exp.tree}) for: {', '.join(wrong)}; "
            "nothing was changed"
        )
    return result


def refuse_if_deployed(target: Target) -> None:
    if target.kind == "package" and target.backup.exists():
        raise AlreadyDeployed(
            f"{target.package} is already deployed (backup {target.backup} exists); "
            f"`deploy --revert {target.package}` first"
        )
    state = target.root / ".git" / CHECKOUT_STATE
    if target.kind == "checkout" and state.exists():
        raise AlreadyDeployed(
            f"{target.root}: the series is already deployed ({state}); `deploy --revert {target.root}` first"
        )


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
        lines = [f"{ch.path}: {_describe(_read(target.file(ch.path)), ch)}" for ch in bad]
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
            record is None or sha256(_read(target.root / record["path"])) == record["original_sha256"]
        )
        if untouched:  # failed while staging (e.g. disk full): nothing to undo but the backup
            shutil.rmtree(target.backup, ignore_errors=True)
            raise
        raise ForkError(
            f"deploy into {target.package} was interrupted after some files changed; the backup is in "
            f"{target.backup}: run `deploy --revert {target.package}`"
        ) from None
    return [f"{ch.status} {ch.path}" for ch in changing]


def _load_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def revert_package(target: Target, *, force: bool = False) -> list[str]:
    manifest = _load_json(target.backup / MANIFEST)
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
        have = sha256(_read(path))
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
        if sha256(_read(path)) not in (record["deployed_sha256"], record["original_sha256"]):
            edited.append(record["path"])
        restore.write(path, (target.backup / "original" / record["path"]).read_bytes())
        done.append(f"restored {record['path']}")
    if edited and not force:
        raise LocalEdits(
            f"files changed since the deploy into {target.package}; reverting would discard that:\n  - "
            + "\n  - ".join(edited)
            + "\nNothing was changed. Pass --force to restore the originals anyway."
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
    return [Row(ch.path, sha256(ch.fork), sha256(_read(target.file(ch.path)))) for ch in exp.changes]


def record_problems(target: Target, exp: Expected) -> list[str]:
    """Whether the dist-info RECORD describes the fork's files (so pip uninstall removes them)."""
    if target.dist_info is None:
        return []
    listed = {row[0]: row for row in _record_rows((target.dist_info / "RECORD").read_bytes())}
    problems = []
    for ch in exp.changes:
        row = listed.get(ch.path)
        if ch.fork is None and row is not None:
            problems.append(f"{ch.path}: listed, but the fork removes it")
        elif ch.fork is not None and (row is None or (len(row) > 1 and row[1] and row[1] != record_hash(ch.fork))):
            problems.append(f"{ch.path}: {'not listed' if row is None else 'listed with another sha256'}")
    return problems


def _short(digest: str | None) -> str:
    return "(absent)" if digest is None else digest[:16]


def print_table(rows: list[Row]) -> None:
    width = max([len(r.path) for r in rows] + [4])
    print(f"  {'path':<{width}}  {'expected (fork)':<16}  {'actual':<16}  result")
    for r in rows:
        print(f"  {r.path:<{width}}  {_short(r.expected):<16}  {_short(r.actual):<16}  {'ok' if r.ok else 'MISMATCH'}")


# ---------------------------------------------------------------------------------------------
# Git checkout: deploy (git am -3), revert (reset to the HEAD before)


def deploy_checkout(cfg: ForkConfig, target: Target, version: str) -> list[str]:
    root = target.root
    state_path = root / ".git" / CHECKOUT_STATE
    refuse_if_deployed(target)
    if git.am_in_progress(root) or (root / ".git" / "rebase-merge").exists():
        raise LocalEdits(f"{root}: a `git am` or `git rebase` is in progress; finish or abort it first")
    dirty = git.dirty_summary(root)
    if dirty:
        raise LocalEdits(f"{root} has uncommitted changes ({dirty}); commit or stash them first. Nothing was changed.")
    patches = series.read(cfg, version)
    if not patches:
        raise BadInput("patches/series is empty: nothing to deploy")
    pre = git.out(["rev-parse", "HEAD"], root)
    branch = git.run(["symbolic-ref", "-q", "--short", "HEAD"], root, check=False).stdout.strip() or None
    proc = git.run(
        ["am", "-3", "--keep-non-patch", "--whitespace=nowarn", *(str(p.path.resolve()) for p in patches)],
        root,
        check=False,
    )
    if proc.returncode != 0:
        git.run(["am", "--abort"], root, check=False)
        if git.out(["rev-parse", "HEAD"], root) != pre:
            git.run(["reset", "-q", "--hard", pre], root)
        out = proc.stdout + proc.stderr
        failed = re.search(r"Patch failed at (\d+)", out)
        name = patches[int(failed.group(1)) - 1].name if failed else "?"
        already = "already patched: " if "Patch already applied" in out or "No changes" in out else ""
        detail = [
            ln.strip() for ln in out.splitlines() if ln.startswith(("error:", "CONFLICT", "Patch failed", "No changes"))
        ]
        raise ForkError(
            f"{already}patch {name} does not apply to {root} (vllm-ascend {version}); nothing was changed:\n  "
            + "\n  ".join(detail[-10:] or out.strip().splitlines()[-8:])
        )
    post = git.out(["rev-parse", "HEAD"], root)
    state = {
        "base": version,
        "pre_head": pre,
        "post_head": post,
        "branch": branch,
        "series": [[p.name, p.sha256] for p in patches],
    }
    state_path.write_text(json.dumps(state, indent=1) + "\n")
    return [f"{p.name}" for p in patches]


def revert_checkout(target: Target, *, force: bool = False) -> list[str]:
    root = target.root
    state_path = root / ".git" / CHECKOUT_STATE
    state = _load_json(state_path)
    if state is None:
        raise BadInput(f"{root}: no deploy record ({state_path} not found): nothing to revert")
    head = git.out(["rev-parse", "HEAD"], root)
    problems = []
    if head != state["post_head"]:
        problems.append(f"HEAD moved since the deploy ({state['post_head'][:12]} -> {head[:12]})")
    dirty = git.dirty_summary(root)
    if dirty:
        problems.append(f"uncommitted changes: {dirty}")
    if problems and not force:
        raise LocalEdits(
            f"{root}: reverting would discard work done after the deploy:\n  - "
            + "\n  - ".join(problems)
            + "\nNothing was changed. Pass --force to reset to the pre-deploy HEAD anyway."
        )
    git.run(["reset", "-q", "--hard", state["pre_head"]], root)
    state_path.unlink()
    return [
        f"reset {state.get('branch') or 'HEAD'} to {state['pre_head'][:12]} (dropped {len(state['series'])} commit(s))"
    ]


# ---------------------------------------------------------------------------------------------
# The verb


def verify(cfg: ForkConfig, target: Target, version: str, *, sdist: Path | None = None) -> bool:
    scope = PACKAGE if target.kind == "package" else None
    exp = expected(cfg, version, sdist=sdist, scope=scope)
    rows = verify_rows(target, exp)
    where = f"{len(rows)} file(s) the series touches" + (f" under {PACKAGE}/" if scope else "")
    print(f"fork deploy --verify: {target.root if target.kind == 'checkout' else target.package}")
    print(
        f"  vllm-ascend {version} ({target.version_from}), {len(exp.patches)} patch(es), {where}; "
        "sha256, first 16 hex digits"
    )
    if not rows:
        print("  the series touches no file here: nothing to verify")
        return False
    print_table(rows)
    bad = [r for r in rows if not r.ok]
    rec = record_problems(target, exp) if target.kind == "package" else []
    if target.kind == "package" and target.dist_info is not None:
        status = "ok" if not rec else "MISMATCH"
        print(f"  {target.dist_info.name}/RECORD lists the fork's files (pip uninstall removes them): {status}")
        for p in rec:
            print(f"    - {p}")
    deployed = target.backup.exists() if target.kind == "package" else (target.root / ".git" / CHECKOUT_STATE).exists()
    ok = not bad and not rec
    if deployed:
        how = "deployed in place (`deploy --revert` undoes it)"
    else:
        how = "no deploy record (the fork's own build?)" if ok else "not deployed"
    verdict = (
        f"{len(rows)}/{len(rows)} files match the fork"
        if ok
        else f"{len(bad)} of {len(rows)} files differ from the fork"
    )
    print(f"fork deploy --verify: {'OK' if ok else 'FAILED'}: {verdict}; {how}")
    return ok


def run(args, cfg) -> int:
    path = args.to or args.verify or args.revert
    target = find_target(path)
    for note in target.notes:
        print(f"fork deploy: note: {note}")
    if args.revert:
        done = (
            revert_checkout(target, force=args.force)
            if target.kind == "checkout"
            else revert_package(target, force=args.force)
        )
        for line in done:
            print(f"fork deploy --revert: {line}")
        print(f"fork deploy --revert: {target.root if target.kind == 'checkout' else target.package}: reverted")
        return EXIT_OK
    if args.to:
        refuse_if_deployed(target)
    version = base_version(cfg, target, args.base, fork_build_ok=bool(args.verify))
    if args.verify:
        return EXIT_OK if verify(cfg, target, version, sdist=args.sdist) else EXIT_FAILED
    if target.kind == "checkout":
        applied = deploy_checkout(cfg, target, version)
        for name in applied:
            print(f"fork deploy: applied {name}")
        print(
            f"fork deploy: {target.root}: vllm-ascend {version} ({target.version_from}) "
            f"+ {len(applied)} commit(s) (git am -3)"
        )
        print(f"fork deploy: undo with `python -m tools.fork deploy --revert {target.root}`")
        return EXIT_OK
    done = deploy_package(cfg, target, version, sdist=args.sdist)
    for line in done:
        print(f"fork deploy: {line}")
    print(
        f"fork deploy: {target.package}: vllm-ascend {version} ({target.version_from}) patched in place, "
        f"{len(done)} file(s); backup in {target.backup}"
        + (f"; {target.dist_info.name}/RECORD updated" if target.dist_info else "")
    )
    print(f"fork deploy: check with `deploy --verify {target.package}`, undo with `deploy --revert {target.package}`")
    return EXIT_OK
