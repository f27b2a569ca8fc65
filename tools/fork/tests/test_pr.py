"""`pr` and `export --upstream` on a synthetic fork (tools/fork/tests/synthetic.py).

Oracles: the PR text is the commit message we wrote, less its subject and sign-off; the upstream
export must `git am` onto the plain release and give exactly the files computed in Python from
the upstreamable patches' edits.
"""

from __future__ import annotations

from tools.fork.core import git, materialize, upstream
from tools.fork.core.config import load
from tools.fork.core.errors import EXIT_BAD_INPUT, EXIT_FAILED
from tools.fork.tests.synthetic import SERIES, UPSTREAM, Fork, edited, message, replace

A = "1.0"


def make(tmp_path, monkeypatch, patches=SERIES, fork_only=(3,)) -> Fork:
    fork = Fork(tmp_path, monkeypatch, {A: UPSTREAM}, A, [A])
    fork.names = fork.make_series(patches, fork_only)
    return fork


def expected_pr(subject: str) -> str:
    body = message(subject).split("\n", 2)[2]  # drop the subject line and the blank after it
    body = body.replace(f"\n\nSigned-off-by: {'Fork Dev'} <dev@example.com>\n", "\n")
    return f"{subject}\n\n{body}"


def test_pr_prints_title_and_body_ready_to_paste(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch)
    r = fork.ok("pr", "1")
    assert r.out == expected_pr(SERIES[0][0])
    assert "Signed-off-by" not in r.out
    assert r.out.splitlines()[0] == "[Ops][BugFix] Guard overlapping copies in batch_copy"
    assert r.err == ""  # nothing but the text to paste, on either stream (a header used to land in pasted text)
    assert "warning" not in r.err


def test_pr_by_name_title_and_body_parts(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch)
    assert fork.ok("pr", fork.names[1]).out == expected_pr(SERIES[1][0])
    assert fork.ok("pr", "snapshot").out == expected_pr(SERIES[1][0])  # a unique part of a name
    assert fork.ok("pr", "2", "--title").out == SERIES[1][0] + "\n"
    assert fork.ok("pr", "2", "--body").out == expected_pr(SERIES[1][0]).split("\n\n", 1)[1]


def test_pr_refuses_fork_only_and_bad_references(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch)
    r = fork.cli("pr", "3")
    assert r.rc == EXIT_BAD_INPUT and "fork-only (deployment alias)" in r.err and r.out == ""
    assert fork.cli("pr", "4").rc == EXIT_BAD_INPUT
    assert fork.cli("pr", "0").rc == EXIT_BAD_INPUT
    r = fork.cli("pr", "BugFix")
    assert r.rc == EXIT_BAD_INPUT and "matches several patches" in r.err
    assert fork.cli("pr", "nothing-like-this").rc == EXIT_BAD_INPUT
    assert fork.cli("pr").rc == EXIT_BAD_INPUT


def test_pr_all_leaves_fork_only_out(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch)
    r = fork.ok("pr", "--all")
    assert r.out == expected_pr(SERIES[0][0]) + "\n" + "=" * 78 + "\n\n" + expected_pr(SERIES[1][0])
    assert f"patch 3 {fork.names[2]} is fork-only" in r.err


def test_pr_warns_about_text_upstreams_bot_deletes(tmp_path, monkeypatch):
    fork = Fork(tmp_path, monkeypatch, {A: UPSTREAM}, A, [A])
    fork.ok("apply")
    subject, edits = SERIES[0]
    fork.commit(fork.tree, subject, edits, msg=message(subject, tested="- vLLM version: 0.23.0, pytest passed"))
    fork.ok("export")
    r = fork.cli("pr", "1")
    assert r.rc == EXIT_FAILED and "deletes body lines containing '- vLLM '" in r.err
    assert "- vLLM version" in r.out  # still printed; the warning says what will happen to it


def test_export_upstream_is_a_clean_am_series_without_fork_only(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch)
    dest = tmp_path / "for-upstream"
    r = fork.ok("export", "--upstream", str(dest))
    assert "2 upstreamable patch(es)" in r.out and fork.names[2] in r.out
    names = (dest / "series").read_text().split()
    assert names == fork.names[:2] and sorted(p.name for p in dest.glob("*.patch")) == names
    for name in names:
        assert b"\nSigned-off-by: Fork Dev <dev@example.com>\n" in (dest / name).read_bytes()
    # Oracle: git am onto the plain release gives the release + the upstreamable edits.
    cfg = load(fork.root)
    tree = tmp_path / "upstream-checkout"
    materialize.create_base(upstream.obtain(cfg).source, tree)
    git.run(["am", "--keep-non-patch", *[str(dest / n) for n in names]], tree)
    assert fork.tree_files(tree) == edited(edited(UPSTREAM, SERIES[0][1]), SERIES[1][1])
    subjects = git.out(["log", "--reverse", "--format=%s", "v1.0..HEAD"], tree).splitlines()
    assert subjects == [SERIES[0][0], SERIES[1][0]]
    r = fork.cli("export", "--upstream", str(dest))  # refuses to write into a non-empty directory
    assert r.rc != 0 and "not empty" in r.err


def test_export_upstream_refuses_a_patch_that_needs_a_fork_only_one(tmp_path, monkeypatch):
    needs_alias = (
        "[Misc][BugFix] Document the alias",
        {"vllm_ascend/envs.py": replace("lambda: 0,\n", "lambda: 0,  # the deployment alias\n")},
    )
    fork = make(tmp_path, monkeypatch, [SERIES[0], SERIES[2], needs_alias], fork_only=(2,))
    dest = tmp_path / "for-upstream"
    r = fork.cli("export", "--upstream", str(dest))
    assert r.rc == EXIT_BAD_INPUT
    assert "without the fork-only patches" in r.err and fork.names[2] in r.err
    assert not dest.exists()
