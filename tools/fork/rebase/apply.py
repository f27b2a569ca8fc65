"""Applying one patch onto the new release (or another version of it) and classifying the outcome."""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tools.fork.core import git, materialize, series
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import EXIT_CONFLICT, ForkError
from tools.fork.core.materialize import ApplyFailed
from tools.fork.core.series import base_tag, hunk_positions
from tools.fork.rebase.state import (
    ALREADY_UPSTREAM,
    APPLIED_3WAY,
    APPLIED_CLEANLY,
    PARTIALLY_UPSTREAM,
    RESOLVED,
    RESOLVED_EMPTY,
    Item,
    Result,
    State,
    workdir,
)


@dataclass
class Conflict:
    item: Item
    files: list[str]  # one line per file: path, what happened, hunks
    detail: str = ""


def apply_one(tree: Path, work: Path, item: Item, st: State) -> Result | Conflict:
    patch = series.Patch(item.name, work / item.file)
    before = git.out(["rev-parse", "HEAD"], tree)
    origin = [f"{item.origin.split('/')[2]} variant"] if item.origin.startswith("patches/bases/") else []
    try:
        materialize.am(tree, patch)
        return Result(item.name, APPLIED_CLEANLY, origin + _offsets(tree, before, patch), applied=True)
    except ApplyFailed:
        materialize.abort_am(tree)
    try:
        materialize.am(tree, patch, three_way=True)
    except ApplyFailed as exc:
        return _conflict(tree, item, st, exc.detail)
    if git.out(["rev-parse", "HEAD"], tree) == before:
        return Result(item.name, ALREADY_UPSTREAM, origin + [_already_upstream_evidence(tree, st, patch)])
    return _merged(tree, st, patch, before, origin)


def _diff(tree: Path, a: str, b: str, paths: list[str] | None = None) -> bytes:
    args = ["diff", "--full-index", "--no-renames", "--no-color", a, b]
    if paths is not None:
        args += ["--", *paths]
    return git.run(args, tree, binary=True).stdout


def _offsets(tree: Path, before: str, patch: series.Patch) -> list[str]:
    mine = hunk_positions(patch.data)
    applied = hunk_positions(_diff(tree, before, "HEAD"))
    moved: dict[str, set[int]] = {}
    for (f, old, _), (f2, old2, _) in zip(mine, applied):
        if f == f2 and old != old2:
            moved.setdefault(f, set()).add(old2 - old)
    return [f"offset {f} {', '.join(f'{d:+d}' for d in sorted(ds))} lines" for f, ds in moved.items()]


def _changed_lines(section: bytes) -> Counter:
    body = section.split(b"\n@@", 1)[1] if b"\n@@" in section else b""
    return Counter(line for line in body.splitlines() if line[:1] in (b"+", b"-"))


def _upstream_renames(tree: Path, st: State) -> dict[str, str]:
    out = git.out(
        ["diff", "--find-renames", "--name-status", "--no-color", base_tag(st.old_pin), base_tag(st.onto)], tree
    )
    renames = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if parts[0].startswith("R") and len(parts) == 3:
            renames[parts[1]] = parts[2]
    return renames


def _same_as_upstream(tree: Path, st: State, section: bytes, path: str) -> str:
    """' (same patch-id as upstream's diff A..B of PATH)' when upstream made exactly this change."""
    up = _diff(tree, base_tag(st.old_pin), base_tag(st.onto), [path])
    if up and series.patch_id(up) == series.patch_id(section):
        return f"; upstream's own diff {st.old_pin}..{st.onto} of it has the same patch-id {series.patch_id(up)[:12]}"
    return ""


def _already_upstream_evidence(tree: Path, st: State, patch: series.Patch) -> str:
    files = list(series.file_sections(patch.data))
    up = _diff(tree, base_tag(st.old_pin), base_tag(st.onto), files)
    pid = series.patch_id(patch.data)
    if up and series.patch_id(up) == pid:
        return f"upstream's own diff {st.old_pin}..{st.onto} over {', '.join(files)} has the same patch-id {pid[:12]}"
    return f"applying it changes nothing: {st.onto} already has every change to {', '.join(files)}"


def _merged(tree: Path, st: State, patch: series.Patch, before: str, origin: list[str]) -> Result:
    mine = series.file_sections(patch.data)
    got = series.file_sections(_diff(tree, before, "HEAD"))
    renames = _upstream_renames(tree, st) if set(mine) - set(got) else {}
    evidence, partial = list(origin), False
    for path, section in mine.items():
        target = path
        if path not in got and renames.get(path) in got:
            target = renames[path]
            evidence.append(f"followed upstream's rename {path} -> {target}")
        if target not in got:
            partial = True
            evidence.append(f"{path}: change already in {st.onto}{_same_as_upstream(tree, st, section, path)}")
        else:
            have, want = _changed_lines(got[target]), _changed_lines(section)
            if have != want and have <= want:
                partial = True
                evidence.append(f"{path}: part of the change already in {st.onto}")
    outcome = PARTIALLY_UPSTREAM if partial else APPLIED_3WAY
    return Result(patch.name, outcome, evidence, applied=True)


_STATUS = {
    "UU": "both modified",
    "AA": "added by both (upstream added it too)",
    "DU": "deleted upstream, modified by the patch (modify/delete)",
    "UD": "deleted by the patch, modified upstream (modify/delete)",
    "AU": "added by the patch, conflicting with upstream",
    "UA": "added upstream, conflicting with the patch",
    "DD": "deleted by both",
}


def _conflict(tree: Path, item: Item, st: State, detail: str) -> Conflict:
    status = {}
    for line in git.run(["status", "--porcelain", "--untracked-files=no"], tree).stdout.splitlines():
        status[line[3:]] = line[:2]
    unmerged = git.out(["diff", "--name-only", "--diff-filter=U"], tree).splitlines()
    renames = _upstream_renames(tree, st)
    renamed_from = {new: old for old, new in renames.items()}
    new_files = git.out(["ls-tree", "-r", "--name-only", base_tag(st.onto)], tree).splitlines()
    present = set(new_files)
    lines = []
    for path in unmerged:
        what = _STATUS.get(status.get(path, ""), "conflict")
        if path in renames:
            what += f"; renamed upstream to {renames[path]} (the merge did not follow it)"
        elif path in renamed_from:
            what += f"; renamed upstream from {renamed_from[path]}"
        elif status.get(path) == "DU" and path not in present:
            what += f"; not in {st.onto}"
        hunks = _marker_ranges(tree / path)
        if hunks:
            what += "; conflict markers at lines " + ", ".join(hunks)
        lines.append(f"{path}: {what}")
    if not unmerged:
        # `git am -3` failed without leaving a merge: name the patch's files that moved or went away.
        current = tree / ".git" / "rebase-apply" / "patch"
        for path in series.file_sections(current.read_bytes() if current.exists() else b""):
            if path in renames:
                lines.append(f"{path}: renamed upstream to {renames[path]}")
            elif path not in present:
                lines.append(f"{path}: not in {st.onto} (deleted upstream, or never there)")
    return Conflict(item, lines, detail)


def _marker_ranges(path: Path) -> list[str]:
    try:
        text = path.read_bytes().splitlines()
    except OSError:
        return []
    out, start = [], None
    for i, line in enumerate(text, 1):
        if line.startswith(b"<<<<<<< "):
            start = i
        elif line.startswith(b">>>>>>> ") and start is not None:
            out.append(f"{start}-{i}")
            start = None
    return out


def resolve_current(tree: Path, st: State) -> Result:
    """The user's resolution of the stopped patch: a commit, or nothing (dropped)."""
    item = st.items[st.index]
    unmerged = git.out(["diff", "--name-only", "--diff-filter=U"], tree).splitlines()
    if unmerged:
        raise ForkError(
            f"{item.name} is still unresolved in {', '.join(unmerged)}: edit, `git add` (or `git rm`), then "
            "`rebase --continue`",
            EXIT_CONFLICT,
        )
    if git.am_in_progress(tree):
        unstaged = git.out(["diff", "--name-only"], tree).splitlines()
        if unstaged:
            raise ForkError(
                f"changes in {', '.join(unstaged)} are not staged: `git add` them (or `git checkout -- FILE` to drop "
                "them), then `rebase --continue`",
                EXIT_CONFLICT,
            )
        markers = [
            line for line in git.run(["diff", "--cached", "--check", "HEAD"], tree, check=False).stdout.splitlines()
            if "leftover conflict marker" in line
        ]  # fmt: skip
        if markers:
            raise ForkError(
                "conflict markers are still staged: " + "; ".join(markers[:5]) + "; fix them, `git add`, then continue",
                EXIT_CONFLICT,
            )
        staged = git.run(["diff", "--cached", "--quiet", "HEAD"], tree, check=False).returncode != 0
        if not staged:
            git.run(["am", "--skip"], tree)
            return Result(item.name, RESOLVED_EMPTY, ["the resolution left no change"])
        files = git.out(["diff", "--cached", "--name-only", "HEAD"], tree).splitlines()
        by_hand = [f for f in files if f in st.conflict_files] or st.conflict_files or files
        git.run(["am", "--continue"], tree)
        return Result(item.name, RESOLVED, [f"by hand: {', '.join(by_hand)}"], applied=True)
    n = int(git.out(["rev-list", "--count", f"{st.head}..HEAD"], tree) or 0)
    if n == 0:
        return Result(item.name, RESOLVED_EMPTY, ["the git am session was ended without a commit"])
    if n == 1:
        return Result(item.name, RESOLVED, ["committed by hand"], applied=True)
    raise ForkError(
        f"{tree}: {n} commits were made for {item.name}; one patch is one commit: squash them "
        f"(`git reset --soft {st.head[:12]}` then `git commit -C ORIG_HEAD`), then continue",
        EXIT_CONFLICT,
    )


def other_version_applies(cfg: ForkConfig, work: Path, tree: Path, st: State, conflict: Conflict):
    """A patch that conflicts may have another version that applies as it is (a per-base variant
    written for a release like this one): take the first that `git am` applies without a merge; the
    tests then judge it. None applies: the conflict of the version tried first is left to resolve."""
    item = conflict.item
    files = ", ".join(line.split(":", 1)[0] for line in conflict.files) or "?"
    for alt in alternatives(cfg, st, item.name):
        rewind(tree, st.head)
        rel = alt.relative_to(cfg.root).as_posix()
        st.tried.setdefault(item.name, []).append(item.origin)
        st.tried[item.name].append(rel)
        try:
            materialize.am(tree, series.Patch(item.name, alt))
        except ApplyFailed:
            continue
        copy = f"queue/{item.name}.{len(st.tried[item.name])}"
        shutil.copyfile(alt, work / copy)
        st.items[st.index] = Item(item.name, copy, rel)
        st.chosen[item.name] = f"{item.origin} conflicts in {files}"
        print(f"  [{st.index + 1}/{len(st.items)}] {item.name}: {item.origin} conflicts in {files}; "
              f"{rel} applies", flush=True)  # fmt: skip
        origin = [f"{rel.split('/')[2]} variant"] if rel.startswith("patches/bases/") else []
        return Result(item.name, APPLIED_CLEANLY, origin, applied=True)
    if st.tried.get(item.name):
        rewind(tree, st.head)
        return apply_one(tree, work, item, st)
    return conflict


def rewind(tree: Path, rev: str) -> None:
    """Back to commit `rev` in the rebase tree: no `git am` session, no changes left."""
    materialize.abort_am(tree)
    git.run(["reset", "-q", "--hard", rev], tree)
    git.run(["clean", "-q", "-fd"], tree)


def alternatives(cfg: ForkConfig, st: State, name: str) -> list[Path]:
    """Other versions of patch `name` the repository has (the pin's and every base's variant),
    not yet tried, by content."""
    item = next(i for i in st.items if i.name == name)
    used = (workdir(cfg) / item.file).read_bytes() if item.file else b""
    seen = {series.patch_id(used)} if used.strip() else set()
    tried = set(st.tried.get(name, []))
    out = []
    # patches/alternatives/NAME: a version kept for releases outside the matrix (docs/rebase.md).
    kept = [*sorted(cfg.patches_dir.glob(f"bases/*/{name}")), *sorted(cfg.patches_dir.glob(f"alternatives/{name}"))]
    for path in [cfg.patches_dir / name, *kept]:
        rel = path.relative_to(cfg.root).as_posix()
        if not path.is_file() or series.skip_reason(path.read_bytes()) is not None or rel in tried:
            continue
        pid = series.patch_id(path.read_bytes())
        if pid in seen:
            continue
        seen.add(pid)
        out.append(path)
    return out
