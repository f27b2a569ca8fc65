"""Fault injection for the crash tests: SIGKILL the tool before its N-th mutating file step.

The hook is a `sitecustomize` module the TEST writes into a folder it puts first on PYTHONPATH of
the tool's subprocess (the tool has no switch for it). It wraps the file operations that change
something (open for writing, os.replace/rename/unlink/remove/rmdir/mkdir, shutil.rmtree's steps,
which call those) and the start of every `git am`, counts those touching a watched folder
(FORK_FAULT_ROOTS), logs each (FORK_FAULT_LOG) and kills the process with SIGKILL right before
step FORK_FAULT_AT. FORK_FAULT_PAUSE_AT=N instead waits before step N until the file
FORK_FAULT_GO exists (two runs at once, deterministically).

Which kill points run: all with FORK_FAULTS=all (`make faults`), else a deterministic sample (the
first, the last and evenly spaced ones between), so `make test` stays fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

HOOK = r"""
import builtins, io, os, signal, subprocess, time

_ROOTS = [os.path.realpath(r) for r in os.environ.get("FORK_FAULT_ROOTS", "").split(os.pathsep) if r]
_AT = int(os.environ.get("FORK_FAULT_AT", "0") or 0)
_PAUSE = int(os.environ.get("FORK_FAULT_PAUSE_AT", "0") or 0)
_GO = os.environ.get("FORK_FAULT_GO", "")
_LOG = os.environ.get("FORK_FAULT_LOG", "")
_n = 0
_real_open = io.open
_real_getcwd = os.getcwd


def _resolve(path, dir_fd=None):
    if isinstance(path, int):
        return None
    path = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(path):
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.realpath(os.path.join(os.path.dirname(path) or ".", "")) + os.sep + os.path.basename(path)


def _step(what, path, dir_fd=None):
    global _n
    p = _resolve(path, dir_fd)
    if p is None or not any(p == r or p.startswith(r + os.sep) for r in _ROOTS):
        return
    _n += 1
    if _LOG:
        with _real_open(_LOG, "a") as f:
            f.write(f"{_n}\t{what}\t{p}\n")
    if _n == _PAUSE:
        while not os.path.exists(_GO):
            time.sleep(0.01)
    if _n == _AT:
        os.kill(os.getpid(), signal.SIGKILL)


def _wrap(name, n_paths=1):
    real = getattr(os, name)

    def wrapper(*args, **kwargs):
        for a in args[:n_paths]:
            _step(name, a, kwargs.get("dir_fd") or kwargs.get("src_dir_fd"))
        return real(*args, **kwargs)

    setattr(os, name, wrapper)


for _name in ("unlink", "remove", "rmdir", "mkdir"):
    _wrap(_name)
for _name in ("replace", "rename"):
    _wrap(_name, 2)


def _open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+"):
        _step(f"open({mode})", file)
    return _real_open(file, mode, *args, **kwargs)


io.open = builtins.open = _open

_real_popen_init = subprocess.Popen.__init__


def _popen_init(self, args, *a, **kw):
    argv = [os.fsdecode(x) for x in args] if isinstance(args, (list, tuple)) else [str(args)]
    verb = next((a for i, a in enumerate(argv[1:], 1) if not a.startswith("-") and argv[i - 1] != "-c"), None)
    if argv and os.path.basename(argv[0]) == "git" and verb == "am" and "--abort" not in argv:
        _step("git am", os.path.join(kw.get("cwd") or _real_getcwd(), ".git"))
    _real_popen_init(self, args, *a, **kw)


subprocess.Popen.__init__ = _popen_init
"""


def install_hook(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HOOK)
    return folder


@dataclass
class Faulty:
    """Runs `python -m tools.fork ARGS` in a subprocess with the hook."""

    hook: Path
    env: dict[str, str]
    roots: list[Path]

    def environ(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            **self.env,
            "PYTHONPATH": os.pathsep.join([str(self.hook), str(REPO)]),
            "PYTHONDONTWRITEBYTECODE": "1",
            "FORK_FAULT_ROOTS": os.pathsep.join(str(r) for r in self.roots),
            **extra,
        }

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tools.fork", *args]

    def run(self, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=REPO, env=self.environ(**extra), capture_output=True, text=True)

    def count(self, *args: str, log: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
        """Run without a kill, logging every watched step: (the run, its steps)."""
        log.unlink(missing_ok=True)
        proc = self.run(*args, FORK_FAULT_LOG=str(log))
        steps = log.read_text().splitlines() if log.exists() else []
        return proc, steps

    def killed_at(self, n: int, *args: str) -> subprocess.CompletedProcess:
        proc = self.run(*args, FORK_FAULT_AT=str(n))
        assert proc.returncode == -9, f"step {n} of {args} was not reached (exit {proc.returncode}):\n{proc.stderr}"
        return proc


def kill_points(n: int, sample: int = 6) -> list[int]:
    """All of 1..n with FORK_FAULTS=all; else the first, the last and up to `sample` evenly spaced between."""
    if os.environ.get("FORK_FAULTS") == "all" or n <= sample + 2:
        return list(range(1, n + 1))
    step = n / (sample + 1)
    return sorted({1, n, *(round(step * i) for i in range(1, sample + 1))})
