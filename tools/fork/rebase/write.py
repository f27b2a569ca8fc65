"""Writing a completed rebase: what it writes, the all-or-nothing write, then build/fork."""

from __future__ import annotations

import os
from pathlib import Path

from tools.fork.core import config, forktoml, git, journal, materialize, overlay, series
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import EXIT_FAILED, ForkError
from tools.fork.core.series import base_tag
from tools.fork.core.txn import discard, signals_deferred
from tools.fork.rebase.report import failure, loud, print_table, written_but
from tools.fork.rebase.state import OLD_REF, State, digest, protected_files, require_unchanged
from tools.fork.testing.session import RunOptions, run_tests

JOURNAL = "write"  # build/rebase/write/: the journaled write (core/journal.py)


def finish(cfg: ForkConfig, work: Path, st: State) -> int:
    """The final write, journaled (build/rebase/write/): the new files are staged and the old ones kept
    there, then phase "writing" is saved, then renames move the new files into place, then "written".
    A kill before "writing" changed nothing; after it, `--continue` redoes the remaining renames
    (each one idempotent) and `--abort` puts the old files back (restore_old)."""
    tree = work / "tree"
    try:
        if st.phase == "write":
            changes, names = plan(cfg, tree, st)
            before = protected_files(cfg)
            after = dict(before)
            for rel, data in changes.items():
                if data is None:
                    after.pop(rel, None)
                else:
                    after[rel] = data
            st.new_digest = digest(after)
            st.save(work)
            current = digest(before)
            if current != st.new_digest:
                if current != st.digest:
                    require_unchanged(cfg, st)
                journal.stage(cfg.root, work / JOURNAL, changes)
                st.phase = "writing"
                st.save(work)
            else:
                st.phase = "written"
                st.save(work)
        if st.phase == "writing":
            with signals_deferred():
                journal.apply(cfg.root, work / JOURNAL)
                st.phase = "written"
                st.save(work)
    except BaseException as exc:
        if st.phase == "written":  # a signal held off during the write arrives right after it
            raise failure(exc, written_but()) from None
        if st.phase == "writing":
            raise failure(
                exc,
                "The write was cut short: `python -m tools.fork rebase --continue` finishes it, `rebase --abort` "
                "puts the old patches/, fork.toml and overlay back.",
            ) from None
        unchanged = digest(protected_files(cfg)) == st.digest
        raise failure(
            exc,
            ("patches/, fork.toml and the overlay were not changed (checked). " if unchanged else "")
            + "Every patch is applied in build/rebase; fix the cause (e.g. free disk space), then "
            "`python -m tools.fork rebase --continue` writes the result (or `--abort`).",
        ) from None
    try:
        _after_write(cfg, work, st)
    except BaseException as exc:
        raise failure(exc, written_but()) from None
    if st.test:
        print(f"fork rebase: running the fork's tests on {st.onto}", flush=True)
        rc = run_tests(config.load(cfg.root), RunOptions(base=st.onto))
        if rc:
            print(f"fork rebase: the fork's tests FAILED on {st.onto} (exit {rc}); the rebase itself is written")
            return EXIT_FAILED
    return 0


def plan(cfg: ForkConfig, tree: Path, st: State) -> tuple[dict[str, bytes | None], list[str]]:
    """What the completed rebase writes: {repo-relative path: new bytes, or None to delete}."""
    rendered = series.render(tree, st.onto)
    applied = [r for r in st.results if r.applied]
    if len(rendered) != len(applied):
        raise ForkError(
            f"{tree} has {len(rendered)} commit(s) on {base_tag(st.onto)} for {len(applied)} applied patch(es); "
            "one patch is one commit (squash or drop the extra commits, then `rebase --continue`)"
        )
    new_name = {r.name: name for r, (name, _) in zip(applied, rendered)}
    data_of = dict(rendered)
    # A patch the new pin does not apply keeps its name, unless the renumbered series took its number.
    taken, previous = {series.number(n) for n in data_of}, None
    for item in st.items:
        if item.name in new_name:
            previous = new_name[item.name]
        else:
            new_name_unapplied = series.unique_number(item.name, previous, taken)
            taken.add(series.number(new_name_unapplied))
            if new_name_unapplied != item.name:
                new_name.setdefault(item.name, new_name_unapplied)
    kept = [b for b in cfg.bases if b.version != st.onto and not (st.drop_old_base and b.version == st.old_pin)]
    effective = {b.version: dict(series.resolve(cfg, b.version)) for b in kept}

    changes: dict[str, bytes | None] = {}
    names: list[str] = []
    pids: dict[bytes, str] = {}

    def pid(data: bytes) -> str:
        if data not in pids:
            pids[data] = series.patch_id(data)
        return pids[data]

    for item in st.items:
        name = new_name.get(item.name, item.name)
        main = data_of.get(name)
        variants: dict[str, bytes] = {}
        for b in kept:
            path = effective[b.version][item.name]
            mine = path.read_bytes() if path is not None else None
            if mine is None and main is None:
                continue
            if mine is None:
                variants[b.version] = b""  # the new patch is already upstream on this base: skip it there
            elif main is None or pid(mine) != pid(main):
                variants[b.version] = mine
            elif path.parent == cfg.variants_dir(b.version) and mine != main:
                # The base had its own variant, the same change in other bytes (context offsets, index
                # lines): keep its bytes, so that moving back reproduces them exactly.
                variants[b.version] = mine
        if main is None and not variants:
            continue  # upstream on every base that is left: gone from the series
        if name in names:
            raise ForkError(f"two patches would both be named {name}; give one of them another subject")
        names.append(name)
        if main is not None:
            changes[f"patches/{name}"] = main
        for version, data in variants.items():
            changes[f"patches/bases/{version}/{name}"] = data
    for old in sorted(cfg.patches_dir.glob("*.patch")) + sorted(cfg.patches_dir.glob("bases/*/*.patch")):
        rel = old.relative_to(cfg.root).as_posix()
        changes.setdefault(rel, None)
    changes["patches/series"] = series.series_text(names).encode()

    renamed = {old: new for old, new in new_name.items() if old != new}
    removed = [i.name for i in st.items if new_name.get(i.name, i.name) not in names]
    changes["fork.toml"] = forktoml.updated_fork_toml(cfg, st.onto, st.onto_sha256, kept, renamed, removed).encode()

    changes.update(overlay.changes(cfg, tree, st.onto))
    return changes, names


def _after_write(cfg: ForkConfig, work: Path, st: State) -> None:
    tree = work / "tree"
    new_cfg = config.load(cfg.root)
    if not tree.is_dir():  # cut short after the write, after the tree was installed
        discard(work)
        print("fork rebase: done (the result was already written).")
        return
    print()
    print(f"fork rebase: git range-diff {st.old_pin}..old-series {st.onto}..new-series")
    # A high creation factor pairs a patch that lost most of its diff (partially upstream) with its
    # old self ("!", with the difference) instead of showing it as dropped and added.
    rd = git.run(
        [
            "range-diff",
            "--no-color",
            "--creation-factor=400",
            f"{base_tag(st.old_pin)}..{OLD_REF}",
            f"{base_tag(st.onto)}..HEAD",
        ],
        tree,
        check=False,
    )
    for line in (rd.stdout or rd.stderr).rstrip().splitlines():
        print(f"    {line}")
    print()
    print_table(st)
    print()
    if st.no_test:
        loud(
            "fork rebase: this rebase is UNTESTED (--no-test): the series' own tests and upstream's CPU suite "
            f"did not run on {st.onto}. Run `python -m tools.fork test` before you commit."
        )
    else:
        for line in st.tested:
            print(f"fork rebase: tested: {line}")
    print(f"fork rebase: pin vllm-ascend {st.old_pin} -> {st.onto} (sha256 {st.onto_sha256[:12]}); "
          f"bases: {', '.join(b.version for b in new_cfg.bases)}")  # fmt: skip
    variants = sorted(p.relative_to(cfg.root).as_posix() for p in new_cfg.patches_dir.glob("bases/*/*.patch"))
    for v in variants:
        reason = series.skip_reason((cfg.root / v).read_bytes())
        kind = "variant" if reason is None else f"skip marker ({reason})"
        print(f"fork rebase: {v}: {kind}")
    if st.first_use:
        loud(f"fork.toml now pins vllm-ascend {st.onto} with sha256 {st.onto_sha256} (trusted on first use).")
    _install_tree(new_cfg, tree, st)
    discard(work)
    print("fork rebase: done. Review with `git diff` and commit patches/, fork.toml and the overlay.")


def _install_tree(cfg: ForkConfig, tree: Path, st: State) -> None:
    """The rebased tree becomes build/fork (the pin's materialized tree), unless that holds edits."""
    git.run(["update-ref", "-d", OLD_REF], tree, check=False)
    git.run(["tag", "-d", base_tag(st.old_pin)], tree, check=False)
    fork = cfg.default_fork_dir()
    if fork.exists() and not (git.is_repo(fork) and not materialize.local_edits(fork)):
        print(f"fork rebase: note: {fork} was left as it is (it has local edits); `apply --force` re-materializes it")
        return
    discard(fork)  # also what a run killed here left (build/fork.fork-trash)
    fork.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tree, fork)
    patches = series.read(cfg)
    materialize.State(
        st.onto,
        git.out(["rev-parse", base_tag(st.onto)], fork),
        [(p.name, p.sha256) for p in patches],
        git.out(["rev-parse", "HEAD"], fork),
    ).save(fork)


def restore_old(cfg: ForkConfig, work: Path) -> bool:
    """`--abort` of a rebase whose write began: put back every file the write replaced or deleted and
    remove the ones it added. False when no write began (nothing to restore)."""
    return journal.restore(cfg.root, work / JOURNAL)
