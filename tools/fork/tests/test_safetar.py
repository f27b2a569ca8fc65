"""Extracting an sdist on every Python refuses crafted archives that would write outside the tree.

It uses tarfile's "data" filter where it exists (3.11.4+, 3.10.12+) and checks by hand where it
does not (Debian bookworm's 3.11.2 is simulated here)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from tools.fork.core import safetar, upstream
from tools.fork.core.errors import UpstreamUnavailable
from tools.fork.tests.conftest import UPSTREAM_FILES, make_sdist

TOP = "vllm_ascend-1.0"


@pytest.fixture(params=["no-data-filter", "data-filter"])
def python(request, monkeypatch):
    """'no-data-filter': a Python like 3.11.2, whose tarfile has no data_filter and whose
    extractall() has no `filter` parameter (passing it is a TypeError there)."""
    if request.param == "no-data-filter":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
        original = tarfile.TarFile.extractall

        def old_extractall(self, path=".", members=None, *, numeric_owner=False, **kwargs):
            if "filter" in kwargs:
                raise TypeError("TarFile.extractall() got an unexpected keyword argument 'filter'")
            return original(self, path, members, numeric_owner=numeric_owner)

        monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
        assert not safetar.has_data_filter()
    elif not safetar.has_data_filter():
        pytest.skip("this Python's tarfile has no data_filter")
    return request.param


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.mtime = 1_000_000_000
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    path.write_bytes(buf.getvalue())
    return path


def _file(name: str, data: bytes = b"x\n", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, 0o644
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, None


def _tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = p.read_text()
    return out


def test_sdist_extracts_on_a_python_without_data_filter(tmp_path, python):
    sdist = make_sdist(tmp_path, "1.0", UPSTREAM_FILES)
    dest = tmp_path / "dest"
    dest.mkdir()
    upstream.extract(upstream.Source("1.0", sdist=sdist), dest)
    assert _tree(dest) == {rel: text for rel, text in UPSTREAM_FILES.items()}


def test_links_and_modes_inside_the_tree(tmp_path, python):
    link = tarfile.TarInfo(f"{TOP}/pkg/alias.py")
    link.type, link.linkname = tarfile.SYMTYPE, "mod.py"
    hard = tarfile.TarInfo(f"{TOP}/pkg/copy.py")
    hard.type, hard.linkname, hard.mode = tarfile.LNKTYPE, f"{TOP}/pkg/mod.py", 0o4777
    sdist = _tar(
        tmp_path / "ok.tar.gz",
        [
            _file(f"{TOP}/PKG-INFO", b"Version: 1.0\n"),
            _file(f"{TOP}/pkg/mod.py", b"print(1)\n", mode=0o4777),  # setuid, world-writable
            _file(f"{TOP}/run.sh", b"#!/bin/sh\n", mode=0o755),
            (link, None),
            (hard, None),
        ],
    )
    dest = tmp_path / "dest"
    dest.mkdir()
    upstream.extract(upstream.Source("1.0", sdist=sdist), dest)
    assert _tree(dest) == {
        "pkg/alias.py": "-> mod.py",
        "pkg/copy.py": "print(1)\n",
        "pkg/mod.py": "print(1)\n",
        "run.sh": "#!/bin/sh\n",
    }  # PKG-INFO is an sdist artifact, dropped
    assert stat.S_IMODE((dest / "pkg/mod.py").stat().st_mode) == 0o755  # no setuid, no group/other write
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o755
    assert (dest / "run.sh").stat().st_mtime == 1_000_000_000


def _symlink(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    return _special(name, tarfile.SYMTYPE, target)


ESCAPES = {
    "absolute path": [_file(f"{TOP}//etc/escaped")],
    "'..' in the path": [_file(f"{TOP}/../escaped")],
    "'..' deeper in the path": [_file(f"{TOP}/pkg/../../escaped")],
    "symlink leaves the tree": [_symlink(f"{TOP}/pkg/link", "../../escaped")],
    "symlink to an absolute path": [_symlink(f"{TOP}/link", "/etc")],
    # Only resolving links at extraction time catches this one: "here" is the tree itself.
    "symlink leaves the tree through a symlink": [
        _symlink(f"{TOP}/here", "."),
        _symlink(f"{TOP}/out", "here/../escaped"),
    ],
    "hard link leaves the tree": [_special(f"{TOP}/hard", tarfile.LNKTYPE, f"{TOP}/../escaped")],
    "hard link to an absolute path": [_special(f"{TOP}/hard", tarfile.LNKTYPE, "/etc/passwd")],
    "character device": [_special(f"{TOP}/null", tarfile.CHRTYPE)],
    "block device": [_special(f"{TOP}/disk", tarfile.BLKTYPE)],
    "FIFO": [_special(f"{TOP}/pipe", tarfile.FIFOTYPE)],
}


@pytest.mark.parametrize("kind", list(ESCAPES))
def test_refuses_an_archive_that_escapes_the_tree(tmp_path, python, kind):
    (tmp_path / "escaped").write_text("outside, before\n")  # what a link out would reach
    sdist = _tar(tmp_path / "bad.tar.gz", [_file(f"{TOP}/PKG-INFO", b"Version: 1.0\n"), *ESCAPES[kind]])
    dest = tmp_path / "deep" / "dest"
    dest.mkdir(parents=True)
    before = sorted(p for p in tmp_path.rglob("*") if dest not in p.parents)

    with pytest.raises(UpstreamUnavailable, match="refusing to extract") as err:
        upstream.extract(upstream.Source("1.0", sdist=sdist), dest)

    assert str(sdist) in str(err.value)
    assert sorted(p for p in tmp_path.rglob("*") if dest not in p.parents) == before
    assert (tmp_path / "escaped").read_text() == "outside, before\n"
    assert not list((tmp_path / "deep").glob("escaped*"))
    if kind != "symlink leaves the tree through a symlink":  # caught before anything is written
        assert list(dest.iterdir()) == []


def test_the_manual_path_also_refuses_links_resolved_at_extraction_time(tmp_path, monkeypatch):
    """The static checks pass this archive; the by-hand extraction must still stop at the link."""
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    members = [_symlink("here", "."), _symlink("out", "here/../escaped")]
    assert len(safetar.check_members(m for m, _ in members)) == 2
    archive = _tar(tmp_path / "chain.tar.gz", members)
    dest = tmp_path / "dest"
    dest.mkdir()
    with tarfile.open(archive) as tar, pytest.raises(safetar.UnsafeArchive, match="'out'.*leaves the tree"):
        safetar.extract_members(tar, dest, tar.getmembers())
    assert not (dest / "out").exists() and not (dest / "out").is_symlink()
