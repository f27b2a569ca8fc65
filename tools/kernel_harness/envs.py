"""The kernel checks' triton-ascend venv under build/, made by the fork's one venv builder (tools/fork/testing/).

    python -m tools.kernel_harness.envs ascend   # build/ascend-venv: torch CPU + triton-ascend (front end)

triton-ascend ships its own `triton` package, so it cannot share an environment
with upstream triton (the interpreter runs use the test environment,
tools/fork/testing/testenv.py). Each venv records the requirement list it was built from
in `.kernel-harness-spec`; an unchanged list means nothing is installed again.
Prints the venv's python path on the last line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.fork.testing import venvs
from tools.fork.testing.base_recipe import TORCH  # the local CPU wheel where uv finds one, else the registry's

ROOT = Path(__file__).resolve().parents[2]
SPECS = {
    # pybind11 is an undeclared runtime dependency of triton-ascend 3.2.0; its interpreter needs numpy<2.4.
    "ascend": [TORCH, "triton-ascend==3.2.0", "pybind11", "numpy<2.4"],
}
# The registry's torch (a CUDA build, where uv finds no local CPU wheel) requires upstream `triton`,
# whose files land over triton-ascend's own `triton` package (both install `triton/`): the front end
# would then be upstream's (seen: "triton-ascend 3.7.1", ASTSource() refusing `constants`). Upstream
# triton goes, and triton-ascend's files are laid again; with the CPU torch both steps change nothing.
THEN = {
    "ascend": (
        ("uninstall", "triton"),
        ("install", "-q", "--no-deps", "--force-reinstall", "triton-ascend==3.2.0"),
    ),
}
DIRS = {"ascend": "ascend-venv"}
MARKER = ".kernel-harness-spec"


def venv_python(name: str) -> Path:
    return ROOT / "build" / DIRS[name] / "bin" / "python"


def _say(msg: str) -> None:
    print(f"kernel_harness: {msg}", file=sys.stderr, flush=True)


def ensure(name: str, quiet: bool = False) -> Path:
    """Create (or reuse) the venv `name`; returns its python."""
    say = (lambda msg: None) if quiet else _say
    return venvs.ensure_spec(ROOT / "build" / DIRS[name], SPECS[name], MARKER, say=say, then=THEN.get(name, ()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(SPECS))
    args = parser.parse_args(argv)
    print(ensure(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
