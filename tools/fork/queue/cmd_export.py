"""Write `patches/`, `patches/series` and the overlay from a materialized tree.

Edit the fork in either place, then export:
  - hunks in upstream files: commit in the materialized tree (`git commit --fixup=<patch>`,
    `git rebase -i --autosquash v<base>`), or add a new commit for a new patch;
  - files the fork adds: edit the overlay copy in this repository (vllm_ascend/..., tests/...)
    or edit them in the tree and commit.
Overlay edits are folded into the commit that creates the file before exporting. The output is
deterministic: exporting an unchanged series reproduces `patches/` byte for byte. A kill leaves
each file as before or as after; the next export finishes the write first (docs/rebase.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

from tools.fork.core import git, journal, overlay, series, txn
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput, LocalEdits
from tools.fork.core.forktoml import rename_toml_entries
from tools.fork.core.materialize import PARTIAL_SUFFIX, State, require_tree
from tools.fork.core.series import base_tag, convention_problems, render

HELP = __doc__

WORK, FOLD = journal.EXPORT_WORK, journal.EXPORT_FOLD


def add_arguments(p) -> None:
    p.add_argument("--from", dest="tree", type=Path, metavar="DIR", help="materialized tree (default: build/fork)")
    p.add_argument(
        "--upstream", type=Path, metavar="DIR", help="write only the upstreamable patches, as a series, to DIR"
    )


def _require_exportable(tree: Path) -> None:
    if git.am_in_progress(tree):
        raise LocalEdits(f"{tree}: a `git am` session is in progress; finish or abort it first")
    if (tree / ".git" / "rebase-merge").exists():
        raise LocalEdits(f"{tree}: a `git rebase` is in progress; finish or abort it first")
    dirty = git.dirty_summary(tree)
    if dirty:
        raise LocalEdits(
            f"{tree} has uncommitted changes ({dirty}); commit them into the patch "
            "they belong to (`git commit --fixup=<commit>`), or stash them, then export"
        )


def fold_overlay_edits(cfg: ForkConfig, tree: Path, version: str) -> list[str]:
    """Move edits made to overlay files in the repository into the last commit that touched each file."""
    state = State.load(tree)
    own = overlay.ownership(tree, version)
    fixups: dict[int, list[str]] = {}
    for path in sorted(overlay.repo_files(cfg)):
        creators = own.created.get(path, [])
        repo_bytes = (cfg.root / path).read_bytes()
        last = overlay.blob(tree, state.head, path) if state else None
        if not creators:
            if last is not None and last == repo_bytes:
                continue  # the patch that created it was dropped: the export removes it
            raise BadInput(
                f"{path} is in the overlay but no patch creates it. Add the file to the patch it "
                f"belongs to in {tree} (copy it there, `git add`, `git commit --fixup=<commit>`), then export."
            )
        tree_bytes = overlay.blob(tree, "HEAD", path)
        if repo_bytes == tree_bytes:
            continue
        if tree_bytes == last:
            # git-absorb semantics: the last patch that touched the file takes the edit
            index = max(creators + own.modified.get(path, []))
            if any(later > index for later in own.deleted.get(path, [])):
                raise BadInput(
                    f"{path} is in the overlay but a patch deletes it in {tree}; delete it from the overlay, "
                    "or drop the deletion from that patch, then export"
                )
            fixups.setdefault(index, []).append(path)
        elif repo_bytes != last:
            raise LocalEdits(
                f"{path} was edited both in the overlay and in {tree}; keep one version "
                "(copy it to the other place), then export"
            )
    if not fixups:
        return []
    _fold(cfg, tree, version, {own.commits[i]: paths for i, paths in fixups.items()})
    return [p for paths in fixups.values() for p in paths]


def _fold(cfg: ForkConfig, tree: Path, version: str, fixups: dict[str, list[str]]) -> None:
    """Put each file's repository bytes into the commit named for it and the commits after it (they do
    not touch the file), with git's plumbing: new commits, then one ref update, then the files.
    build/export/fold.json names both HEADs first, so that a kill is finished by the next export."""
    work = cfg.build_dir / WORK
    commits = git.out(["rev-list", "--reverse", f"{base_tag(version)}..HEAD"], tree).splitlines()
    orig = commits[-1]
    blobs: dict[str, str] = {}
    parent = None
    index = work / "fold-index"  # a scratch index: the tree's own index and files stay as they are
    work.mkdir(parents=True, exist_ok=True)
    for commit in commits:
        if commit in fixups:
            for path in fixups[commit]:
                data = (cfg.root / path).read_bytes()
                proc = git.run(["hash-object", "-w", "--stdin"], tree, input=data, binary=True)
                blobs[path] = proc.stdout.decode().strip()
        if not blobs:
            continue
        parent = parent or git.out(["rev-parse", f"{commit}^"], tree)
        parent = _with_files(tree, commit, parent, blobs, index)
    _write_json(work / FOLD, {"orig": orig, "new": parent, "paths": sorted(blobs)})
    git.run(["update-ref", "-m", "fork export: fold overlay edits", "HEAD", parent, orig], tree)
    _check_out(tree, sorted(blobs))
    (work / FOLD).unlink()


def _with_files(tree: Path, commit: str, parent: str, blobs: dict[str, str], index: Path) -> str:
    """`commit` on `parent` with `blobs` ({path: blob}) in its tree; author and message kept."""
    env = {"GIT_INDEX_FILE": str(index)}
    git.run(["read-tree", commit], tree, env=env)
    for path, blob in blobs.items():
        listed = git.out(["ls-tree", commit, "--", path], tree)  # "<mode> blob <id>\t<path>", or nothing
        mode = listed.split(" ", 1)[0] if listed else "100644"
        git.run(["update-index", "--add", "--cacheinfo", f"{mode},{blob},{path}"], tree, env=env)
    new_tree = git.out(["write-tree"], tree, env=env)
    raw = git.run(["cat-file", "commit", commit], tree, binary=True).stdout
    header, message = raw.split(b"\n\n", 1)
    author = next(line for line in header.decode().splitlines() if line.startswith("author "))
    who, _, date = author[len("author ") :].rpartition("> ")
    name, _, email = who.partition(" <")
    author_env = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date}
    proc = git.run(["commit-tree", new_tree, "-p", parent], tree, input=message, env=author_env, binary=True)
    return proc.stdout.decode().strip()


def _check_out(tree: Path, paths: list[str]) -> None:
    """The tree's files and index for `paths` as HEAD has them (run again after a kill)."""
    for path in paths:
        data = overlay.blob(tree, "HEAD", path)
        if data is not None:
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_bytes(data)
    git.run(["reset", "-q", "--", *paths], tree)
    git.run(["update-index", "-q", "--refresh"], tree, check=False)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


Changes = dict[str, bytes | None]  # what an export writes: {repo-relative path: new bytes, or None to delete}


def _rel(cfg: ForkConfig, path: Path) -> str:
    return path.relative_to(cfg.root).as_posix()


def stage_series(cfg: ForkConfig, changes: Changes, rendered: list[tuple[str, bytes]]) -> None:
    """patches/*.patch and patches/series for `rendered` (old patch files removed). Names the pin
    does not apply (variant-only patches, kept for older bases) stay listed at their place."""
    names = [name for name, _ in rendered]
    for name, data in rendered:
        changes[_rel(cfg, cfg.patches_dir / name)] = data
    for old in cfg.patches_dir.glob("*.patch"):
        if old.name not in names:
            changes[_rel(cfg, old)] = None
    listed = series.carry_variant_only(cfg, names)
    changes[_rel(cfg, cfg.patches_dir / "series")] = series.series_text(listed).encode()


def stage_overlay(cfg: ForkConfig, changes: Changes, tree: Path, version: str) -> None:
    changes.update(overlay.changes(cfg, tree, version))


def renames(cfg: ForkConfig, rendered: list[tuple[str, bytes]]) -> dict[str, str]:
    """Old patch name -> new name, for pin patches whose file name changes (matched by subject)."""
    new_by_subject = {series.mailinfo(data).subject: name for name, data in rendered}
    out = {}
    for p in series.read(cfg):
        new = new_by_subject.get(p.info.subject)
        if new and new != p.name:
            out[p.name] = new
    return out


def stage_fork_toml_renames(cfg: ForkConfig, changes: Changes, rendered: list[tuple[str, bytes]]) -> None:
    """Keep `[patches."NAME"]` entries of fork.toml attached to their patch when names change."""
    text = cfg.toml_path.read_text()
    mapping = {old: new for old, new in renames(cfg, rendered).items() if old in cfg.fork_only}
    new_text = rename_toml_entries(text, mapping)
    if new_text != text:
        changes[_rel(cfg, cfg.toml_path)] = new_text.encode()


def stage_variant_renames(cfg: ForkConfig, changes: Changes, rendered: list[tuple[str, bytes]]) -> None:
    """Per-base variants (patches/bases/<version>/NAME) follow their patch when its name changes."""
    mapping = renames(cfg, rendered)
    root = cfg.patches_dir / "bases"
    if not mapping or not root.is_dir():
        return
    for d in sorted(x for x in root.iterdir() if x.is_dir()):
        files = {f.name: f.read_bytes() for f in d.glob("*.patch")}
        renamed = {mapping.get(name, name): data for name, data in files.items()}
        for name, data in renamed.items():
            changes[_rel(cfg, d / name)] = data
        for name in files.keys() - renamed.keys():
            changes[_rel(cfg, d / name)] = None


def finish_cut_short(cfg: ForkConfig, tree: Path) -> list[str]:
    """Complete what an export killed midway left (build/export/), so that the tree and the
    protected files are each either as before it or as it leaves them; returns what to tell."""
    work = cfg.build_dir / WORK
    txn.remove_trash(work)
    if not work.exists():
        return []
    notes = []
    fold = work / FOLD
    if fold.is_file() and tree.is_dir():
        moved = json.loads(fold.read_text())
        if git.rev(tree, "HEAD") == moved["new"]:
            for path in moved["paths"]:
                now = (tree / path).read_bytes() if (tree / path).is_file() else None
                if now not in (overlay.blob(tree, moved["orig"], path), overlay.blob(tree, "HEAD", path)):
                    raise LocalEdits(
                        f"{tree / path} was changed after an export was cut short while folding it; keep a copy, "
                        f"then `git -C {shlex.quote(str(tree))} checkout HEAD -- {shlex.quote(path)}` and export"
                    )
            _check_out(tree, moved["paths"])
            notes.append(f"finished folding overlay edits into {tree} (an export was cut short)")
    if journal.staged(work):
        journal.check_untouched(cfg.root, work, f"rm -rf {shlex.quote(str(work))}")
        count, left = len(journal.entries(work)), len(journal.left(cfg.root, work))
        with txn.signals_deferred():
            journal.apply(cfg.root, work)
        notes.append(
            f"finished the write of an export that was cut short: {left} of its {count} file(s) were left"
            if left
            else f"an export that was cut short had written all its {count} file(s); tidied up build/export"
        )
    txn.discard(work)
    return notes


def export(cfg: ForkConfig, tree: Path) -> tuple[list[str], list[tuple[str, bool]], list[str]]:
    """Export a materialized tree of the pin. Returns (overlay files folded, files changed as
    (path, written), notes on an export cut short that this one finished first).

    Crash safety: the fold moves the tree's HEAD in one step (fold.json says how to finish it), the
    files are written as a journal in build/export/ (core/journal.py) that the next export finishes."""
    version = require_tree(tree)
    if version != cfg.pin.version:
        raise BadInput(
            f"{tree} is materialized on {version}; `export` writes the pin's series ({cfg.pin.version}). "
            f"Use `rebase --onto {version}` to move the series to another base, or `apply` to make {tree} "
            f"the pin's tree again (a tree left by a rebase that was not kept)."
        )
    notes = finish_cut_short(cfg, tree)
    _require_exportable(tree)
    work = cfg.build_dir / WORK
    try:
        folded = fold_overlay_edits(cfg, tree, version)
        rendered = render(tree, version)
        changes: Changes = {}
        stage_series(cfg, changes, rendered)
        stage_fork_toml_renames(cfg, changes, rendered)
        stage_variant_renames(cfg, changes, rendered)
        stage_overlay(cfg, changes, tree, version)
        journal.stage(cfg.root, work, changes)
    except BaseException:
        if not (work / FOLD).exists():  # else a fold was cut short: the next export finishes it
            txn.discard(work)  # nothing protected was changed
        raise
    changed = [(rel, entry["new"]) for rel, entry in journal.entries(work).items()]
    state = State(
        version,
        git.out(["rev-parse", base_tag(version)], tree),
        [(name, hashlib.sha256(data).hexdigest()) for name, data in rendered],  # as series.Patch.sha256
        git.out(["rev-parse", "HEAD"], tree),
    )
    with txn.signals_deferred():  # Ctrl-C lands after the export is complete, not in its middle
        journal.apply(cfg.root, work)
        state.save(tree)
        txn.discard(work)
    return folded, sorted(changed), notes


def export_upstream(cfg: ForkConfig, dest: Path) -> list[str]:
    """Copy the upstreamable patches (not fork-only) to `dest` as a clean `git am` series.

    Written in `<dest>.fork-partial` and renamed to `dest` when complete (the next run removes a
    partial folder a kill left)."""
    if dest.exists() and not dest.is_dir():
        raise BadInput(f"--upstream {dest}: not a directory (give a new or empty directory)")
    if not dest.exists() and any(parent.exists() and not parent.is_dir() for parent in dest.parents):
        raise BadInput(f"--upstream {dest}: a parent of it is not a directory")
    patches = [p for p in series.read(cfg) if p.name not in cfg.fork_only]
    problems = [msg for p in patches for msg in convention_problems(p)]
    if problems:
        raise BadInput("not exporting for upstream; fix first:\n  - " + "\n  - ".join(problems))
    if dest.exists() and any(dest.iterdir()):
        raise LocalEdits(f"{dest} exists and is not empty")
    _require_applies_without_fork_only(cfg, patches)
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    txn.discard(partial)
    partial.mkdir(parents=True)
    renumbered = []
    for i, p in enumerate(patches, 1):
        stem = p.name.split("-", 1)[1] if p.name[:4].isdigit() and "-" in p.name else p.name
        name = f"{i:04d}-{stem}"
        (partial / name).write_bytes(p.data)
        renumbered.append(name)
    (partial / "series").write_text(series.series_text(renumbered))
    os.replace(partial, dest)  # over an empty folder, or none
    return renumbered


def _require_applies_without_fork_only(cfg: ForkConfig, patches: list[series.Patch]) -> None:
    """The upstreamable patches must be a clean `git am` series on the pin by themselves."""
    if not set(cfg.fork_only) & set(series.read_names(cfg)):
        return  # the same series `check` applies
    from tools.fork.core import materialize, upstream

    tree = cfg.build_dir / "export-upstream"  # a fixed name: the next run removes what a kill left
    txn.discard(tree)
    try:
        materialize.create_base(upstream.obtain(cfg).source, tree)
        materialize.apply_series(tree, patches)
    except materialize.ApplyFailed as exc:
        raise BadInput(
            f"without the fork-only patches ({', '.join(sorted(cfg.fork_only))}) the series does not apply to "
            f"vllm-ascend {cfg.pin.version}: {exc}\nMove fork-only patches after the upstreamable ones they "
            "touch, or take what the patch needs out of the fork-only patch."
        ) from None
    finally:
        txn.discard(tree)


def run(args, cfg) -> int:
    if args.upstream:
        names = export_upstream(cfg, args.upstream)
        left_out = ", ".join(sorted(cfg.fork_only)) or "none"
        print(f"fork export: {len(names)} upstreamable patch(es) -> {args.upstream} (fork-only, left out: {left_out})")
        print(f"apply on an upstream checkout with: git am --keep-non-patch {args.upstream}/*.patch")
        return 0
    tree = (args.tree or cfg.default_fork_dir()).resolve()
    folded, changed, notes = export(cfg, tree)
    for note in notes:
        print(f"fork export: {note}")
    for path in folded:
        print(f"fork export: folded overlay edit {path} into its patch")
    if not changed:
        print("fork export: patches/ and the overlay are up to date (nothing changed)")
    for path, written in changed:
        print(f"fork export: {'wrote' if written else 'removed'} {path}")
    return 0
