"""build: the fork's wheel, named as the fork; the same wheel as `pip wheel .`."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from tools.fork.tests.conftest import GIT_ENV


def _record(wheel) -> list[str]:
    """The wheel's files with their hashes (RECORD), minus the dist-info lines that name the build."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        return sorted(line for line in z.read(name).decode().splitlines() if ".dist-info/" not in line)


def test_build_names_the_fork_and_is_idempotent(fork_with_patch):
    fork = fork_with_patch
    subprocess.run(["git", "add", "-A"], cwd=fork.root, check=True, env=GIT_ENV)
    subprocess.run(["git", "commit", "-qm", "series"], cwd=fork.root, check=True, env=GIT_ENV)
    proc = fork.run("build", "--no-build-isolation")
    assert "PYTHON-ONLY" in proc.stderr  # no Ascend toolkit here, said loudly
    wheels = list((fork.root / "dist").glob("*.whl"))
    assert len(wheels) == 1
    name = wheels[0].name
    assert name.startswith("vllm_ascend-1.0.0+fork.2.g") and name.endswith("-py3-none-any.whl"), name
    with zipfile.ZipFile(wheels[0]) as z:
        assert "vllm_ascend/ops/memmove.py" in z.namelist()  # the series is in the wheel
        assert b"memmove semantics" in z.read("vllm_ascend/ops/copy.py")
    again = fork.run("build", "--no-build-isolation")
    assert "up to date" in again.stdout

    out = fork.root / "pip-wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), "."],
        cwd=fork.root,
        check=True,
        capture_output=True,
        env={**GIT_ENV, "FORK_CACHE": str(fork.cache)},
    )
    (pip_wheel,) = out.glob("*.whl")
    assert pip_wheel.name == name
    assert _record(pip_wheel) == _record(wheels[0])


def test_build_refuses_local_edits(fork_with_patch):
    fork = fork_with_patch
    (fork.tree / "vllm_ascend/envs.py").write_text("dirty\n")
    proc = fork.run("build", "--no-build-isolation", check=False)
    assert proc.returncode == 6 and "local edits" in proc.stderr


def test_build_dist_that_is_a_file_is_refused_and_left_byte_identical(fork):
    """A mistyped --dist (an existing file) must cost nothing: exit 2, one line, the file as it was."""
    victim = fork.root / "notes.txt"
    victim.write_bytes(b"a user's notes\n\x00binary too\n")
    for where in (victim, victim / "dist"):
        proc = fork.run("build", "--no-build-isolation", "--dist", str(where), check=False)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"fork build: error: --dist {where}: "
            + ("it" if where == victim else str(victim))
            + " exists and is not a directory; nothing was written (give a new or existing directory)"
        ]
        assert victim.read_bytes() == b"a user's notes\n\x00binary too\n"
    assert not (fork.root / "build" / "fork").exists(), "refused before any work"


def test_apply_into_a_file_is_refused_and_left_byte_identical(fork):
    victim = fork.root / "tree.txt"
    victim.write_bytes(b"keep me\n")
    proc = fork.run("apply", "--into", str(victim), check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is not a directory" in proc.stderr and victim.read_bytes() == b"keep me\n"
