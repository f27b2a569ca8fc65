"""The fork's configuration: `fork.toml` and the repository layout."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.core.errors import EXIT_TOOLS_ENV, BadInput, ForkError

# A release version as the package registry spells it (PEP 440 subset: X.Y.Z, rcN, .postN, .devN).
VERSION_RE = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli (tools/requirements.txt), else the copy pip vendors
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        try:
            from pip._vendor import tomli as tomllib
        except ImportError:
            tomllib = None

REPO_ROOT = Path(__file__).resolve().parents[3]  # tools/fork/core/config.py

# Files the fork adds live in the repository at their upstream paths, under these roots.
OVERLAY_ROOTS = ("vllm_ascend", "tests")


@dataclass(frozen=True)
class Base:
    """One upstream release: a version and the sha256 of its sdist."""

    version: str
    sha256: str


@dataclass(frozen=True)
class ForkConfig:
    root: Path
    dist: str
    pin: Base
    bases: tuple[Base, ...]
    # patch file name -> why it is fork-only (left out of upstream exports)
    fork_only: dict[str, str] = field(default_factory=dict)

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def series_file(self) -> Path:
        return self.patches_dir / "series"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def toml_path(self) -> Path:
        return self.root / "fork.toml"

    def variants_dir(self, version: str) -> Path:
        """Per-base variants of patches: `patches/bases/<version>/<name>`."""
        return self.patches_dir / "bases" / version

    def base(self, version: str | None) -> Base:
        """The base named `version` (the pin when None); supported bases only."""
        if version is None or version == self.pin.version:
            return self.pin
        for base in self.bases:
            if base.version == version:
                return base
        supported = ", ".join(b.version for b in self.bases)
        raise BadInput(f"vllm-ascend {version} is not a base of this fork (fork.toml lists: {supported})")

    def default_fork_dir(self, version: str | None = None) -> Path:
        if version is None or version == self.pin.version:
            return self.build_dir / "fork"
        return self.build_dir / f"fork-{version}"

    def default_base_dir(self, version: str | None = None) -> Path:
        return self.build_dir / f"base-{version or self.pin.version}"


def cache_dir() -> Path:
    """Where downloaded sdists are kept (FORK_CACHE overrides)."""
    env = os.environ.get("FORK_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vllm-ascend-fork"


def _base(entry: dict, where: str) -> Base:
    try:
        version, sha256 = str(entry["version"]), str(entry["sha256"]).lower()
    except KeyError as exc:
        raise BadInput(f"fork.toml: {where} lacks {exc.args[0]!r}") from None
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise BadInput(f"fork.toml: {where} sha256 {sha256!r} is not 64 hex digits")
    return Base(version, sha256)


def load(root: Path = REPO_ROOT) -> ForkConfig:
    path = root / "fork.toml"
    if tomllib is None:
        raise ForkError(
            "reading fork.toml on Python 3.10 needs tomli: `pip install tomli`, or use build/tools-venv/bin/python",
            EXIT_TOOLS_ENV,
        )
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{path} not found: run the tooling from the fork's repository") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path}: {exc}") from None
    upstream = data.get("upstream")
    if not isinstance(upstream, dict):
        raise BadInput(f"{path}: missing [upstream] table")
    pin = _base(upstream, "[upstream]")
    bases = tuple(_base(b, f"[[bases]] #{i + 1}") for i, b in enumerate(data.get("bases", [])))
    for b in bases:
        if b.version == pin.version and b.sha256 != pin.sha256:
            raise BadInput(f"{path}: [[bases]] {b.version} and [upstream] disagree on the sha256")
    if pin.version not in {b.version for b in bases}:
        bases = (pin, *bases)
    fork_only = {
        name: str(meta.get("reason", "fork-only"))
        for name, meta in data.get("patches", {}).items()
        if isinstance(meta, dict) and meta.get("fork_only")
    }
    return ForkConfig(
        root=root,
        dist=str(upstream.get("dist", "vllm-ascend")),
        pin=pin,
        bases=bases,
        fork_only=fork_only,
    )
