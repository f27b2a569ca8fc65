"""`follow` on a synthetic registry: each outcome a scheduler acts on, and the checkout left as it was.

Made-up releases are listed by pip from a local folder; the tested rebase runs in a scratch clone
(its test step replaced by a fast one); a branch and a report are left behind, and the user's
checkout is byte-identical.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.fork.core import config, git, registry, series
from tools.fork.follow.cmd_follow import EXIT_MOVED, EXIT_NEEDS_PERSON, EXIT_NOTHING_NEWER, EXIT_TESTS_FAIL
from tools.fork.tests.synthetic import COPY, SERIES, SNAPSHOT_TEST, UPSTREAM, UTILS, const, edited, replace
from tools.fork.tests.synthetic_registry import COUNTS, checkout_state, fake_tests, follow_fork, serve

NEWER = edited(UPSTREAM, {"README.md": const("# vllm-ascend, a later release\n")})
CLASH = edited(UPSTREAM, {COPY: replace("        store(dst[i], data)\n", "        put(dst[i], data)\n")})
MERGED_P2 = edited(UPSTREAM, SERIES[1][1])  # upstream took patch 2 exactly


def follow(fork, tmp_path, *argv):
    """Run `follow` with the report outside the checkout; (result, report)."""
    out = tmp_path / "report"
    r = fork.cli("follow", "--report-dir", str(out), *argv)
    js = out / "follow.json"
    return r, (json.loads(js.read_text()) if js.exists() else None)


def branch_file(fork, branch: str, path: str) -> str:
    return git.out(["show", f"{branch}:{path}"], fork.root)


def test_a_clean_move_to_the_newest_pre_release_leaves_a_tested_branch(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"0.9.0": UPSTREAM, "1.0.0": UPSTREAM, "1.1.0": NEWER, "1.2.0rc1": NEWER})
    tested = fake_tests(monkeypatch)
    before = checkout_state(fork.root)
    r, rep = follow(fork, tmp_path)
    assert r.rc == EXIT_MOVED, r.text
    assert "newer than the pin 1.0.0: 1.1.0, 1.2.0rc1; following the newest, 1.2.0rc1" in r.out
    assert len(tested) == 1 and not tested[0].is_relative_to(fork.root)  # tested in the scratch clone
    assert checkout_state(fork.root) == before
    # the branch: HEAD plus one commit, pinning 1.2.0rc1 by its sha256, with the series exported against it
    head = before["head"]
    assert git.out(["rev-parse", "follow/1.2.0rc1~1"], fork.root) == head
    pinned = branch_file(fork, "follow/1.2.0rc1", "fork.toml")
    assert 'version = "1.2.0rc1"' in pinned and fork.sha["1.2.0rc1"] in pinned
    assert branch_file(fork, "follow/1.2.0rc1", "patches/series").split() == fork.names
    for name in fork.names:  # the same changes, re-exported: same patch-ids
        assert series.patch_id(branch_file(fork, "follow/1.2.0rc1", f"patches/{name}").encode() + b"\n") == (
            series.patch_id(fork.patch(name))
        )
    assert git.out(["log", "-1", "--format=%an <%ae>", "follow/1.2.0rc1"], fork.root) == (
        "vllm-ascend-fork follow <follow@fork.invalid>"  # no identity on this machine: the tooling's own
    )
    subject = git.out(["log", "-1", "--format=%s", "follow/1.2.0rc1"], fork.root)
    assert subject == "follow: move the series onto vllm-ascend 1.2.0rc1 (from 1.0.0), tests green"
    # the report
    assert (rep["status"], rep["exit_code"], rep["version"], rep["from"]) == ("moved", 0, "1.2.0rc1", "1.0.0")
    assert rep["branch"] == "follow/1.2.0rc1" and rep["commit"] == git.out(["rev-parse", "follow/1.2.0rc1"], fork.root)
    assert [p["kind"] for p in rep["patches"]] == ["applied"] * 3
    assert [p["outcome"] for p in rep["patches"]] == ["applied cleanly"] * 3
    assert rep["sha256"] == fork.sha["1.2.0rc1"] and rep["first_use"] is True
    assert rep["vllm"] == "1.2.0"  # the X.Y.Z rule: the synthetic release has no versioning policy
    assert rep["tests"]["counts"]["base"]["passed"] == 40 and rep["tests"]["regressed"] == []
    assert rep["wall_s"] > 0
    md = (tmp_path / "report" / "follow.md").read_text()
    assert md.startswith("## Follow vllm-ascend 1.2.0rc1: moved, tests green")
    assert "| upstream's CPU suite, fork | 40 | 1 | 0 | 3 |" in md
    assert md in r.out  # printed as well
    # a second run refuses (the branch exists) without running anything
    r2, _ = follow(fork, tmp_path)
    assert r2.rc == 6 and "branch follow/1.2.0rc1 exists already" in r2.err and len(tested) == 1


def test_a_conflict_needs_a_person_and_leaves_no_branch(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"1.0.0": UPSTREAM, "1.1.0": CLASH})
    tested = fake_tests(monkeypatch)
    before = checkout_state(fork.root)
    r, rep = follow(fork, tmp_path)
    assert r.rc == EXIT_NEEDS_PERSON, r.text
    assert checkout_state(fork.root) == before
    assert git.rev(fork.root, "refs/heads/follow/1.1.0") is None and tested == []
    p1, p2, p3 = rep["patches"]
    assert rep["status"] == "conflict"
    assert p1["kind"] == "conflict" and p1["tried"] == [f"patches/{fork.names[0]}"]
    assert p1["files"] == [COPY]
    assert p2["kind"] == p3["kind"] == "not reached"
    md = (tmp_path / "report" / "follow.md").read_text()
    assert "NEEDS A PERSON: a patch conflicts" in md and f"versions tried: `patches/{fork.names[0]}`" in md
    assert "rebase --onto 1.1.0" in md and "Not run: the rebase stopped before them." in md
    assert rep["tests"]["counts"] == {} and rep["tests"]["failures"] == []


def test_a_conflict_names_every_version_tried(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"1.0.0": UPSTREAM, "1.1.0": CLASH})
    variant = fork.root / "patches" / "bases" / "0.9.0" / fork.names[0]  # another version of patch 1 in the repo
    variant.parent.mkdir(parents=True)
    variant.write_bytes(fork.patch(fork.names[0]).replace(b"# all loads before any store", b"# loads first"))
    git.run(["add", "-A"], fork.root)
    git.run(["commit", "-q", "-m", "a variant"], fork.root)
    fake_tests(monkeypatch)
    r, rep = follow(fork, tmp_path)
    assert r.rc == EXIT_NEEDS_PERSON, r.text
    assert rep["patches"][0]["tried"] == [f"patches/{fork.names[0]}", f"patches/bases/0.9.0/{fork.names[0]}"]


def test_a_patch_merged_upstream_is_reported_with_its_evidence(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"1.0.0": UPSTREAM, "1.1.0": MERGED_P2})
    fake_tests(monkeypatch)
    before = checkout_state(fork.root)
    r, rep = follow(fork, tmp_path)
    assert r.rc == EXIT_MOVED, r.text
    assert checkout_state(fork.root) == before
    p2 = rep["patches"][1]
    pid = series.patch_id(fork.patch(fork.names[1]))
    assert p2["kind"] == "already upstream" and p2["outcome"] == "already upstream (dropped)"
    assert p2["evidence"] == [
        f"upstream's own diff 1.0.0..1.1.0 over {SNAPSHOT_TEST}, {UTILS} has the same patch-id {pid[:12]}"
    ]
    # on the branch the new pin no longer carries it; 1.0.0 keeps it as its own variant (renumbered
    # after patch 1, as rebase names a variant-only patch), the same change
    kept = "0001a-" + fork.names[1].split("-", 1)[1]
    assert branch_file(fork, "follow/1.1.0", "patches/series").split()[1] == kept
    assert kept not in git.out(["ls-tree", "--name-only", "follow/1.1.0", "patches/"], fork.root)
    variant = branch_file(fork, "follow/1.1.0", f"patches/bases/1.0.0/{kept}")
    assert series.patch_id(variant.encode() + b"\n") == pid
    md = (tmp_path / "report" / "follow.md").read_text()
    assert f"| 2 | `{fork.names[1]}` | already upstream (dropped) |" in md and pid[:12] in md


def test_failing_tests_need_a_person_and_name_the_test_and_its_patch(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"1.0.0": UPSTREAM, "1.1.0": NEWER})
    failing = f"{SNAPSHOT_TEST}::test_snapshot"
    fake_tests(monkeypatch, failing=failing)
    before = checkout_state(fork.root)
    r, rep = follow(fork, tmp_path)
    assert r.rc == EXIT_TESTS_FAIL, r.text
    assert checkout_state(fork.root) == before
    assert git.rev(fork.root, "refs/heads/follow/1.1.0") is None
    assert rep["status"] == "tests-fail" and [p["kind"] for p in rep["patches"]] == ["applied"] * 3
    assert rep["tests"]["counts"] == {"series": {**COUNTS["series"], "passed": 1, "failed": 1}}
    (failure,) = rep["tests"]["failures"]
    assert failure["test"] == failing and failure["patch"] == fork.names[1]
    md = (tmp_path / "report" / "follow.md").read_text()
    assert f"- `{failing}`: failed (patch `{fork.names[1]}`): assert [2, 3] == [1, 2]" in md


def test_nothing_newer(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"0.9.0": UPSTREAM, "1.0.0": UPSTREAM, "1.0.0rc1": UPSTREAM})
    tested = fake_tests(monkeypatch)
    before = checkout_state(fork.root)
    r = fork.cli("follow")
    assert r.rc == EXIT_NOTHING_NEWER, r.text
    assert "nothing newer than 1.0.0 on the package registry (newest listed: 1.0.0)" in r.out
    assert checkout_state(fork.root) == before and tested == []


def test_an_older_release_named_on_purpose_with_the_report_in_build(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"0.9.0": NEWER, "1.0.0": UPSTREAM, "1.1.0": NEWER})
    fake_tests(monkeypatch)
    report_dir = fork.root / "build" / "follow" / "0.9.0"
    before = checkout_state(fork.root, leave_out=report_dir)
    r = fork.cli("follow", "--release", "v0.9.0")
    assert r.rc == EXIT_MOVED, r.text
    assert checkout_state(fork.root, leave_out=report_dir) == before  # only build/follow/0.9.0 is new
    assert json.loads((report_dir / "follow.json").read_text())["status"] == "moved"
    assert 'version = "0.9.0"' in branch_file(fork, "follow/0.9.0", "fork.toml")
    assert config.load(fork.root).pin.version == "1.0.0"


def test_bad_input(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"1.0.0": UPSTREAM})
    assert fork.cli("follow", "--release", "latest").rc == 2
    assert fork.cli("follow", "--release", "1.0.0").rc == 2  # the pin itself
    git.run(["checkout", "-q", "--orphan", "empty"], fork.root)  # no commit to clone
    assert fork.cli("follow", "--release", "1.1.0").rc == 2


def test_a_registry_without_the_package_is_exit_5(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"1.0.0": UPSTREAM})
    (tmp_path / "empty").mkdir()
    serve(monkeypatch, tmp_path / "empty")
    r = fork.cli("follow")
    assert r.rc == 5 and "could not list the releases of vllm-ascend on the package registry" in r.err


def test_an_unknown_release_is_an_error_first_and_its_report_has_no_empty_field(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"1.0.0": UPSTREAM, "1.1.0": NEWER})
    tested = fake_tests(monkeypatch)
    # pip's download helper: this Python (it has the build tools the helper venv would get from the registry)
    monkeypatch.setattr(registry, "helper_python", lambda: Path(sys.executable))
    before = checkout_state(fork.root, leave_out=fork.root / "build")
    r = fork.cli("rebase", "--onto", "9.9.9")
    assert r.rc == 2 and r.out == "", r.text  # nothing said before the error ("downloading ...")
    assert r.err.strip().splitlines() == [
        "fork rebase: error: vllm-ascend 9.9.9 is not a release on the package registry (newest: 1.1.0)"
    ]
    r, rep = follow(fork, tmp_path, "--release", "9.9.9")
    assert r.rc == 2 and rep["status"] == "failed" and "9.9.9 is not a release" in rep["message"], r.text
    assert all(value not in ("", None) for value in rep.values()), rep  # no field without a value
    md = (tmp_path / "report" / "follow.md").read_text()
    assert "sha256 ``" not in md and "sha256" not in md, md
    assert checkout_state(fork.root, leave_out=fork.root / "build") == before and tested == []


def test_a_report_dir_that_is_a_file_is_refused_and_left_as_it_was(tmp_path, monkeypatch):
    fork = follow_fork(tmp_path, monkeypatch, {"1.0.0": UPSTREAM, "1.1.0": NEWER})
    tested = fake_tests(monkeypatch)
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"a user's file\n")
    for where in (notes, notes / "sub"):
        r = fork.cli("follow", "--report-dir", str(where))
        assert r.rc == 2 and len(r.err.strip().splitlines()) == 1 and "is not a directory" in r.err, r.text
    assert notes.read_bytes() == b"a user's file\n"
    assert tested == [] and not git.rev(fork.root, "refs/heads/follow/1.1.0")
