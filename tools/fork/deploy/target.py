"""Where a deploy goes: tell a vllm-ascend git checkout from an installed package, and which base it is."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from shlex import quote

from tools.fork.core import git
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput
from tools.fork.deploy.dist_record import record_rows
from tools.fork.deploy.expected import PACKAGE

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
            row and row[0] == f"{PACKAGE}/__init__.py" for row in record_rows(record.read_bytes())
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
    state = load_json(root / ".git" / CHECKOUT_STATE)
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


def refuse_if_deployed(target: Target) -> None:
    if target.kind == "package" and target.backup.exists():
        raise AlreadyDeployed(
            f"{target.package} is already deployed (backup {target.backup} exists); "
            f"`deploy --revert {quote(str(target.package))}` first"
        )
    state = target.root / ".git" / CHECKOUT_STATE
    if target.kind == "checkout" and state.exists():
        raise AlreadyDeployed(
            f"{target.root}: the series is already deployed ({state}); "
            f"`deploy --revert {quote(str(target.root))}` first"
        )


def load_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return data if isinstance(data, dict) else None
