"""The patch series: `patches/series` and the `git format-patch` files it names."""

from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tools.fork import git
from tools.fork.config import ForkConfig
from tools.fork.errors import BadInput

# Upstream's PR template sections, in order.
BODY_SECTIONS = (
    "### What this PR does / why we need it?",
    "### Does this PR introduce _any_ user-facing change?",
    "### How was this patch tested?",
)
# `[Module][Action] Title`, optionally preceded by a branch tag such as `[v0.23.0]`.
SUBJECT_RE = re.compile(r"^(?:\[[^\[\]]+\])?\[[A-Za-z0-9][\w .+/-]*\]\[[A-Za-z][\w .+/-]*\] \S.*$")


@dataclass(frozen=True)
class MailInfo:
    author: str
    email: str
    date: str
    subject: str
    message: str  # the commit message body (after the subject)

    @property
    def signoffs(self) -> list[str]:
        return re.findall(r"^Signed-off-by: (.+)$", self.message, flags=re.M)


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path

    @cached_property
    def data(self) -> bytes:
        return self.path.read_bytes()

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @cached_property
    def info(self) -> MailInfo:
        return mailinfo(self.data)


def mailinfo(patch: bytes) -> MailInfo:
    """Split a format-patch mail with `git mailinfo` (subject kept as written)."""
    with tempfile.TemporaryDirectory() as tmp:
        msg, diff = Path(tmp, "msg"), Path(tmp, "patch")
        proc = subprocess.run(
            ["git", "mailinfo", "-k", "-u", str(msg), str(diff)],
            input=patch,
            capture_output=True,
            env=git.git_env(),
        )
        if proc.returncode != 0:
            raise BadInput(f"not a patch mail: {proc.stderr.decode(errors='replace').strip()}")
        headers = dict(line.split(": ", 1) for line in proc.stdout.decode().splitlines() if ": " in line)
        return MailInfo(
            author=headers.get("Author", ""),
            email=headers.get("Email", ""),
            date=headers.get("Date", ""),
            subject=headers.get("Subject", ""),
            message=msg.read_text(),
        )


def read_names(cfg: ForkConfig) -> list[str]:
    """Patch names from `patches/series` (quilt format: one name a line, `#` comments)."""
    if not cfg.series_file.exists():
        return []
    names = []
    for raw in cfg.series_file.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.append(line.split()[0])
    return names


def read(cfg: ForkConfig, version: str | None = None) -> list[Patch]:
    """The series for a base: the pin's patches, with per-base variants substituted."""
    names = read_names(cfg)
    if len(set(names)) != len(names):
        raise BadInput(f"{cfg.series_file}: a patch is listed twice")
    variants = cfg.variants_dir(version) if version and version != cfg.pin.version else None
    patches = []
    for name in names:
        path = cfg.patches_dir / name
        if variants is not None and (variants / name).exists():
            path = variants / name
        if not path.is_file():
            raise BadInput(f"{cfg.series_file} lists {name}, but {path} does not exist")
        patches.append(Patch(name, path))
    return patches


def series_text(names: list[str]) -> str:
    return "".join(f"{n}\n" for n in names)
