"""The patch series: `patches/series` and the `git format-patch` files it names."""

from __future__ import annotations

import hashlib
import re
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tools.fork.core import git
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput

# Upstream's PR template sections, in order.
BODY_SECTIONS = (
    "### What this PR does / why we need it?",
    "### Does this PR introduce _any_ user-facing change?",
    "### How was this patch tested?",
)
# `[Module][Action] Title`, optionally preceded by a branch tag such as `[v0.23.0]`.
SUBJECT_RE = re.compile(r"^(?:\[[^\[\]]+\])?\[[A-Za-z0-9][\w .+/-]*\]\[[A-Za-z][\w .+/-]*\] \S.*$")

FORMAT_PATCH = [
    "format-patch",
    "--keep-subject",  # the subject is the PR title `[Module][Action] Title`; apply with `git am --keep-non-patch`
    "--zero-commit",  # no commit hashes: they change whenever anything below changes
    "--no-signature",  # no git version line
    "--full-index",  # full blob ids: `git am -3` can always find the preimage
    "--no-renames",
    "--stat=80,60",
    "--encoding=UTF-8",
]

_HUNK_RE = re.compile(rb"^diff --git a/(\S+) |^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@", re.M)


def base_tag(version: str) -> str:
    """The tag of the base release's commit in a materialized tree."""
    return f"v{version}"


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
        proc = git.filter_bytes(["mailinfo", "-k", "-u", str(msg), str(diff)], patch)
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


def file_sections(diff: bytes) -> dict[str, bytes]:
    """Split a patch or `git diff --no-renames` output into its per-file parts: {path: bytes}.

    The path is the file's path after the change (before it, for a deletion)."""
    out: dict[str, bytes] = {}
    parts = re.split(rb"^(?=diff --git a/)", diff, flags=re.M)
    for part in parts[1:]:
        header = part.split(b"\n", 1)[0][len(b"diff --git a/") :].decode(errors="replace")
        # No renames: the header is "P b/P"; P may contain spaces, so split it in the middle.
        path = header[: (len(header) - 3) // 2] if len(header) % 2 == 1 else header.split(" b/", 1)[0]
        out[path] = part
    return out


def created_files(patch: bytes) -> list[str]:
    """Files a patch creates (`new file mode`)."""
    return [path for path, part in file_sections(patch).items() if re.search(rb"^new file mode ", part, re.M)]


def patch_id(diff: bytes) -> str:
    """`git patch-id --stable` of a patch or diff (ignores line numbers, whitespace and the message);
    empty for a patch without changes."""
    proc = git.filter_bytes(["patch-id", "--stable"], diff)
    if proc.returncode != 0:
        raise BadInput(f"git patch-id failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode().split(" ", 1)[0].strip()


def skip_reason(data: bytes) -> str | None:
    """None for a patch; for a skip marker (a per-base variant with no diff) why its base skips the
    patch: the marker's text, or "already upstream there" for an empty one."""
    if re.search(rb"^diff --git ", data, re.M):
        return None
    return " ".join(data.decode(errors="replace").split()) or "already upstream there"


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


def resolve(cfg: ForkConfig, version: str | None = None) -> list[tuple[str, Path | None]]:
    """Each name in `patches/series` with the file that applies on the base `version` (the pin
    when None), or None where the patch is not applied on that base.

    Per-base variants (`patches/bases/<version>/<name>`, written by `rebase`) replace the pin's
    patch on their base. A variant with no diff is a skip marker: the base skips the patch (empty:
    already upstream there; else its text says why, e.g. the code the patch fixes is absent). A name
    with no file under `patches/` but variants under `patches/bases/` is a patch the pin no longer
    needs (already upstream there) that older bases still carry: only bases with a variant apply it.
    """
    names = read_names(cfg)
    if len(set(names)) != len(names):
        raise BadInput(f"{cfg.series_file}: a patch is listed twice")
    variants = cfg.variants_dir(version) if version and version != cfg.pin.version else None
    out: list[tuple[str, Path | None]] = []
    for name in names:
        main = cfg.patches_dir / name
        variant = variants / name if variants is not None else None
        if variant is not None and variant.is_file():
            out.append((name, variant if skip_reason(variant.read_bytes()) is None else None))
        elif main.is_file():
            out.append((name, main))
        elif any((d / name).is_file() for d in _variant_dirs(cfg)):
            out.append((name, None))  # a variant-only patch: not needed on this base
        else:
            raise BadInput(f"{cfg.series_file} lists {name}, but {main} does not exist")
    return out


def _variant_dirs(cfg: ForkConfig) -> list[Path]:
    root = cfg.patches_dir / "bases"
    return sorted(d for d in root.iterdir() if d.is_dir()) if root.is_dir() else []


def read(cfg: ForkConfig, version: str | None = None) -> list[Patch]:
    """The series for a base: the pin's patches, with per-base variants substituted (see `resolve`)."""
    return [Patch(name, path) for name, path in resolve(cfg, version) if path is not None]


def carry_variant_only(cfg: ForkConfig, pin_names: list[str]) -> list[str]:
    """The series list for new pin patches `pin_names` (an export), keeping each name the pin does
    not apply (variant-only, see `resolve`) where it was: after the same number of pin patches."""
    out = list(pin_names)
    applied = inserted = 0
    for name, path in resolve(cfg):
        if path is not None:
            applied += 1
        elif name not in out:
            out.insert(min(applied + inserted, len(out)), name)
            inserted += 1
    return out


def number(name: str) -> str:
    """The number a patch name starts with ("0002" of "0002-Ops-...", "0001a" of "0001a-...")."""
    return name.split("-", 1)[0]


def unique_number(name: str, after: str | None, taken: set[str]) -> str:
    """`name`, or when its number is taken, renumbered after the patch `after` (the one before it in
    the series): 0001a-, 0001b-, ... so that patches/series keeps one patch per number, in order."""
    if number(name) not in taken:
        return name
    base = number(after) if after else "0000"
    slug = name.split("-", 1)[1] if "-" in name else name
    for letter in "abcdefghijklmnopqrstuvwxyz":
        if f"{base}{letter}" not in taken:
            return f"{base}{letter}-{slug}"
    raise BadInput(f"no free number for {name} after {after}")


def series_text(names: list[str]) -> str:
    return "".join(f"{n}\n" for n in names)


def render(tree: Path, version: str) -> list[tuple[str, bytes]]:
    """The series of a materialized tree as format-patch files: [(name, content)]."""
    with tempfile.TemporaryDirectory() as tmp:
        names = git.out([*FORMAT_PATCH, "-o", tmp, f"{base_tag(version)}..HEAD"], tree).splitlines()
        return [(Path(n).name, Path(n).read_bytes()) for n in names]


def hunk_positions(data: bytes) -> list[tuple[str, int, int]]:
    """(file, old start line, new start line) of each hunk of a patch or diff, in order."""
    out, current = [], ""
    for m in _HUNK_RE.finditer(data):
        if m.group(1):
            current = m.group(1).decode()
        else:
            out.append((current, int(m.group(2)), int(m.group(3))))
    return out


def convention_problems(patch: Patch) -> list[str]:
    """How a patch breaks upstream's conventions: subject, the PR body sections in order, the DCO sign-off."""
    info = patch.info
    where = f"patch {patch.name}"
    problems = []
    if not SUBJECT_RE.match(info.subject):
        problems.append(f"{where}: subject {info.subject!r} is not `[Module][Action] Title` (e.g. `[Ops][BugFix] ...`)")
    position = -1
    for section in BODY_SECTIONS:
        found = info.message.find(section)
        if found < 0:
            problems.append(f"{where}: body lacks the PR section {section!r}")
        elif found < position:
            problems.append(f"{where}: body section {section!r} is out of order")
        else:
            position = found
    sob = info.signoffs
    author = f"{info.author} <{info.email}>"
    if not sob:
        problems.append(f"{where}: no `Signed-off-by:` line (DCO); commit with `git commit -s`")
    elif author not in sob:
        problems.append(f"{where}: no `Signed-off-by: {author}` from the author (found: {', '.join(sob)})")
    return problems
