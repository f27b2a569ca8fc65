"""`apply`, `rebase` and `export` killed (SIGKILL) at their mutating file steps and before each `git am`.

apply: the next `apply` (no --force) makes build/fork as a clean run does (same tree, clean, no
leftovers in build/). rebase: every step of `rebase --onto` (build/rebase, the final write of
patches/, fork.toml and the overlay, and installing build/fork); after each kill, on one copy of the
repository `rebase --continue` must give the clean run's result and on another `rebase --abort` the
state before, both checked by the bytes of every protected file, with nothing left in build/ but
build/fork. export: every step of the overlay fold (build/fork) and of the journaled write
(build/export, the protected files); the killed run leaves each protected file as before or as
after, and the next `export` gives the clean run's bytes and tree, printing only what is true.
faults.py has the hook; FORK_FAULTS=all (`make faults`) runs every kill point.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter

from tools.fork import cli
from tools.fork.core import git, txn
from tools.fork.core.materialize import PARTIAL_SUFFIX
from tools.fork.tests.faults import Faulty, install_hook, kill_points
from tools.fork.tests.synthetic import COPY, MEMMOVE_PY, UPSTREAM, B, edited, make, replace


def _tree_id(tree) -> str:
    return git.out(["rev-parse", "HEAD^{tree}"], tree)


def _leftovers(root) -> list[str]:
    """What the tool left in build/ besides its trees and its lock, and trash or partial folders anywhere."""
    build = root / "build"
    extra = [p.name for p in build.iterdir() if p.name not in ("fork", ".fork.lock")] if build.exists() else []
    return extra + [str(p) for p in root.rglob("*") if p.name.endswith((txn.TRASH_SUFFIX, PARTIAL_SUFFIX))]


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


def _export_scenario(fork) -> None:
    """An export that folds, renames and rewrites: patch 1 takes an overlay edit made in the repository
    (the fold moves the tree's HEAD); a new patch goes before the fork-only patch 3, which becomes 0004
    (fork.toml follows) and edits, in the tree, the overlay file it adds."""
    (fork.root / "vllm_ascend/ops/memmove.py").write_text(MEMMOVE_PY + "# copies overlapping rows safely\n")
    git.run(["reset", "-q", "--hard", "HEAD~1"], fork.tree)
    fork.commit(fork.tree, "[Misc][Feature] Add a knob", {"vllm_ascend/knob.py": lambda _: "KNOB = 1\n"})
    git.run(["cherry-pick", "--no-edit", "ORIG_HEAD"], fork.tree)
    (fork.tree / "vllm_ascend/worker/alias.py").write_text("ALIAS = 'GLM53_BATCH_MEMCPY'  # read at start-up\n")
    git.run(["commit", "-q", "-a", "--amend", "--no-edit", "--no-verify"], fork.tree)


def test_export_killed_at_every_step_is_finished_by_the_next_export(tmp_path, monkeypatch, capsys):
    fork = make(tmp_path, monkeypatch, None)
    _export_scenario(fork)
    pre, pre_head = fork.snapshot(), git.out(["rev-parse", "HEAD"], fork.tree)
    saved = tmp_path / "saved"
    shutil.copytree(fork.root, saved, symlinks=True)
    build = fork.root / "build"
    roots = [*fork.protected(), *(build / name for name in ("export", "export.fork-trash", "fork"))]
    faulty = Faulty(install_hook(tmp_path / "hook"), {}, roots)
    proc, steps = faulty.count("-C", str(fork.root), "export", log=tmp_path / "log")
    assert proc.returncode == 0, proc.stderr
    assert "folded overlay edit vllm_ascend/ops/memmove.py" in proc.stdout, proc.stdout
    post, post_head = fork.snapshot(), git.out(["rev-parse", "HEAD"], fork.tree)
    changed = {p for p in pre.keys() | post.keys() if pre.get(p) != post.get(p)}
    assert fork.root / "fork.toml" in changed and len(changed) >= 8, changed
    assert any("/build/fork/" in s and "\topen" in s for s in steps), steps  # the fold's checkout is a kill point
    points = kill_points(len(steps))
    with capsys.disabled():  # the sweep's numbers, for the report
        print(f"\nfaults: export: {len(steps)} kill points, {len(points)} run")
    outcomes: Counter[str] = Counter()
    for n in points:
        label = f"export killed before step {steps[n - 1]}"
        shutil.rmtree(fork.root)
        shutil.copytree(saved, fork.root, symlinks=True)
        faulty.killed_at(n, "-C", str(fork.root), "export")
        mid, mid_head = fork.snapshot(), git.out(["rev-parse", "HEAD"], fork.tree)
        assert all(mid.get(p) in (pre.get(p), post.get(p)) for p in changed | mid.keys()), label  # old or new
        assert mid_head in (pre_head, post_head), label
        work = fork.root / "build" / "export"
        if (work / "journal.json").is_file() or (work / "fold.json").is_file():  # half done: apply refuses
            assert _cli(fork.root, "apply") == 4, label
            err = capsys.readouterr().err
            assert len(err.splitlines()) == 1 and "`python3 -m tools.fork export`" in err, f"{label}: {err}"
            assert fork.snapshot() == mid and git.out(["rev-parse", "HEAD"], fork.tree) == mid_head, label
        assert _cli(fork.root, "export") == 0, f"{label}: {capsys.readouterr()}"
        out = capsys.readouterr().out
        assert fork.snapshot() == post and _leftovers(fork.root) == [], f"{label}: {out}"
        assert git.out(["rev-parse", "HEAD"], fork.tree) == post_head and not git.dirty_summary(fork.tree), label
        # only what is true: the fold told by the run that did it, the files by the run that wrote them
        assert ("folded overlay edit" in out) == (mid_head == pre_head), f"{label}: {out}"
        told = [line.split() for line in out.splitlines()]  # "fork export: wrote|removed PATH"
        reported = {fork.root / w[3] for w in told if len(w) == 4 and w[2] in ("wrote", "removed")}
        assert reported <= {p for p in changed if mid.get(p) != post.get(p)}, f"{label}: {out}"
        outcomes[_export_outcome(mid == pre, mid == post, mid_head == pre_head, out)] += 1
        left = {p for p in changed if mid.get(p) != post.get(p)}
        if "an export that was cut short" in out:  # finished by this run, before its own export
            assert not reported and f"its {len(changed)} file(s)" in out, f"{label}: {out}"
            assert (f"{len(left)} of its" in out) if left else ("had written all" in out), f"{label}: {out}"
        elif mid != post:
            assert reported == {p for p in changed if mid.get(p) != post.get(p)}, f"{label}: {out}"
        assert _cli(fork.root, "export") == 0 and "up to date" in capsys.readouterr().out, label
    with capsys.disabled():
        print("faults: export: after the kill " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
    assert outcomes["write finished by the next export"], outcomes  # the sample reaches the journaled write


def _export_outcome(old: bool, new: bool, head_old: bool, out: str) -> str:
    if "finished the write of an export that was cut short" in out:
        return "write finished by the next export"
    if new:
        return "files written, tidied by the next export"
    if old and head_old:
        return "nothing changed, exported again"
    return "fold done, files exported by the next export"


def test_export_cut_short_refuses_a_file_edited_since_and_says_how_to_give_it_up(tmp_path, monkeypatch, capsys):
    fork = make(tmp_path, monkeypatch, None)
    _export_scenario(fork)
    saved = tmp_path / "saved"
    shutil.copytree(fork.root, saved, symlinks=True)
    faulty = Faulty(install_hook(tmp_path / "hook"), {}, fork.protected())
    _, steps = faulty.count("-C", str(fork.root), "export", log=tmp_path / "log")
    post = fork.snapshot()
    shutil.rmtree(fork.root)
    shutil.copytree(saved, fork.root, symlinks=True)
    pre = fork.snapshot()
    # killed before its second rename into the protected files: one file written, the others waiting
    second = [i for i, s in enumerate(steps, 1) if s.split("\t")[1] == "replace"][1]
    faulty.killed_at(second, "-C", str(fork.root), "export")
    mid = fork.snapshot()
    waiting = [p for p in mid if p.suffix == ".patch" and mid[p] == pre[p] != post.get(p)]
    assert waiting and any(mid[p] == post[p] != pre.get(p) for p in mid), "not killed halfway through the write"
    waiting[0].write_bytes(mid[waiting[0]] + b"\n")  # an edit that keeps its subject: the export still renames it
    edited = fork.snapshot()
    assert _cli(fork.root, "export") == 6
    err = capsys.readouterr().err
    rel = waiting[0].relative_to(fork.root).as_posix()
    assert len(err.splitlines()) == 1 and rel in err and "Traceback" not in err, err
    assert fork.snapshot() == edited  # nothing lost
    give_up = err.split("`")[1]  # the one quoted command
    assert give_up.startswith("rm -rf ") and subprocess.run(give_up, shell=True).returncode == 0, err
    assert _cli(fork.root, "export") == 0, capsys.readouterr()
    assert fork.snapshot() == post and _leftovers(fork.root) == []


def test_export_upstream_killed_at_every_step_is_made_again(tmp_path, monkeypatch, capsys):
    fork = make(tmp_path, monkeypatch, None)  # its patch 3 is fork-only: the others are applied alone first
    dest = tmp_path / "out"
    roots = [tmp_path / "out", tmp_path / ("out" + PARTIAL_SUFFIX), fork.root / "build"]
    faulty = Faulty(install_hook(tmp_path / "hook"), {}, roots)
    proc, steps = faulty.count("-C", str(fork.root), "export", "--upstream", str(dest), log=tmp_path / "log")
    assert proc.returncode == 0, proc.stderr
    clean = txn.snapshot([dest])
    assert len(clean) == 3, clean  # two patches and the series
    points = kill_points(len(steps), sample=4)
    with capsys.disabled():  # the sweep's numbers, for the report
        print(f"\nfaults: export --upstream: {len(steps)} kill points, {len(points)} run")
    for n in points:
        label = f"export --upstream killed before step {steps[n - 1]}"
        shutil.rmtree(dest, ignore_errors=True)
        faulty.killed_at(n, "-C", str(fork.root), "export", "--upstream", str(dest))
        assert not dest.exists() or not any(dest.iterdir()), label  # renamed into place only when complete
        assert _cli(fork.root, "export", "--upstream", str(dest)) == 0, f"{label}: {capsys.readouterr()}"
        assert txn.snapshot([dest]) == clean, label
        assert _leftovers(fork.root) == [] and not (tmp_path / ("out" + PARTIAL_SUFFIX)).exists(), label


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
