"""Write `patches/`, `patches/series` and the overlay from a materialized tree.

Edit the fork in either place, then export:
  - hunks in upstream files: commit in the materialized tree (`git commit --fixup=<patch>`,
    `git rebase -i --autosquash v<base>`), or add a new commit for a new patch;
  - files the fork adds: edit the overlay copy in this repository (vllm_ascend/..., tests/...)
    or edit them in the tree and commit.
Overlay edits are folded into the commit that creates the file before exporting. The output is
deterministic: exporting an unchanged series reproduces `patches/` byte for byte.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tools.fork.core import git, overlay, series
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput, LocalEdits
from tools.fork.core.forktoml import rename_toml_entries
from tools.fork.core.materialize import State, require_tree
from tools.fork.core.series import base_tag, convention_problems, render
from tools.fork.core.txn import StagedWrite

HELP = __doc__


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
            fixups.setdefault(max(creators + own.modified.get(path, [])), []).append(path)
        elif repo_bytes != last:
            raise LocalEdits(
                f"{path} was edited both in the overlay and in {tree}; keep one version "
                "(copy it to the other place), then export"
            )
    if not fixups:
        return []
    orig_head = git.out(["rev-parse", "HEAD"], tree)
    try:
        for index, paths in sorted(fixups.items()):
            for path in paths:
                (tree / path).write_bytes((cfg.root / path).read_bytes())
            git.run(["add", "--", *paths], tree)
            git.run(["commit", "-q", "--no-verify", f"--fixup={own.commits[index]}"], tree)
        git.run(["rebase", "-q", "-i", "--autosquash", base_tag(version)], tree, env={"GIT_SEQUENCE_EDITOR": "true"})
    except BaseException:
        git.run(["rebase", "--abort"], tree, check=False)
        git.run(["reset", "-q", "--hard", orig_head], tree, check=False)
        raise
    return [p for paths in fixups.values() for p in paths]


def stage_series(cfg: ForkConfig, staged: StagedWrite, rendered: list[tuple[str, bytes]], patches_dir: Path) -> None:
    """Stage patches/*.patch and patches/series for `rendered` (old patch files removed).

    In the fork's own patches/, names the pin does not apply (variant-only patches, kept for
    older bases) stay listed at their place."""
    names = [name for name, _ in rendered]
    for name, data in rendered:
        staged.write(patches_dir / name, data)
    for old in patches_dir.glob("*.patch"):
        if old.name not in names:
            staged.delete(old)
    listed = series.carry_variant_only(cfg, names) if patches_dir == cfg.patches_dir else names
    staged.write(patches_dir / "series", series.series_text(listed).encode())


def stage_overlay(cfg: ForkConfig, staged: StagedWrite, tree: Path, version: str) -> None:
    for path, data in overlay.changes(cfg, tree, version).items():
        if data is None:
            staged.delete(cfg.root / path)
        else:
            staged.write(cfg.root / path, data)


def renames(cfg: ForkConfig, rendered: list[tuple[str, bytes]]) -> dict[str, str]:
    """Old patch name -> new name, for pin patches whose file name changes (matched by subject)."""
    new_by_subject = {series.mailinfo(data).subject: name for name, data in rendered}
    out = {}
    for p in series.read(cfg):
        new = new_by_subject.get(p.info.subject)
        if new and new != p.name:
            out[p.name] = new
    return out


def stage_fork_toml_renames(cfg: ForkConfig, staged: StagedWrite, rendered: list[tuple[str, bytes]]) -> None:
    """Keep `[patches."NAME"]` entries of fork.toml attached to their patch when names change."""
    text = cfg.toml_path.read_text()
    mapping = {old: new for old, new in renames(cfg, rendered).items() if old in cfg.fork_only}
    new_text = rename_toml_entries(text, mapping)
    if new_text != text:
        staged.write(cfg.toml_path, new_text.encode())


def stage_variant_renames(cfg: ForkConfig, staged: StagedWrite, rendered: list[tuple[str, bytes]]) -> None:
    """Per-base variants (patches/bases/<version>/NAME) follow their patch when its name changes."""
    mapping = renames(cfg, rendered)
    root = cfg.patches_dir / "bases"
    if not mapping or not root.is_dir():
        return
    for d in sorted(x for x in root.iterdir() if x.is_dir()):
        files = {f.name: f.read_bytes() for f in d.glob("*.patch")}
        renamed = {mapping.get(name, name): data for name, data in files.items()}
        for name, data in renamed.items():
            staged.write(d / name, data)
        for name in files.keys() - renamed.keys():
            staged.delete(d / name)


def export(cfg: ForkConfig, tree: Path) -> tuple[list[str], list[Path]]:
    """Export a materialized tree of the pin. Returns (overlay files folded, files changed)."""
    version = require_tree(tree)
    if version != cfg.pin.version:
        raise BadInput(
            f"{tree} is materialized on {version}; `export` writes the pin's series ({cfg.pin.version}). "
            f"Use `rebase --onto {version}` to move the series to another base, or `apply` to make {tree} "
            f"the pin's tree again (a tree left by a rebase that was not kept)."
        )
    _require_exportable(tree)
    folded = fold_overlay_edits(cfg, tree, version)
    rendered = render(tree, version)
    staged = StagedWrite()
    stage_series(cfg, staged, rendered, cfg.patches_dir)
    stage_fork_toml_renames(cfg, staged, rendered)
    stage_variant_renames(cfg, staged, rendered)
    stage_overlay(cfg, staged, tree, version)
    changed = staged.commit()
    patches = [series.Patch(name, cfg.patches_dir / name) for name, _ in rendered]
    State(
        version,
        git.out(["rev-parse", base_tag(version)], tree),
        [(p.name, p.sha256) for p in patches],
        git.out(["rev-parse", "HEAD"], tree),
    ).save(tree)
    return folded, changed


def export_upstream(cfg: ForkConfig, dest: Path) -> list[str]:
    """Copy the upstreamable patches (not fork-only) to `dest` as a clean `git am` series."""
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
    staged = StagedWrite()
    renumbered = []
    for i, p in enumerate(patches, 1):
        stem = p.name.split("-", 1)[1] if p.name[:4].isdigit() and "-" in p.name else p.name
        name = f"{i:04d}-{stem}"
        staged.write(dest / name, p.data)
        renumbered.append(name)
    staged.write(dest / "series", series.series_text(renumbered).encode())
    staged.commit()
    return renumbered


def _require_applies_without_fork_only(cfg: ForkConfig, patches: list[series.Patch]) -> None:
    """The upstreamable patches must be a clean `git am` series on the pin by themselves."""
    if not set(cfg.fork_only) & set(series.read_names(cfg)):
        return  # the same series `check` applies
    from tools.fork.core import materialize, upstream

    cfg.build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cfg.build_dir, prefix="export-upstream-") as tmp:
        tree = Path(tmp) / "tree"
        materialize.create_base(upstream.obtain(cfg).source, tree)
        try:
            materialize.apply_series(tree, patches)
        except materialize.ApplyFailed as exc:
            raise BadInput(
                f"without the fork-only patches ({', '.join(sorted(cfg.fork_only))}) the series does not apply to "
                f"vllm-ascend {cfg.pin.version}: {exc}\nMove fork-only patches after the upstreamable ones they "
                "touch, or take what the patch needs out of the fork-only patch."
            ) from None


def run(args, cfg) -> int:
    if args.upstream:
        names = export_upstream(cfg, args.upstream)
        left_out = ", ".join(sorted(cfg.fork_only)) or "none"
        print(f"fork export: {len(names)} upstreamable patch(es) -> {args.upstream} (fork-only, left out: {left_out})")
        print(f"apply on an upstream checkout with: git am --keep-non-patch {args.upstream}/*.patch")
        return 0
    tree = (args.tree or cfg.default_fork_dir()).resolve()
    folded, changed = export(cfg, tree)
    for path in folded:
        print(f"fork export: folded overlay edit {path} into its patch")
    if not changed:
        print("fork export: patches/ and the overlay are up to date (nothing changed)")
    for path in changed:
        verb = "wrote" if path.exists() else "removed"
        print(f"fork export: {verb} {path.relative_to(cfg.root)}")
    return 0
