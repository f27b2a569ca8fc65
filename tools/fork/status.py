"""Summary of the fork: pinned base, the series (fork-only marked), materialized tree, wheel."""

from __future__ import annotations

from tools.fork import git, series, wheel
from tools.fork.materialize import State, local_edits

HELP = __doc__


def add_arguments(p) -> None:
    pass


def run(args, cfg) -> int:
    patches = series.read(cfg)
    others = ", ".join(b.version for b in cfg.bases if b.version != cfg.pin.version) or "none"
    print(f"base     {cfg.dist} {cfg.pin.version}  sha256 {cfg.pin.sha256[:16]}...  (also kept green on: {others})")
    print(f"patches  {len(patches)} in patches/series")
    for i, p in enumerate(patches, 1):
        mark = "  [fork-only]" if p.name in cfg.fork_only else ""
        print(f"  {i}. {p.info.subject}{mark}")
    for b in cfg.bases:
        if b.version == cfg.pin.version:
            continue
        own = [
            f"{name} ({'skipped: already upstream there' if path is None else 'own variant'})"
            for name, path in series.resolve(cfg, b.version)
            if path is None or path.parent != cfg.patches_dir
        ]
        if own:
            print(f"  on {b.version}: " + "; ".join(own))
    work = cfg.build_dir / "rebase"
    if work.exists():
        print(f"rebase   in progress ({work.relative_to(cfg.root)}): `rebase --continue` or `rebase --abort`")
    tree = cfg.default_fork_dir()
    if git.is_repo(tree):
        state = State.load(tree)
        edits = local_edits(tree)
        applied = state is not None and state.series == [(p.name, p.sha256) for p in patches]
        how = "up to date" if applied and not edits else ("has local edits" if edits else "stale: run apply")
        print(f"tree     {tree.relative_to(cfg.root)}: {how}")
    else:
        print(f"tree     {tree.relative_to(cfg.root)}: not materialized (run apply)")
    try:
        version = wheel.fork_version(cfg)
    except ModuleNotFoundError as exc:  # setuptools-scm: only in the tools environment
        print(f"version  unknown: this Python lacks {exc.name} (build/tools-venv/bin/python has it)")
        return 0
    wheels = sorted((cfg.root / "dist").glob(f"vllm_ascend-{version}-*.whl"))
    print(f"version  {version}")
    print(f"wheel    {wheels[-1].relative_to(cfg.root) if wheels else 'not built (run build)'}")
    return 0
