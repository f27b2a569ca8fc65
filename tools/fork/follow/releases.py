"""Which vllm-ascend releases the package registry has, asked with pip (pre-releases included).

pip is the client: its configuration and environment (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX,
a pip.conf) choose the index, so a mirror, or a local folder of sdists in the tests, works unchanged.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from tools.fork.core.config import VERSION_RE
from tools.fork.core.errors import UpstreamUnavailable

_LISTED = "Available versions:"


def _pip_python() -> str:
    """This Python when it has pip, else the download helper venv's (which always has)."""
    if importlib.util.find_spec("pip") is not None:
        return sys.executable
    from tools.fork.core.registry import helper_python

    return str(helper_python())


def registry_versions(dist: str) -> list[str]:
    """Every release of `dist` the registry lists, pre-releases included (`pip index versions --pre`: uv
    has no listing of versions)."""
    cmd = [_pip_python(), "-m", "pip", "index", "versions", "--pre", "--disable-pip-version-check", dist]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    listed = [line for line in proc.stdout.splitlines() if line.startswith(_LISTED)]
    if proc.returncode != 0 or not listed:
        tail = "\n  ".join((proc.stderr.strip() or proc.stdout.strip()).splitlines()[-4:])
        raise UpstreamUnavailable(f"could not list the releases of {dist} on the package registry (pip):\n  {tail}")
    return [v.strip() for v in listed[0].split(":", 1)[1].split(",") if v.strip()]


def release_key(version: str):
    """PEP 440 order (0.30.0rc1 < 0.30.0rc2 < 0.30.0 < 0.30.0.post1), from `packaging`, or pip's copy of it."""
    try:
        from packaging.version import Version
    except ModuleNotFoundError:
        from pip._vendor.packaging.version import Version
    return Version(version)


def newer_than(pin: str, versions: list[str]) -> list[str]:
    """The releases in `versions` newer than `pin`, oldest first (names that are not release versions skipped)."""
    key = release_key(pin)
    return sorted((v for v in versions if VERSION_RE.match(v) and release_key(v) > key), key=release_key)
