"""Text edits of fork.toml (pin, support matrix, `[patches."NAME"]` entries), checked by parsing.

Not tomlkit: it keeps the comment above a table inside the previous table, so dropping the last
`[[bases]]` drops the `[patches]` comment with it (tomlkit 0.15.3).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from tools.fork.core import config
from tools.fork.core.config import Base, ForkConfig
from tools.fork.core.errors import ForkError

_HEADER_RE = re.compile(r"^\s*\[")


def _blocks(lines: list[str], header: re.Pattern) -> list[tuple[int, int]]:
    """(start, end) line ranges of the tables whose header matches; end excludes trailing blanks/comments."""
    out = []
    for i, line in enumerate(lines):
        if header.match(line):
            j = i + 1
            while j < len(lines) and not _HEADER_RE.match(lines[j]):
                j += 1
            end = j
            while end > i + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
                end -= 1
            out.append((i, end))
    return out


def _remove(lines: list[str], start: int, end: int) -> None:
    """Delete a table, then the blank line that follows it if a blank or a comment now precedes that line
    (a comment above a table belongs to it)."""
    del lines[start:end]
    before = lines[start - 1].strip() if start else ""
    if start < len(lines) and not lines[start].strip() and (not before or before.startswith("#")):
        del lines[start]


def updated_fork_toml(
    cfg: ForkConfig, onto: str, onto_sha256: str, kept: list[Base], renamed: dict[str, str], removed: list[str]
) -> str:
    """fork.toml with the pin `onto`, the new support matrix and the patch entries renamed; checked by parsing."""
    from tools.fork.core.config import tomllib

    text = cfg.toml_path.read_text()
    lines = text.splitlines()
    # [upstream]: version and sha256
    up = _blocks(lines, re.compile(r"^\s*\[upstream\]\s*(#.*)?$"))
    if len(up) != 1:
        raise ForkError("fork.toml: cannot find one [upstream] table to update")
    for i in range(*up[0]):
        lines[i] = re.sub(r'^(\s*version\s*=\s*)"[^"]*"', rf'\g<1>"{onto}"', lines[i])
        lines[i] = re.sub(r'^(\s*sha256\s*=\s*)"[^"]*"', rf'\g<1>"{onto_sha256}"', lines[i])
    # [[bases]]: the bases kept, plus the new pin
    wanted = [b.version for b in cfg.bases if b in kept or b.version == onto]
    if onto not in wanted:
        wanted.append(onto)
    explicit = [str(b.get("version")) for b in tomllib.loads(text).get("bases", [])]
    bases_re = re.compile(r"^\s*\[\[bases\]\]\s*(#.*)?$")
    for (start, end), version in reversed(list(zip(_blocks(lines, bases_re), explicit))):
        if version not in wanted:
            _remove(lines, start, end)
    sha = {b.version: b.sha256 for b in cfg.bases} | {onto: onto_sha256}
    new_blocks = [
        ["", "[[bases]]", f'version = "{v}"', f'sha256 = "{sha[v]}"'] for v in wanted if v not in explicit
    ]  # fmt: skip
    if new_blocks:
        blocks = _blocks(lines, bases_re)
        at = blocks[-1][1] if blocks else len(lines)
        for block in reversed(new_blocks):
            lines[at:at] = block
    # [patches."NAME"]: follow renames, drop entries of patches that left the series
    for name in removed:
        entry = re.compile(r'^\s*\[patches\."' + re.escape(name) + r'"\]\s*(#.*)?$')
        for start, end in reversed(_blocks(lines, entry)):
            _remove(lines, start, end)
    new_text = rename_toml_entries("\n".join(lines) + "\n", renamed)
    _check_toml(new_text, onto, onto_sha256, wanted, {renamed.get(n, n) for n in cfg.fork_only if n not in removed})
    return new_text


def _check_toml(text: str, onto: str, onto_sha256: str, wanted: list[str], fork_only: set[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "fork.toml").write_text(text)
        try:
            new = config.load(Path(tmp))
        except ForkError as exc:
            raise ForkError(f"could not update fork.toml automatically ({exc}); nothing was written") from None
    problems = []
    if (new.pin.version, new.pin.sha256) != (onto, onto_sha256):
        problems.append(f"pin is {new.pin.version}")
    if sorted(b.version for b in new.bases) != sorted(wanted):
        problems.append(f"bases are {[b.version for b in new.bases]}, expected {wanted}")
    if set(new.fork_only) != fork_only:
        problems.append(f"fork-only patches are {sorted(new.fork_only)}, expected {sorted(fork_only)}")
    if problems:
        raise ForkError("could not update fork.toml automatically (" + "; ".join(problems) + "); nothing was written")


def rename_toml_entries(text: str, mapping: dict[str, str]) -> str:
    """Rename `[patches."OLD"]` tables to `[patches."NEW"]` in one pass (chains stay correct)."""
    if not mapping:
        return text
    pattern = re.compile(r'^(\[patches\.")([^"]+)("\][ \t]*(?:#.*)?)$', re.M)
    return pattern.sub(lambda m: m.group(1) + mapping.get(m.group(2), m.group(2)) + m.group(3), text)
