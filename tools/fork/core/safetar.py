"""Extract a tar archive without letting it write outside the destination, on every Python.

`tarfile`'s "data" extraction filter (`extractall(..., filter="data")`) exists only from
CPython 3.11.4 / 3.10.12 / 3.9.17; images ship older patch levels (Debian bookworm: 3.11.2),
where passing `filter=` is a TypeError. `extract_members` checks every member itself, with the
rules of the data filter that matter for an sdist, and then extracts with the data filter where
the running Python has it, or by hand where it does not:

- a name that is absolute, or that has a `..` component, is refused;
- a symlink whose target is absolute, or that resolves outside the destination, is refused;
- a hard link whose target resolves outside the destination (or is not a member before it) is
  refused;
- device files, FIFOs and any other special member are refused;
- a file or directory that would land outside the destination through a link is refused;
- modes are those of the data filter (no setuid/setgid/sticky bits, no group/other write, owner
  read/write always), and owners are never set.

A refusal raises `UnsafeArchive` naming the member; the static checks (names, link targets,
member types) run over the whole archive before anything is written.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
from collections.abc import Iterable
from pathlib import Path


class UnsafeArchive(Exception):
    """The archive has a member that would escape the destination or is not plain data."""


def has_data_filter() -> bool:
    """True when this Python's tarfile has the "data" extraction filter (3.11.4+, 3.10.12+)."""
    return hasattr(tarfile, "data_filter")


def _refuse(member: tarfile.TarInfo, why: str) -> UnsafeArchive:
    return UnsafeArchive(f"refusing to extract {member.name!r}: {why}")


def _check_name(name: str, member: tarfile.TarInfo) -> None:
    if not name:
        raise _refuse(member, "empty name")
    if "\0" in name:
        raise _refuse(member, "NUL byte in the name")
    if name.startswith(("/", os.sep)) or os.path.isabs(name):
        raise _refuse(member, "absolute path")
    if ".." in name.replace(os.sep, "/").split("/"):
        raise _refuse(member, "'..' in the path")


def check_members(members: Iterable[tarfile.TarInfo]) -> list[tarfile.TarInfo]:
    """The static checks (see the module doc), over all members before anything is written."""
    checked = []
    seen: set[str] = set()
    for m in members:
        name = m.name.rstrip("/")
        _check_name(name, m)
        if m.issym():
            link = m.linkname
            if not link or link.startswith("/") or os.path.isabs(link):
                raise _refuse(m, f"symlink to an absolute path ({link!r})")
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), link))
            if target == ".." or target.startswith("../"):
                raise _refuse(m, f"symlink leaves the tree ({link!r})")
        elif m.islnk():
            _check_name(m.linkname, m)
            if posixpath.normpath(m.linkname) not in seen:
                raise _refuse(m, f"hard link to {m.linkname!r}, which is not a file before it in the archive")
        elif not (m.isreg() or m.isdir()):
            kind = "device file" if (m.ischr() or m.isblk()) else "FIFO" if m.isfifo() else "special file"
            raise _refuse(m, f"{kind} (type {m.type!r})")
        seen.add(posixpath.normpath(name))
        checked.append(m)
    return checked


def _inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, path]) == root


def _data_mode(member: tarfile.TarInfo) -> int | None:
    """The mode the data filter gives a member (None: leave it to the umask)."""
    if member.isdir() or member.issym():
        return None
    mode = member.mode & 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


def _extract_by_hand(tar: tarfile.TarFile, dest: Path, members: list[tarfile.TarInfo]) -> None:
    root = os.path.realpath(dest)
    for m in members:
        name = m.name.rstrip("/")
        target = os.path.join(root, *name.split("/"))
        # Resolved now, through every link extracted so far: nothing may land outside the root.
        parent_real = os.path.realpath(os.path.dirname(target))
        if not _inside(root, parent_real):
            raise _refuse(m, "it would be written outside the destination (through a link)")
        target = os.path.join(parent_real, os.path.basename(target))
        if m.isdir():
            if os.path.islink(target) or (os.path.exists(target) and not os.path.isdir(target)):
                os.unlink(target)
            os.makedirs(target, exist_ok=True)
            continue
        os.makedirs(parent_real, exist_ok=True)
        if os.path.lexists(target):
            if os.path.isdir(target) and not os.path.islink(target):
                raise _refuse(m, "a directory of that name was extracted before")
            os.unlink(target)  # never write through an existing link
        if m.issym():
            if not _inside(root, os.path.realpath(os.path.join(parent_real, m.linkname))):
                raise _refuse(m, f"symlink leaves the tree ({m.linkname!r})")
            os.symlink(m.linkname, target)
            continue
        if m.islnk():
            source = os.path.realpath(os.path.join(root, *m.linkname.split("/")))
            if not _inside(root, source):
                raise _refuse(m, f"hard link leaves the tree ({m.linkname!r})")
            if not os.path.isfile(source):
                raise _refuse(m, f"hard link to {m.linkname!r}, which is not a regular file")
            shutil.copyfile(source, target)
        else:
            src = tar.extractfile(m)
            assert src is not None
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            with src, os.fdopen(os.open(target, flags, 0o600), "wb") as out:
                shutil.copyfileobj(src, out)
        mode = _data_mode(m)
        if mode is not None:
            os.chmod(target, mode)
        os.utime(target, (m.mtime, m.mtime))


def extract_members(tar: tarfile.TarFile, dest: Path, members: Iterable[tarfile.TarInfo]) -> None:
    """Extract `members` of `tar` into the directory `dest`, refusing anything unsafe (module doc)."""
    checked = check_members(members)
    if has_data_filter():
        try:
            tar.extractall(dest, members=checked, filter="data")
        except tarfile.FilterError as exc:  # only reached through links resolved at extraction time
            raise UnsafeArchive(f"refusing to extract: {exc}") from None
    else:
        _extract_by_hand(tar, dest, checked)
