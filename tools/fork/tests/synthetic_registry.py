"""A synthetic package registry for `follow`, and a fork repository in git over its releases.

The registry is a local folder of made-up vllm-ascend sdists, which pip lists as it lists the real
registry (PIP_NO_INDEX + PIP_FIND_LINKS, no configuration file, no network); the fork is a
synthetic.Fork committed in git, its series made as a maintainer makes one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tools.fork.core import git
from tools.fork.rebase import gate
from tools.fork.tests.synthetic import Fork

PIN = "1.0.0"


def follow_fork(tmp_path: Path, monkeypatch, releases: dict[str, dict[str, str]]) -> Fork:
    """A fork pinned to 1.0.0 with the synthetic series, committed in git; the registry serves `releases`
    (the sdists in the fork's cache folder, so the rebase needs no download)."""
    fork = Fork(tmp_path, monkeypatch, releases, PIN, [PIN])
    fork.names = fork.make_series()
    (fork.root / ".gitignore").write_text("/build/\n")
    git.run(["init", "-q", "-b", "main"], fork.root)
    git.run(["add", "-A"], fork.root)
    git.run(["commit", "-q", "-m", "the fork"], fork.root)
    serve(monkeypatch, fork.cache / "sdists")
    for var in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.delenv(var, raising=False)  # a fresh machine: nobody named
    return fork


def serve(monkeypatch, folder: Path) -> None:
    """pip's listing comes from `folder` alone: no configuration file, no index."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)


COUNTS = {
    "series": {"passed": 2, "failed": 0, "error": 0, "skipped": 0, "xfailed": 0},
    "base": {"passed": 40, "failed": 1, "error": 0, "skipped": 3, "xfailed": 0},
    "fork": {"passed": 40, "failed": 1, "error": 0, "skipped": 3, "xfailed": 0},
}


def fake_tests(monkeypatch, *, failing: str | None = None) -> list[Path]:
    """Replace the rebase's test step (upstream's suites) with a fast one; `failing`: a test id that fails,
    owned by the patch whose commit added its file. Returns the trees it was asked to test."""
    seen: list[Path] = []

    def run(cfg, tree, version, source, base_sha256, commit_patch, **kwargs):
        seen.append(tree)
        report = gate.Report(ok=True, counts={k: dict(v) for k, v in COUNTS.items()})
        report.summary = [
            "the series' own tests (2 file(s)): 2 passed, 0 failed, 0 errors, 0 skipped",
            "upstream's CPU suite: base 40 passed, 1 failed, 0 errors, 3 skipped | fork 40 passed, 1 failed, "
            "0 errors, 3 skipped; 0 regressed, 0 lost",
        ]
        if failing is not None:
            owner = gate.owners(tree, version, [failing.split("::")[0]], commit_patch)
            report.ok = False  # the gate stops after the series' own tests
            report.counts = {"series": dict(COUNTS["series"], passed=1, failed=1)}
            report.summary = ["the series' own tests (2 file(s)): 1 passed, 1 failed, 0 errors, 0 skipped"]
            report.failures = [gate.Failure(failing, "failed", "assert [2, 3] == [1, 2]",
                                                   owner.get(failing.split("::")[0]))]  # fmt: skip
        return report

    monkeypatch.setattr(gate, "run", run)
    return seen


def checkout_state(root: Path, *, leave_out: Path | None = None) -> dict:
    """Everything of a checkout a run must leave as it was: status, HEAD, index, branches, every file's
    bytes (build/ included; `.git` itself and `leave_out` not)."""
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] == ".git" or (leave_out is not None and p.is_relative_to(leave_out)) or not p.is_file():
            continue
        files[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    quiet = {"GIT_OPTIONAL_LOCKS": "0"}
    return {
        "status": git.run(["status", "--porcelain", "--untracked-files=all"], root, env=quiet).stdout,
        "head": git.out(["rev-parse", "HEAD"], root),
        "symbolic": git.out(["symbolic-ref", "HEAD"], root),
        "index": hashlib.sha256((root / ".git" / "index").read_bytes()).hexdigest(),
        "branches": git.out(["for-each-ref", "--format=%(refname) %(objectname)", "refs/heads/main"], root),
        "files": files,
    }
