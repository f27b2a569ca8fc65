"""One writer at a time: an exclusive `flock` on a file or a directory.

The kernel releases a flock when its holder dies (SIGKILL, OOM killer included), so a lock is never
stale: the next run simply takes it. A second run while the holder lives is refused at once
(exit 4, EXIT_IN_PROGRESS), naming the locked path and the holder's pid.

A directory is locked through a read-only descriptor of the directory itself: nothing is created
(`deploy` locks the installed `vllm_ascend/` directory, so the lock leaves no file behind for
`pip uninstall` or the byte-for-byte revert to account for). A lock file (the repository's
`build/.fork.lock`) also holds the holder's pid, for the message; for a directory the pid comes
from /proc/locks (Linux), when readable.
"""

from __future__ import annotations

import fcntl
import os
import shlex
from contextlib import contextmanager
from pathlib import Path

from tools.fork.core.errors import InProgress


def _holder(fd: int, path: Path) -> str:
    """The pid holding the flock on `fd`'s inode, from /proc/locks; else the lock file's text."""
    st = os.fstat(fd)
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].split(":")[-1] == str(st.st_ino):
                return parts[4]
    except OSError:
        pass
    if path.is_file():
        text = path.read_text(errors="replace").strip()
        if text.isdigit():
            return text
    return "unknown"


@contextmanager
def exclusive(path: Path, what: str, *, wait: bool = False):
    """Hold an exclusive lock on `path` (a directory, or a file created if missing) for the block.

    `what` names the guarded thing in the refusal ("the installed package", "the repository").
    With `wait`, block until the holder is done instead of refusing.
    """
    is_dir = path.is_dir()
    if is_dir:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise InProgress(
                f"another run of the tool is changing {what}: {shlex.quote(str(path))} is locked by pid "
                f"{_holder(fd, path)}; wait for it to finish (a killed run releases the lock by itself)"
            ) from None
        if not is_dir:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
