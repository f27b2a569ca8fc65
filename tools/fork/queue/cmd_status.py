"""Summary of the fork: pinned base, the series (fork-only marked), materialized tree, wheel."""

from __future__ import annotations

from tools.fork.core import git, materialize, series
from tools.fork.core.errors import InProgress
from tools.fork.queue import wheel
from tools.fork.rebase.state import State, workdir

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
            f"{name} ({_skipped(cfg, b.version, name) if path is None else 'own variant'})"
            for name, path in series.resolve(cfg, b.version)
            if path is None or path.parent != cfg.patches_dir
        ]
        if own:
            print(f"  on {b.version}: " + "; ".join(own))
    work = workdir(cfg)
    if work.exists():
        for line in _rebase_lines(cfg, work):
            print(line)
    tree = cfg.default_fork_dir()
    if git.is_repo(tree):
        state = materialize.State.load(tree)
        edits = materialize.local_edits(tree)
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


def _skipped(cfg, version: str, name: str) -> str:
    """Why base `version` skips patch `name`: its skip marker's text, or a patch the pin no longer needs."""
    marker = cfg.variants_dir(version) / name
    return f"skipped: {series.skip_reason(marker.read_bytes()) if marker.is_file() else 'already upstream there'}"


def _rebase_lines(cfg, work) -> list[str]:
    """The rebase in progress: target version, where it stopped (patch, files or tests), what to do."""
    where = work.relative_to(cfg.root)
    try:
        st = State.load(work)
    except InProgress:
        return [f"rebase   in progress ({where}), state unreadable: `rebase --abort`"]
    lines = [f"rebase   in progress onto vllm-ascend {st.onto} (from {st.old_pin}; {where})"]
    n = len(st.items)
    if st.stopped and st.phase == "apply" and st.index < n:
        item = st.items[st.index]
        tree = work / "tree"
        unmerged = git.out(["diff", "--name-only", "--diff-filter=U"], tree).splitlines() if tree.is_dir() else []
        files = unmerged or st.conflict_files
        lines.append(f"  stopped at a CONFLICT in patch {st.index + 1}/{n} {item.name} ({item.origin})")
        lines.append(f"  files: {', '.join(files) if files else '(none left unmerged: `git add` done?)'}")
        lines.append(f"  tree: {tree}; then `rebase --continue` or `rebase --abort`")
    elif st.stopped and st.phase == "test":
        lines.append(f"  stopped: TESTS FAILED on {st.onto} after all {n} patches applied")
        for f in st.test_failures[:10]:
            owner = f" (patch {f['patch']})" if f.get("patch") else ""
            lines.append(f"  test: {f['test']}: {f['outcome']}{owner}")
            if f.get("file"):
                lines.append(f"    file: {f['file']}")
        lines.append(f"  tree: {work / 'tree'}; fix there, then `rebase --continue` or `rebase --abort`")
    else:
        lines.append(f"  phase {st.phase}, patch {min(st.index + 1, n)}/{n}: `rebase --continue` or `rebase --abort`")
    return lines
