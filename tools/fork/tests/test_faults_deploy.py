"""`deploy --to` and `--revert` killed (SIGKILL) at their mutating file steps, and two deploys at once.

After each kill the recovery commands run on copies of the environment: `--revert` must give back
the pre-deploy state and `--to` the deployed state, every path and byte (folders and __pycache__
included; the oracle is tree_state of a clean run), no stray file, RECORD true (its hashes match
the files, and it lists every file of the package and the backup). `--verify` on the killed state
answers in one line which command finishes it (never a loop). faults.py has the hook; FORK_FAULTS=all
(`make faults`) runs every kill point, else a sample.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import time

import pytest

from tools.fork.deploy.check import tree_state
from tools.fork.deploy.target import BACKUP_DIR
from tools.fork.tests.deploy_fixtures import *  # noqa: F401,F403 (fixtures and helpers)
from tools.fork.tests.deploy_fixtures import _offline_cache  # noqa: F401 (an autouse fixture)
from tools.fork.tests.faults import Faulty, install_hook, kill_points


def record_true(site) -> list[str]:
    """What is wrong with RECORD: a hash that does not match its file, a file of the package or backup not listed."""
    (dist,) = site.glob("vllm_ascend-*.dist-info")
    rows = {r[0]: r for r in csv.reader(io.StringIO((dist / "RECORD").read_text())) if r}
    problems = []
    for rel, row in rows.items():
        if len(row) > 1 and row[1]:
            path = site / rel
            if not path.is_file():
                problems.append(f"{rel}: listed with a hash, missing")
            elif record_hash(path.read_bytes()) != row[1]:
                problems.append(f"{rel}: wrong hash")
    for top in ("vllm_ascend", BACKUP_DIR):
        for path in sorted((site / top).rglob("*")) if (site / top).exists() else []:
            rel = path.relative_to(site).as_posix()
            if path.is_file() and rel not in rows and "__pycache__" not in rel:
                problems.append(f"{rel}: not listed")
    return problems


@pytest.fixture
def env(repo, tmp_path):
    site = make_site(tmp_path, PIN, UPSTREAM)
    faulty = Faulty(install_hook(tmp_path / "hook"), {"FORK_CACHE": str(repo["cache"])}, [site])
    pkg = site / "vllm_ascend"
    pre = tree_state(site)
    proc, deploy_steps = faulty.count("-C", str(repo["root"]), "deploy", "--to", str(pkg), log=tmp_path / "log")
    assert proc.returncode == 0, proc.stderr
    post = tree_state(site)
    assert record_true(site) == []
    proc, revert_steps = faulty.count("-C", str(repo["root"]), "deploy", "--revert", str(pkg), log=tmp_path / "log")
    assert proc.returncode == 0, proc.stderr
    assert tree_state(site) == pre and record_true(site) == []
    return {"site": site, "pkg": pkg, "pre": pre, "post": post, "faulty": faulty, "steps": {
        "--to": deploy_steps, "--revert": revert_steps}}  # fmt: skip


def _recovers(repo, capsys, env, tmp_path, label: str) -> None:
    """From the killed state in env["site"]: --verify answers, --revert gives `pre`, --to gives `post`."""
    site = env["site"]
    code, out = deploy(repo, capsys, "--verify", env["pkg"])
    assert "Traceback" not in out and code in (0, 1), f"{label}: --verify: {out}"
    if code == 1 and "FAILED" not in out:
        assert "deploy --revert" in out, f"{label}: --verify names no way out: {out}"
    other = tmp_path / "copy" / "site-packages"
    shutil.rmtree(other.parent, ignore_errors=True)
    shutil.copytree(site, other, symlinks=True)
    code, out = deploy(repo, capsys, "--revert", env["pkg"])
    assert code in (0, 2), f"{label}: --revert exited {code}: {out}"
    assert tree_state(site) == env["pre"], f"{label}: --revert did not give back the original: {out}"
    assert record_true(site) == [], label
    code, out = deploy(repo, capsys, "--to", other / "vllm_ascend")
    assert code == 0 or "already deployed" in out, f"{label}: --to exited {code}: {out}"
    assert tree_state(other) == env["post"], f"{label}: --to did not give the deployed state: {out}"
    assert record_true(other) == [], label
    shutil.rmtree(other.parent)


@pytest.mark.parametrize("verb", ["--to", "--revert"])
def test_killed_at_every_step_recovers(repo, capsys, env, tmp_path, verb):
    steps = env["steps"][verb]
    assert len(steps) > 10, steps  # the hook sees the steps (a hook that counts nothing tests nothing)
    faulty, args = env["faulty"], ("-C", str(repo["root"]), "deploy", verb, str(env["pkg"]))
    with capsys.disabled():  # the sweep's numbers, for the report
        print(f"\nfaults: deploy {verb}: {len(steps)} kill points, {len(kill_points(len(steps)))} run")
    for n in kill_points(len(steps)):
        if verb == "--revert":
            assert deploy(repo, capsys, "--to", env["pkg"])[0] == 0
        faulty.killed_at(n, *args)
        _recovers(repo, capsys, env, tmp_path, f"{verb} killed before step {steps[n - 1]}")


def test_two_deploys_at_once_one_is_refused(repo, capsys, env, tmp_path):
    """The first holds the lock (paused at its first step); the second is refused at once, naming it."""
    faulty, go = env["faulty"], tmp_path / "go"
    args = ["-C", str(repo["root"]), "deploy", "--to", str(env["pkg"])]
    log = tmp_path / "first.log"
    first = subprocess.Popen(
        faulty.argv(*args), cwd=str(tmp_path),
        env=faulty.environ(FORK_FAULT_PAUSE_AT="1", FORK_FAULT_GO=str(go), FORK_FAULT_LOG=str(log)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not log.exists() and time.monotonic() < deadline:  # paused at its first step, holding the lock
            time.sleep(0.05)
        second = faulty.run(*args)
        assert second.returncode == 4, second.stderr
        assert second.stderr.count("\n") == 1 and f"pid {first.pid}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
    finally:
        go.touch()
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert tree_state(env["site"]) == env["post"] and record_true(env["site"]) == []


def test_two_deploys_racing(repo, capsys, env, tmp_path):
    """Started together, unpaused: exactly one deploys, the other is refused (exit 4) or finds it deployed."""
    faulty = env["faulty"]
    args = ["-C", str(repo["root"]), "deploy", "--to", str(env["pkg"])]
    for _ in range(3):
        procs = [
            subprocess.Popen(faulty.argv(*args), cwd=str(tmp_path), env=faulty.environ(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]  # fmt: skip
        results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
        codes = sorted(rc for rc, _ in results)
        assert codes in ([0, 2], [0, 4]), results
        assert all("Traceback" not in err for _, err in results), results
        assert tree_state(env["site"]) == env["post"] and record_true(env["site"]) == []
        assert deploy(repo, capsys, "--revert", env["pkg"])[0] == 0
        assert tree_state(env["site"]) == env["pre"]


# --- bad inputs: one line, a non-zero exit, nothing changed, never a traceback ------------------------


def _deployed(repo, capsys, tmp_path, name="site"):
    site = make_site(tmp_path / name, PIN, UPSTREAM)
    assert deploy(repo, capsys, "--to", site / "vllm_ascend")[0] == 0
    return site


def _one_line(out: str) -> str:
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out, out
    return errors[0]


@pytest.mark.parametrize(
    "damage, code, says",
    [
        (lambda m: m.write_text('{"format": 1, "files": [{"path": "x"}]}'), 2, "damaged"),
        (lambda m: m.write_bytes(m.read_bytes()[:40]), 2, "truncated"),
        (lambda m: (m.parent / "original" / "vllm_ascend" / "envs.py").unlink(), 1, "missing"),
    ],
    ids=["keys-missing", "truncated", "original-deleted"],
)
def test_damaged_backup_is_one_line(repo, capsys, tmp_path, damage, code, says):
    site = _deployed(repo, capsys, tmp_path)
    damage(site / BACKUP_DIR / "manifest.json")
    before = snapshot(site)
    got, out = deploy(repo, capsys, "--revert", site / "vllm_ascend")
    assert got == code and says in _one_line(out), out
    assert snapshot(site) == before


def test_unwritable_site_packages_is_one_line(repo, capsys, tmp_path, monkeypatch):
    """As a non-root user on a root-owned environment: mkdir of the backup fails (simulated: tests may run as root)."""
    site = make_site(tmp_path, PIN, UPSTREAM)
    before = snapshot(site)
    real = os.mkdir

    def denied(path, *args, **kwargs):
        if str(path).endswith(BACKUP_DIR):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", denied)
    got, out = deploy(repo, capsys, "--to", site / "vllm_ascend")
    assert got == 1 and "Permission denied" in _one_line(out), out
    assert snapshot(site) == before


def test_hints_quote_paths_with_spaces(repo, capsys, tmp_path):
    import shlex

    site = make_site(tmp_path / "my env", PIN, UPSTREAM)
    pkg = site / "vllm_ascend"
    code, out = deploy(repo, capsys, "--to", pkg)
    assert code == 0, out
    hint = next(line for line in out.splitlines() if "undo with" in line)
    command = hint.split("undo with `", 1)[1].split("`", 1)[0]
    assert shlex.split(command) == ["deploy", "--revert", str(pkg)], hint
    code, out = deploy(repo, capsys, "--to", pkg)
    assert code == 2 and shlex.quote(str(pkg)) in out, out


# --- a git checkout: the series as commits (`git am`), the HEAD before kept -------------------------


def test_checkout_deploy_killed_at_every_step_recovers(repo, capsys, tmp_path):
    from tools.fork.core import git
    from tools.fork.deploy.target import CHECKOUT_STATE
    from tools.fork.tests.test_deploy_checkout import make_checkout

    root = make_checkout(tmp_path, PIN, UPSTREAM)
    pre = git.out(["rev-parse", "HEAD"], root)
    faulty = Faulty(install_hook(tmp_path / "hook"), {"FORK_CACHE": str(repo["cache"])}, [root / ".git"])
    args = ("-C", str(repo["root"]), "deploy", "--to", str(root))
    proc, steps = faulty.count(*args, log=tmp_path / "log")
    assert proc.returncode == 0, proc.stderr
    post_tree = git.out(["rev-parse", "HEAD^{tree}"], root)
    assert any("git am" in s for s in steps), steps
    with capsys.disabled():  # the sweep's numbers, for the report
        print(f"\nfaults: deploy --to CHECKOUT: {len(steps)} kill points, {len(kill_points(len(steps)))} run")
    state = root / ".git" / CHECKOUT_STATE

    def is_pre(where):
        return git.out(["rev-parse", "HEAD"], where) == pre and git.is_clean(where) and not (
            where / ".git" / CHECKOUT_STATE).exists() and not git.am_in_progress(where)  # fmt: skip

    assert deploy(repo, capsys, "--revert", root)[0] == 0 and is_pre(root)
    for n in kill_points(len(steps)):
        label = f"deploy --to CHECKOUT killed before step {steps[n - 1]}"
        faulty.killed_at(n, *args)
        other = tmp_path / "copy"
        shutil.rmtree(other, ignore_errors=True)
        shutil.copytree(root, other, symlinks=True)
        code, out = deploy(repo, capsys, "--verify", root)
        assert code in (0, 1) and "Traceback" not in out, f"{label}: {out}"
        code, out = deploy(repo, capsys, "--revert", root)
        assert code in (0, 2) and is_pre(root), f"{label}: --revert: {out}"
        assert not state.with_name(state.name + ".tmp").exists(), label
        code, out = deploy(repo, capsys, "--to", other)
        assert code == 0 or "already deployed" in out, f"{label}: --to: {out}"
        assert git.out(["rev-parse", "HEAD^{tree}"], other) == post_tree and git.is_clean(other), label
        assert git.out(["rev-list", "--count", f"{pre}..HEAD"], other) == str(len(SERIES)), label


def test_a_half_written_deploy_tree_is_made_again(repo, capsys, tmp_path):
    """build/deploy/<version> left half-extracted (no git repository) by a killed run of an older tool."""
    tree = repo["root"] / "build" / "deploy" / PIN
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "vllm_ascend").mkdir(parents=True)
    (tree / "vllm_ascend" / "envs.py").write_text("half")
    site = make_site(tmp_path, PIN, UPSTREAM)
    code, out = deploy(repo, capsys, "--to", site / "vllm_ascend")
    assert code == 0 and "making it again" in out, out
    assert deploy(repo, capsys, "--verify", site / "vllm_ascend")[0] == 0
