"""Downloading a release's sdist from the package registry with pip, into the cache."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tools.fork.core import lock
from tools.fork.core.config import ForkConfig, cache_dir
from tools.fork.core.errors import BadInput, UpstreamUnavailable

# What pip needs to read vllm-ascend's sdist metadata without Ascend tooling.
_PIP_ENV = {"SOC_VERSION": "ascend910b1", "COMPILE_CUSTOM_KERNELS": "0"}


def sdist_name(dist: str, version: str) -> str:
    return f"{dist.replace('-', '_')}-{version}.tar.gz"


def cached_sdist(cfg: ForkConfig, version: str) -> Path:
    """Where the cache keeps `version`'s sdist (it may not be there)."""
    return cache_dir() / "sdists" / sdist_name(cfg.dist, version)


# What pip needs importable to read vllm-ascend's sdist metadata (`pip download` prepares it):
# kept in a small cached helper venv, so that getting a file never needs this Python to have them.
HELPER_TOOLS = ("setuptools>=64,<81", "setuptools-scm>=8", "wheel")


def helper_python() -> Path:
    """The cached helper venv's Python (<cache>/pip-helper), built once; the stamp is written last."""
    import json

    home = cache_dir() / "pip-helper"
    python = home / "venv" / "bin" / "python"
    want = {"tools": list(HELPER_TOOLS), "python": ".".join(map(str, sys.version_info[:2]))}
    stamp = home / "stamp.json"
    with lock.exclusive(home / "lock", "the download helper venv", wait=True):
        try:
            if python.exists() and json.loads(stamp.read_text()) == want:
                return python
        except (OSError, ValueError):
            pass
        stamp.unlink(missing_ok=True)
        print(f"fork: making the download helper venv ({home}: {', '.join(HELPER_TOOLS)}) ...", flush=True)
        shutil.rmtree(home / "venv", ignore_errors=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        for cmd in (
            [sys.executable, "-m", "venv", str(home / "venv")],
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *HELPER_TOOLS],
        ):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n  ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
                raise UpstreamUnavailable(
                    f"the download helper venv could not be made ({' '.join(cmd[2:4])}):\n  {tail}"
                )
        stamp.write_text(json.dumps(want) + "\n")
        return python


def _pip_download(cfg: ForkConfig, version: str, dest: Path) -> Path:
    """Download the sdist with pip (run from the helper venv) into `dest` (uv has no `pip download`)."""
    try:
        python = helper_python()
    except UpstreamUnavailable as exc:
        raise UpstreamUnavailable(
            f"could not download {cfg.dist}=={version} from the package registry: {exc}\n"
            "Offline? Pass a local sdist with --sdist PATH or an upstream checkout with --checkout DIR."
        ) from None
    t0 = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(_PIP_ENV, PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [
        str(python), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--pre",
        "--no-build-isolation", "--progress-bar", "off", "-d", str(dest), f"{cfg.dist}=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    found = list(dest.glob("*.tar.gz"))
    if proc.returncode != 0 and not found:
        unknown_version_error(cfg.dist, version, proc.stderr)
        tail = "\n  ".join(proc.stderr.strip().splitlines()[-6:])
        raise UpstreamUnavailable(
            f"could not download {cfg.dist}=={version} from the package registry:\n  {tail}\n"
            "Offline? Pass a local sdist with --sdist PATH or an upstream checkout with --checkout DIR."
        )
    if len(found) != 1:
        raise UpstreamUnavailable(f"pip left {len(found)} sdists in {dest}, expected one")
    # Said after the fact: a version the registry lacks is an error alone, not "downloading" and then one.
    print(f"fork: downloaded {found[0].name} from the package registry ({time.monotonic() - t0:.1f} s)", flush=True)
    return found[0]


def unknown_version_error(dist: str, version: str, pip_stderr: str) -> None:
    """pip found the project but not this version: BadInput in one line (not pip's listing of every version)."""
    m = re.search(r"\(from versions: ([^)]*)\)", pip_stderr)
    listed = [v.strip() for v in m.group(1).split(",") if v.strip() and v.strip() != "none"] if m else []
    if listed:
        raise BadInput(f"{dist} {version} is not a release on the package registry (newest: {listed[-1]})")


def download_sdist(cfg: ForkConfig, version: str, accept: Callable[[Path], None]) -> Path:
    """Download `version`'s sdist from the package registry into the cache; only a file that
    `accept` passes (it raises otherwise) enters the cache."""
    cached = cached_sdist(cfg, version)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".download-") as tmp:
        downloaded = _pip_download(cfg, version, Path(tmp))
        accept(downloaded)
        os.replace(downloaded, cached)
    return cached
