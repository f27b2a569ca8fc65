"""Idempotent virtual environments for the kernel checks, cached under build/.

    python -m tools.kernel_harness.envs ascend   # build/ascend-venv: torch CPU + triton-ascend (front end)

triton-ascend ships its own `triton` package, so it cannot share an environment
with upstream triton (the interpreter runs use the test environment,
tools/fork/testenv.py). Each venv records the requirement list it was built from
in `.kernel-harness-spec`; an unchanged list means nothing is installed again.
Prints the venv's python path on the last line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the CPU wheel this machine holds locally
SPECS = {
    # pybind11 is an undeclared runtime dependency of triton-ascend 3.2.0; its interpreter needs numpy<2.4.
    "ascend": [TORCH, "triton-ascend==3.2.0", "pybind11", "numpy<2.4"],
}
DIRS = {"ascend": "ascend-venv"}
MARKER = ".kernel-harness-spec"


def venv_python(name: str) -> Path:
    return ROOT / "build" / DIRS[name] / "bin" / "python"


def ensure(name: str, quiet: bool = False) -> Path:
    """Create (or reuse) the venv `name`; returns its python."""
    where = ROOT / "build" / DIRS[name]
    spec = SPECS[name]
    marker = where / MARKER
    python = venv_python(name)
    if python.exists() and marker.exists() and json.loads(marker.read_text()) == spec:
        return python
    if not python.exists():
        if not quiet:
            print(f"kernel_harness: creating {where}", file=sys.stderr)
        venv.EnvBuilder(with_pip=True, clear=True).create(where)
    if not quiet:
        print(f"kernel_harness: installing {' '.join(spec)} into {where}", file=sys.stderr)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *spec], check=True)
    marker.write_text(json.dumps(spec))
    return python


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(SPECS))
    args = parser.parse_args(argv)
    print(ensure(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
