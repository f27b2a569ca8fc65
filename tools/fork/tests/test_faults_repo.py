"""`apply` and `rebase` killed (SIGKILL) at their mutating file steps and before each `git am`.

apply: the next `apply` (no --force) makes build/fork as a clean run does (same tree, clean, no
leftovers in build/). rebase: every step of `rebase --onto` (build/rebase, the final write of
patches/, fork.toml and the overlay, and installing build/fork); after each kill, on one copy of the
repository `rebase --continue` must give the clean run's result and on another `rebase --abort` the
state before, both checked by the bytes of every protected file, with nothing left in build/ but
build/fork. faults.py has the hook; FORK_FAULTS=all (`make faults`) runs every kill point.
"""

from __future__ import annotations

import shutil

from tools.fork import cli
from tools.fork.core import git, txn
from tools.fork.tests.faults import Faulty, install_hook, kill_points
from tools.fork.tests.synthetic import COPY, UPSTREAM, B, edited, make, replace


def _tree_id(tree) -> str:
    return git.out(["rev-parse", "HEAD^{tree}"], tree)


def _leftovers(root) -> list[str]:
    """What the tool left in build/ besides its trees and its lock, and staged files anywhere."""
    build = root / "build"
    extra = [p.name for p in build.iterdir() if p.name not in ("fork", ".fork.lock")] if build.exists() else []
    return extra + [str(p) for p in root.rglob(f"*{txn._TMP_SUFFIX}")]


def _cli(root, *argv):
    return cli.main(["-C", str(root), *argv])


def test_apply_killed_at_every_step_is_made_again_by_the_next_apply(tmp_path, monkeypatch, capsys):
    fork = make(tmp_path, monkeypatch, None)
    clean = _tree_id(fork.tree)
    shutil.rmtree(fork.tree)
    faulty = Faulty(install_hook(tmp_path / "hook"), {}, [fork.root / "build"])
    proc, steps = faulty.count("-C", str(fork.root), "apply", log=tmp_path / "log")
    assert proc.returncode == 0, proc.stderr
    assert sum("git am" in s for s in steps) == len(fork.series()), steps  # a kill point before each `git am`
    with capsys.disabled():  # the sweep's numbers, for the report
        print(f"\nfaults: apply: {len(steps)} kill points, {len(kill_points(len(steps)))} run")
    for n in kill_points(len(steps)):
        shutil.rmtree(fork.tree)
        faulty.killed_at(n, "-C", str(fork.root), "apply")
        label = f"apply killed before step {steps[n - 1]}"
        assert _cli(fork.root, "apply") == 0, f"{label}: {capsys.readouterr()}"
        assert _tree_id(fork.tree) == clean, label
        assert not git.dirty_summary(fork.tree) and not git.am_in_progress(fork.tree), label
        assert _leftovers(fork.root) == [], label
        assert _cli(fork.root, "apply") == 0 and "up to date" in capsys.readouterr().out, label


def test_rebase_killed_at_every_step_continues_or_aborts(tmp_path, monkeypatch, capsys):
    # B moves a line a patch touches: every patch file is written again (new context), not only fork.toml
    b_files = edited(UPSTREAM, {COPY: replace("        size = sizes[i]\n", "        size = int(sizes[i])\n")})
    fork = make(tmp_path, monkeypatch, b_files)
    pre, pre_tree = fork.snapshot(), _tree_id(fork.tree)
    saved = tmp_path / "saved"
    shutil.copytree(fork.root, saved, symlinks=True)
    build = fork.root / "build"
    roots = [*fork.protected(), *(build / name for name in ("rebase", "rebase.fork-trash", "fork", "fork.fork-trash"))]
    faulty = Faulty(install_hook(tmp_path / "hook"), {}, roots)
    proc, steps = faulty.count("-C", str(fork.root), "rebase", "--onto", B, log=tmp_path / "log")
    assert proc.returncode == 0, proc.stderr
    post, post_tree = fork.snapshot(), _tree_id(fork.tree)
    assert post != pre
    writes = [s for s in steps if "/build/" not in s.split("\t")[2]]
    assert len(writes) >= 4, steps  # the final write's renames into patches/, fork.toml, the overlay are seen
    other = tmp_path / "other"

    def protected(root):
        return {p.relative_to(root): data for p, data in txn.snapshot(
            [root / "patches", root / "fork.toml", root / "vllm_ascend", root / "tests"]).items()}  # fmt: skip

    def relative(snap):
        return {p.relative_to(fork.root): data for p, data in snap.items()}

    with capsys.disabled():  # the sweep's numbers, for the report
        run = len(kill_points(len(steps), sample=8))
        print(f"\nfaults: rebase: {len(steps)} kill points ({len(writes)} in the protected files), {run} run")
    for n in kill_points(len(steps), sample=8):
        label = f"rebase killed before step {steps[n - 1]}"
        shutil.rmtree(fork.root)
        shutil.copytree(saved, fork.root, symlinks=True)
        faulty.killed_at(n, "-C", str(fork.root), "rebase", "--onto", B)
        shutil.rmtree(other, ignore_errors=True)
        shutil.copytree(fork.root, other, symlinks=True)
        # --continue: the rebase's result (or, killed before build/rebase held a state, nothing to continue)
        rc = _cli(fork.root, "rebase", "--continue")
        out = capsys.readouterr()
        if rc == 0:
            assert fork.snapshot() == post, f"{label}: --continue: {out}"
            assert _tree_id(fork.tree) == post_tree, label
        else:
            assert fork.snapshot() == pre, f"{label}: --continue exited {rc}: {out}"
            assert "--abort" in out.err or "no rebase in progress" in out.err, f"{label}: {out}"
            assert _cli(fork.root, "rebase", "--abort") in (0, 2), label
            assert fork.snapshot() == pre, label
        assert _leftovers(fork.root) == [], label
        # --abort on the copy: the state before; killed after the rebase was complete, it is over ("no rebase")
        rc = _cli(other, "rebase", "--abort")
        out = capsys.readouterr()
        assert rc in (0, 2) and "Traceback" not in out.err, f"{label}: --abort: {out}"
        if rc == 0:
            assert protected(other) == relative(pre), f"{label}: --abort did not restore: {out}"
            assert any(w in out.out for w in ("not changed", "undone", "wrote nothing")), f"{label}: {out}"
        else:
            assert "no rebase in progress" in out.err and protected(other) in (relative(pre), relative(post)), label
        assert _cli(other, "apply") == 0, label
        assert _leftovers(other) == [], label
        if protected(other) == relative(pre):
            assert _tree_id(other / "build" / "fork") == pre_tree, label


def test_a_half_deleted_tree_apply_says_what_to_delete_and_force_makes_it_again(tmp_path, monkeypatch, capsys):
    import shlex

    fork = make(tmp_path, monkeypatch, None)
    clean = _tree_id(fork.tree)
    shutil.rmtree(fork.tree / ".git")  # what `rm -rf` killed halfway leaves: files, no repository
    assert _cli(fork.root, "apply") == 6
    err = capsys.readouterr().err
    assert f"rm -rf {shlex.quote(str(fork.tree))}" in err and "--force" in err and len(err.splitlines()) == 1, err
    assert _cli(fork.root, "apply", "--force") == 0
    assert _tree_id(fork.tree) == clean and _leftovers(fork.root) == []
