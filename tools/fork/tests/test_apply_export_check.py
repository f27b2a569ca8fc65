"""apply / export / check on a synthetic upstream: behaviour and every failure mode of check."""

from __future__ import annotations

import re
from pathlib import Path

from tools.fork.tests.conftest import FIX_FILES, make_sdist, new_fork, pr_message, sha256
from tools.fork.tests.synthetic import staged_leftovers


def test_apply_materializes_base_and_series(fork_with_patch):
    fork = fork_with_patch
    log = fork.git("log", "--format=%s").splitlines()
    assert log == ["[Ops][BugFix] Guard the copy", "upstream 1.0.0"]
    assert fork.git("tag") == "v1.0.0"
    assert (fork.tree / "vllm_ascend/ops/memmove.py").read_text() == FIX_FILES["vllm_ascend/ops/memmove.py"]
    # sdist packaging artefacts are not part of the base commit
    assert "PKG-INFO" not in fork.git("ls-files").splitlines()
    assert "vllm_ascend/_version.py" not in fork.git("ls-files").splitlines()


def test_apply_is_idempotent(fork_with_patch):
    fork = fork_with_patch
    head = fork.git("rev-parse", "HEAD")
    out = fork.run("apply").stdout
    assert "up to date" in out
    assert fork.git("rev-parse", "HEAD") == head


def test_apply_from_scratch_gives_identical_commits(fork_with_patch, tmp_path):
    fork = fork_with_patch
    one, two = tmp_path / "one", tmp_path / "two"
    fork.run("apply", "--into", str(one))
    fork.run("apply", "--into", str(two))
    assert fork.git("rev-parse", "HEAD", cwd=one) == fork.git("rev-parse", "HEAD", cwd=two)


def test_apply_refuses_local_edits_and_force_discards(fork_with_patch):
    fork = fork_with_patch
    (fork.tree / "vllm_ascend/envs.py").write_text("edited\n")
    proc = fork.run("apply", check=False)
    assert proc.returncode == 6
    assert "local edits" in proc.stderr and "vllm_ascend/envs.py" in proc.stderr
    assert (fork.tree / "vllm_ascend/envs.py").read_text() == "edited\n"
    fork.git("commit", "-qam", "local commit")
    proc = fork.run("apply", check=False)
    assert proc.returncode == 6 and "not exported" in proc.stderr
    fork.run("apply", "--force")
    assert fork.git("log", "-1", "--format=%s") == "[Ops][BugFix] Guard the copy"


def test_apply_reapplies_when_series_changes(fork_with_patch):
    fork = fork_with_patch
    fork.git("add", "-A", cwd=fork.root)  # the series was committed: dropping a patch loses nothing
    fork.git("commit", "-qm", "the series", cwd=fork.root)
    (fork.root / "patches" / "series").write_text("")
    (fork.root / "patches" / "0001-Ops-BugFix-Guard-the-copy.patch").unlink()
    out = fork.run("apply").stdout
    assert "0 patch(es): reapplied" in out
    assert fork.git("log", "--format=%s").splitlines() == ["upstream 1.0.0"]


def test_apply_base_only_and_local_sdist(fork_with_patch, tmp_path):
    fork = fork_with_patch
    sdist = next((fork.cache / "sdists").glob("*.tar.gz"))
    moved = tmp_path / "elsewhere.tar.gz"
    sdist.rename(moved)
    base = tmp_path / "base"
    out = fork.run("apply", "--base-only", "--into", str(base), "--sdist", str(moved)).stdout
    assert "local file" in out
    assert fork.git("log", "--format=%s", cwd=base) == "upstream 1.0.0"


def test_apply_from_checkout(fork_with_patch, tmp_path):
    fork = fork_with_patch
    checkout = tmp_path / "checkout"
    fork.run("apply", "--base-only", "--into", str(checkout))
    out = fork.run("apply", "--into", str(tmp_path / "t"), "--checkout", str(checkout)).stdout
    assert "checkout" in out
    assert (tmp_path / "t/vllm_ascend/ops/memmove.py").exists()


def test_hash_mismatch_is_refused_and_names_both_hashes(fork_with_patch, tmp_path):
    fork = fork_with_patch
    sdist = next((fork.cache / "sdists").glob("*.tar.gz"))
    sdist.write_bytes(sdist.read_bytes() + b"tampered")
    before = fork.protected()
    proc = fork.run("apply", "--into", str(tmp_path / "t"), check=False)
    assert proc.returncode == 5
    assert "sha256 mismatch" in proc.stderr and "expected" in proc.stderr and "actual" in proc.stderr
    assert not (tmp_path / "t").exists()
    assert fork.protected() == before


def test_registry_unreachable_says_what_to_do(fork, tmp_path):
    for f in (fork.cache / "sdists").glob("*"):
        f.unlink()
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "1", "PIP_CONFIG_FILE": "/dev/null"}  # fmt: skip
    proc = fork.run("apply", check=False, env=env)
    assert proc.returncode == 5
    assert "could not download" in proc.stderr and "--sdist" in proc.stderr
    assert not fork.tree.exists()


def test_export_is_deterministic(fork_with_patch):
    fork = fork_with_patch
    before = fork.protected()
    assert "up to date" in fork.run("export").stdout
    fork.run("apply", "--force")
    fork.run("export")
    assert fork.protected() == before
    text = (fork.root / "patches/0001-Ops-BugFix-Guard-the-copy.patch").read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [Ops][BugFix] Guard the copy" in text
    assert not re.search(r"^-- $", text, re.M)  # no git version signature


def test_export_writes_overlay_and_folds_overlay_edits(fork_with_patch):
    fork = fork_with_patch
    overlay = fork.root / "vllm_ascend/ops/memmove.py"
    assert overlay.read_text() == FIX_FILES["vllm_ascend/ops/memmove.py"]
    overlay.write_text("def memmove(dst, src):\n    dst[:] = bytes(src)\n")
    out = fork.run("export").stdout
    assert "folded overlay edit vllm_ascend/ops/memmove.py" in out
    assert fork.git("show", "HEAD:vllm_ascend/ops/memmove.py") == "def memmove(dst, src):\n    dst[:] = bytes(src)"
    assert len(fork.git("log", "--format=%s").splitlines()) == 2  # folded, not a new commit
    assert "bytes(src)" in (fork.root / "patches/0001-Ops-BugFix-Guard-the-copy.patch").read_text()
    fork.run("check")


def test_export_refuses_edits_in_both_places(fork_with_patch):
    fork = fork_with_patch
    (fork.root / "vllm_ascend/ops/memmove.py").write_text("overlay\n")
    (fork.tree / "vllm_ascend/ops/memmove.py").write_text("tree\n")
    fork.git("commit", "-qam", "fixup! [Ops][BugFix] Guard the copy")
    before = fork.protected()
    proc = fork.run("export", check=False)
    assert proc.returncode == 6 and "edited both" in proc.stderr
    assert fork.protected() == before


def test_export_refuses_uncommitted_changes(fork_with_patch):
    fork = fork_with_patch
    (fork.tree / "vllm_ascend/envs.py").write_text("dirty\n")
    before = fork.protected()
    proc = fork.run("export", check=False)
    assert proc.returncode == 6 and "uncommitted" in proc.stderr
    assert fork.protected() == before


def test_export_new_patch_and_dropped_patch(fork_with_patch):
    fork = fork_with_patch
    fork.commit_in_tree(pr_message("[Misc][Feature] Add a knob"), {"vllm_ascend/knob.py": "KNOB = 1\n"})
    fork.run("export")
    assert (fork.root / "patches/series").read_text().splitlines() == [
        "0001-Ops-BugFix-Guard-the-copy.patch",
        "0002-Misc-Feature-Add-a-knob.patch",
    ]
    assert (fork.root / "vllm_ascend/knob.py").exists()
    fork.git("reset", "-q", "--hard", "HEAD~1")
    fork.run("export")
    assert not (fork.root / "vllm_ascend/knob.py").exists()
    assert not (fork.root / "patches/0002-Misc-Feature-Add-a-knob.patch").exists()
    fork.run("check")


def test_export_failure_midway_leaves_everything(fork_with_patch, monkeypatch):
    """A failure while writing (here: the 2nd staged file fails) changes nothing protected."""
    import os

    from tools.fork.core import config
    from tools.fork.core import journal as journal_mod
    from tools.fork.queue import cmd_export as export

    fork = fork_with_patch
    (fork.root / "vllm_ascend/ops/memmove.py").write_text("changed\n")
    fork.commit_in_tree(pr_message("[Misc][Feature] Add a knob"), {"vllm_ascend/knob.py": "KNOB = 1\n"})
    before = fork.protected()
    real_open, calls = open, []
    staging = fork.root / "build" / export.WORK

    def failing_open(path, mode="r", *a, **k):
        if "w" in mode and staging in Path(path).parents:
            calls.append(path)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(journal_mod, "open", failing_open, raising=False)
    monkeypatch.setenv("FORK_CACHE", str(fork.cache))
    cfg = config.load(fork.root)
    try:
        export.export(cfg, fork.tree)
    except OSError as exc:
        assert exc.errno == 28
    else:
        raise AssertionError("export did not fail")
    assert len(calls) == 2
    assert fork.protected() == before
    assert staged_leftovers(fork.root) == []
    assert os.path.exists(fork.tree)


def test_check_passes_on_a_good_series(fork_with_patch):
    out = fork_with_patch.run("check").stdout
    assert "1 patch(es): ok" in out


def _problems(fork) -> str:
    proc = fork.run("check", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return proc.stdout


def test_check_patch_not_in_series(fork_with_patch):
    fork = fork_with_patch
    (fork.root / "patches/0009-Stray.patch").write_text("x")
    assert "patches/0009-Stray.patch is not listed in patches/series" in _problems(fork)


def test_check_series_names_missing_patch(fork_with_patch):
    fork = fork_with_patch
    (fork.root / "patches/series").write_text("0001-Ops-BugFix-Guard-the-copy.patch\n0002-Gone.patch\n")
    assert "lists 0002-Gone.patch" in _problems(fork)


def test_check_patch_does_not_apply_names_patch_and_file(fork_with_patch):
    fork = fork_with_patch
    p = fork.root / "patches/0001-Ops-BugFix-Guard-the-copy.patch"
    p.write_text(p.read_text().replace("\n def copy(dst, src):", "\n def copy(dst, source):"))
    out = _problems(fork)
    assert "patch 0001-Ops-BugFix-Guard-the-copy.patch does not apply" in out
    assert "vllm_ascend/ops/copy.py" in out


def test_check_offset_is_reported_with_the_hunk(tmp_path):
    files = dict(__import__("tools.fork.tests.conftest", fromlist=["UPSTREAM_FILES"]).UPSTREAM_FILES)
    fork = new_fork(tmp_path, files=files)
    fork.run("apply")
    envs = (fork.tree / "vllm_ascend/envs.py").read_text().replace("# line 30\n", "# line 30\nKNOB = 1\n")
    fork.commit_in_tree(pr_message("[Misc][Feature] Add a knob"), {"vllm_ascend/envs.py": envs})
    fork.run("export")
    # Re-pin to a release with two more lines above the hunk: it still applies, at an offset.
    shifted = dict(files, **{"vllm_ascend/envs.py": "# new 1\n# new 2\n" + files["vllm_ascend/envs.py"]})
    for f in (fork.cache / "sdists").glob("*"):
        f.unlink()
    digest = sha256(make_sdist(fork.cache / "sdists", "1.0.0", shifted))
    toml = fork.root / "fork.toml"
    toml.write_text(re.sub(r'sha256 = "[0-9a-f]+"', f'sha256 = "{digest}"', toml.read_text()))
    out = _problems(fork)
    assert "applies with an offset" in out and "vllm_ascend/envs.py" in out and "offset +2 lines" in out


def test_check_overlay_differs(fork_with_patch):
    fork = fork_with_patch
    (fork.root / "vllm_ascend/ops/memmove.py").write_text("edited\n")
    out = _problems(fork)
    assert "vllm_ascend/ops/memmove.py: overlay differs from patch 0001-Ops-BugFix-Guard-the-copy.patch" in out


def test_check_overlay_file_without_patch(fork_with_patch):
    fork = fork_with_patch
    (fork.root / "vllm_ascend/ops/stray.py").write_text("x\n")
    assert "vllm_ascend/ops/stray.py: in the overlay but no patch adds it" in _problems(fork)


def test_check_added_file_missing_from_overlay(fork_with_patch):
    fork = fork_with_patch
    (fork.root / "tests/ut/ops/test_memmove.py").unlink()
    assert "tests/ut/ops/test_memmove.py: added by patch 0001" in _problems(fork)


def test_later_patch_may_change_an_added_file(fork_with_patch):
    """The overlay holds the file as the whole series leaves it; an overlay edit folds into the
    last patch that touched the file (git-absorb semantics)."""
    fork = fork_with_patch
    fork.commit_in_tree(
        pr_message("[Ops][BugFix] Touch it again"), {"vllm_ascend/ops/memmove.py": "def memmove(d, s):\n    pass\n"}
    )
    fork.run("export")
    assert (fork.root / "vllm_ascend/ops/memmove.py").read_text() == "def memmove(d, s):\n    pass\n"
    assert "2 patch(es): ok" in fork.run("check").stdout
    (fork.root / "vllm_ascend/ops/memmove.py").write_text("def memmove(d, s):\n    return d\n")
    fork.run("export")
    assert "2 patch(es): ok" in fork.run("check").stdout
    second = sorted((fork.root / "patches").glob("0002-*.patch"))[0].read_text()
    assert "+    return d" in second


def test_check_conventions(fork_with_patch):
    fork = fork_with_patch
    p = fork.root / "patches/0001-Ops-BugFix-Guard-the-copy.patch"
    text = p.read_text()
    p.write_text(
        text.replace("Subject: [Ops][BugFix] Guard the copy", "Subject: [Ops] Guard the copy")
        .replace("### Does this PR introduce _any_ user-facing change?\n", "")
        .replace("Signed-off-by: Test Dev <dev@example.com>\n", "")
    )
    out = _problems(fork)
    assert "subject '[Ops] Guard the copy' is not `[Module][Action] Title`" in out
    assert "body lacks the PR section '### Does this PR introduce _any_ user-facing change?'" in out
    assert "no `Signed-off-by:` line" in out


def test_check_signoff_must_be_the_authors(fork_with_patch):
    fork = fork_with_patch
    p = fork.root / "patches/0001-Ops-BugFix-Guard-the-copy.patch"
    p.write_text(p.read_text().replace("Signed-off-by: Test Dev <dev@example.com>", "Signed-off-by: Someone <s@e.org>"))
    assert "no `Signed-off-by: Test Dev <dev@example.com>` from the author" in _problems(fork)


def test_check_reexport_differs(fork_with_patch):
    fork = fork_with_patch
    p = fork.root / "patches/0001-Ops-BugFix-Guard-the-copy.patch"
    p.write_text(p.read_text().replace(" 3 files changed", " 3 files changed "))
    assert "re-export differs at line" in _problems(fork)


def test_check_fork_only_entry_must_name_a_patch(fork_with_patch):
    fork = fork_with_patch
    toml = fork.root / "fork.toml"
    toml.write_text(toml.read_text() + '\n[patches."0007-Missing.patch"]\nfork_only = true\n')
    assert "fork.toml marks 0007-Missing.patch fork-only" in _problems(fork)
