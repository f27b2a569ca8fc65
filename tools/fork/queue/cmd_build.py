"""Build the forked vllm-ascend wheel into dist/ (the same wheel `pip wheel .` builds).

Its version says it is the fork: <base>+fork.<commits>.g<hash>. Without the Ascend toolkit
the wheel is Python-only (COMPILE_CUSTOM_KERNELS=0), and this is said loudly.
A wheel already in dist/ for the same version and series is kept (nothing to do).
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

from tools.fork.core import git, series
from tools.fork.core.errors import ForkError
from tools.fork.core.outputs import output_dir
from tools.fork.queue import wheel

HELP = __doc__


def add_arguments(p) -> None:
    p.add_argument("--dist", type=Path, metavar="DIR", help="output directory (default: dist/)")
    p.add_argument(
        "--no-build-isolation",
        action="store_true",
        help="build with this Python's setuptools/setuptools-scm/wheel (offline); the default, like "
        "`pip wheel .`, installs the build requirements in an isolated environment",
    )


def _stamp(cfg, tree: Path, env: dict) -> str:
    """What the wheel depends on: the materialized commit and the build switches."""
    parts = [git.out(["rev-parse", "HEAD"], tree), env["SETUPTOOLS_SCM_PRETEND_VERSION"]]
    parts += [f"{k}={env.get(k, '')}" for k in ("COMPILE_CUSTOM_KERNELS", "SOC_VERSION")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def run(args, cfg) -> int:
    if importlib.util.find_spec("setuptools_scm") is None:  # the wheel's version; say so before any work
        raise ModuleNotFoundError("build needs setuptools-scm", name="setuptools_scm")
    dist = (output_dir(args.dist, "--dist") if args.dist else cfg.root / "dist").resolve()
    tree = wheel.materialized_pin(cfg)
    env, notes = wheel.build_environment(cfg)
    wheel.announce(notes)
    version = env["SETUPTOOLS_SCM_PRETEND_VERSION"]
    stamp = _stamp(cfg, tree, env)
    stamp_file = dist / f".{version}.stamp"
    existing = sorted(dist.glob(f"vllm_ascend-{version.replace('-', '_')}-*.whl"))
    if existing and stamp_file.exists() and stamp_file.read_text() == stamp:
        print(f"fork build: {existing[-1]}: up to date")
        return 0
    isolation = []
    if args.no_build_isolation:
        missing = [m for m in ("setuptools", "setuptools_scm", "wheel") if importlib.util.find_spec(m) is None]
        if missing:
            raise ForkError(f"--no-build-isolation needs {', '.join(missing)} in this Python")
        isolation = ["--no-build-isolation"]
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(dist), str(cfg.root)]
    print(f"fork build: {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.run(cmd)
    built = sorted(dist.glob(f"vllm_ascend-{version.replace('-', '_')}-*.whl"))
    if proc.returncode != 0 or not built:
        raise ForkError(f"building the wheel failed (pip exit {proc.returncode})")
    stamp_file.write_text(stamp)
    kind = "Python-only" if env.get("COMPILE_CUSTOM_KERNELS") == "0" else "with custom kernels"
    print(f"fork build: {built[-1]} ({kind}; vllm-ascend {cfg.pin.version} + {len(series.read_names(cfg))} patch(es))")
    return 0
