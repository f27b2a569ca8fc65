"""Break the grouped Mamba state copy on purpose, one way at a time, and show that its oracle tests fail.

    cd build/fork && python ../../benchmarks/mutations.py                       # CPU, upstream's conftest
    python benchmarks/mutations.py -- -p tools.kernel_harness.plugin -p benchmarks.vllm_copy_specs \\
        --noconftest --kernel-tree build/fork build/fork/tests/ut/worker/test_mamba_copy_groups.py   # GPU box

Each mutation runs the tests in a pytest process of its own (this file is also the pytest plugin that
applies it, `-p benchmarks.mutations` with MAMBA_COPY_MUTATION set) and prints "mutation NAME: N failed";
the tests pick the device themselves (cuda where there is one). Exit 0 when the unmutated module passes and
every mutation fails at least one test.

  none                  the module as it is (must pass)
  no_interaction_check  moves whose blocks interact are grouped like the others
  no_staging            a conv state shifted inside its own block is copied without being read first
  cap_ignored           GATHER_BYTES is not applied (staging, gather buffer)
  index_not_counted     the gather buffer takes the whole cap, beside the row indices
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

MUTATIONS = ("none", "no_interaction_check", "no_staging", "cap_ignored", "index_not_counted")
ENV = "MAMBA_COPY_MUTATION"


def _mutate(mp: pytest.MonkeyPatch, name: str) -> None:
    import numpy as np

    from vllm_ascend.worker import mamba_copy_groups as groups

    if name == "no_interaction_check":
        mp.setattr(groups, "_interacting", lambda blocks: np.zeros(len(blocks), dtype=bool))
    elif name == "no_staging":
        direct = groups._direct

        def unstaged(rows, shape, unit):
            plain, staged = direct(rows, shape, unit)
            merged = groups.Ranges(*(list(a) + list(b) for a, b in zip(plain, staged)))
            return merged, groups.Ranges([], [], [], [])

        mp.setattr(groups, "_direct", unstaged)
    elif name == "cap_ignored":
        plan = groups._plan

        def uncapped(moves, copies):
            with pytest.MonkeyPatch.context() as inner:
                inner.setattr(groups, "GATHER_BYTES", 1 << 62)
                return plan(moves, copies)

        mp.setattr(groups, "_plan", uncapped)
    elif name == "index_not_counted":
        mp.setattr(groups, "INDEX_BYTES", 0)
    elif name != "none":
        raise ValueError(f"unknown mutation {name!r}: one of {', '.join(MUTATIONS)}")


@pytest.fixture(autouse=True)
def mutation():
    """Applied inside each test, so that the tests' own monkeypatches (constants) still apply on top."""
    with pytest.MonkeyPatch.context() as mp:
        _mutate(mp, os.environ.get(ENV, "none"))
        yield


def main(argv: list[str]) -> int:
    args = argv[argv.index("--") + 1 :] if "--" in argv else ["tests/ut/worker/test_mamba_copy_groups.py"]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    status = 0
    for name in MUTATIONS:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.mutations", *args]
        run = subprocess.run(cmd, env={**env, ENV: name}, capture_output=True, text=True)
        summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
        failed = int(m.group(1)) if (m := re.search(r"(\d+) failed", summary)) else 0
        passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", summary)) else 0
        print(f"mutation {name}: {failed} failed, {passed} passed", flush=True)
        if (name == "none") != (failed == 0 and passed > 0):
            status = 1
            print(run.stdout[-3000:] + run.stderr[-2000:], file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
