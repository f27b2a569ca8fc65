"""What the fork's wheel is built from and how, for both `build` and the PEP 517 backend.

Shared, so `python -m tools.fork build` and `pip wheel .` produce the same wheel."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tools.fork.core import config, series, upstream
from tools.fork.core.materialize import materialize

DEFAULT_SOC_VERSION = "ascend910b1"  # A2; only used when neither SOC_VERSION nor a toolkit says otherwise
_TOOLKIT_DEFAULT = Path("/usr/local/Ascend/ascend-toolkit/latest")


def ascend_toolkit() -> Path | None:
    home = os.environ.get("ASCEND_HOME_PATH")
    if home and Path(home).is_dir():
        return Path(home)
    return _TOOLKIT_DEFAULT if _TOOLKIT_DEFAULT.is_dir() else None


def fork_version(cfg: config.ForkConfig) -> str:
    """`<base>+fork.<commits>.g<hash>[.d<date>]`, from this repository's git state (setuptools-scm)."""
    from setuptools_scm import get_version

    def local(version) -> str:
        node = version.node or "gunknown"
        if not node.startswith("g"):
            node = "g" + node
        local = f"+fork.{version.distance}.{node[:8]}"
        if version.dirty:
            local += version.time.strftime(".d%Y%m%d")
        return local

    try:
        return get_version(root=str(cfg.root), version_scheme=lambda _v: cfg.pin.version, local_scheme=local)
    except LookupError:  # not a git checkout of the fork
        return f"{cfg.pin.version}+fork"


def build_environment(cfg: config.ForkConfig) -> tuple[dict[str, str], list[str]]:
    """Environment for upstream's setup.py, and notes for the user about it."""
    env = dict(os.environ)
    notes = []
    env["SETUPTOOLS_SCM_PRETEND_VERSION"] = fork_version(cfg)
    if ascend_toolkit() is None:
        env["COMPILE_CUSTOM_KERNELS"] = "0"
        env.setdefault("SOC_VERSION", DEFAULT_SOC_VERSION)
        notes.append(
            "NO ASCEND TOOLKIT FOUND (ASCEND_HOME_PATH unset, /usr/local/Ascend/ascend-toolkit/latest absent): "
            "building a PYTHON-ONLY wheel (COMPILE_CUSTOM_KERNELS=0) without the vllm_ascend_C custom kernels "
            f"(SOC_VERSION={env['SOC_VERSION']}). Build on an Ascend build host for a complete wheel, or patch an "
            "existing installation with `python -m tools.fork deploy`."
        )
    return env, notes


def materialized_pin(cfg: config.ForkConfig) -> Path:
    """The pinned base plus the series in build/fork (made or reused; never discards edits)."""
    tree = cfg.default_fork_dir().resolve()
    materialize(tree, lambda: upstream.obtain(cfg).source, cfg.pin.version, series.read(cfg))
    return tree


def announce(notes: list[str]) -> None:
    for note in notes:
        bar = "!" * 78
        print(f"{bar}\n{note}\n{bar}", file=sys.stderr, flush=True)
