"""`rebase` and its releases: known, first use and bad ones, and the series around a rebase (check, export)."""

from __future__ import annotations

import os

import pytest

from tools.fork.core import config, git, series
from tools.fork.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_LOCAL_EDITS,
    EXIT_UPSTREAM,
)
from tools.fork.queue import cmd_check
from tools.fork.rebase import write as rebase_write
from tools.fork.tests.synthetic import (
    COPY,
    P2_CODE,
    SERIES,
    SNAPSHOT_TEST,
    UPSTREAM,
    UTILS,
    A,
    B,
    C,
    Fork,
    assert_tree,
    assert_unchanged,
    const,
    edited,
    expected_tree,
    make,
    outcomes,
    replace,
)

# --- the new release: known, first use, bad ----------------------------------------------------------


def test_first_use_sdist_is_recorded_loudly(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, None)
    path, sha = fork.sdist_elsewhere(C, edited(UPSTREAM, {"README.md": const("# 1.2\n")}))
    r = fork.ok("rebase", "--onto", C, "--sdist", str(path))
    assert "TRUST ON FIRST USE" in r.err and sha in r.err
    cfg = config.load(fork.root)
    assert (cfg.pin.version, cfg.pin.sha256) == (C, sha)
    assert [(b.version, b.sha256) for b in cfg.bases] == [(A, fork.sha[A]), (C, sha)]


def test_sdist_of_another_version_is_refused(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, None)
    path, _ = fork.sdist_elsewhere("1.3", UPSTREAM)
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", C, "--sdist", str(path))
    assert r.rc == EXIT_BAD_INPUT and "is version 1.3, not 1.2" in r.err
    assert_unchanged(fork, before)
    assert not fork.work.exists()


def test_hash_mismatch_of_the_base_is_refused(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    cached = fork.cache / "sdists" / f"vllm_ascend-{B}.tar.gz"
    cached.write_bytes(cached.read_bytes() + b"tampered")
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_UPSTREAM and "sha256 mismatch" in r.err and "Nothing was changed" in r.err
    assert_unchanged(fork, before)
    assert not fork.work.exists()


def test_registry_unreachable(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, None)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    before = fork.snapshot()
    r = fork.cli_subprocess("rebase", "--onto", "9.9.9")  # pip writes to the real stderr
    assert r.rc == EXIT_UPSTREAM and "could not download vllm-ascend==9.9.9" in r.err and "--sdist PATH" in r.err
    assert_unchanged(fork, before)
    assert not fork.work.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--onto", A], "already on vllm-ascend 1.0"),
        (["--onto", "latest"], "is not a release version"),
        (["--onto", C, "--checkout", "."], "not a vllm-ascend source tree"),
    ],
)
def test_bad_input(tmp_path, monkeypatch, argv, message):
    fork = make(tmp_path, monkeypatch, None)
    before = fork.snapshot()
    r = fork.cli("rebase", *argv)
    assert r.rc == EXIT_BAD_INPUT and message in r.err
    assert_unchanged(fork, before)


def test_unexported_edits_in_the_fork_tree_are_refused(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    (fork.tree / COPY).write_text("edited\n")
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_LOCAL_EDITS and "python -m tools.fork export" in r.err and COPY in r.err
    assert_unchanged(fork, before)
    assert (fork.tree / COPY).read_text() == "edited\n"


def test_drop_old_base(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {UTILS: P2_CODE})
    fork = make(tmp_path, monkeypatch, b)
    fork.ok("rebase", "--onto", B, "--drop-old-base")
    cfg = config.load(fork.root)
    assert [b.version for b in cfg.bases] == [B]
    assert fork.variants() == {}
    assert f'version = "{A}"' not in (fork.root / "fork.toml").read_text()


def test_test_option_runs_the_fork_tests_on_the_new_pin(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    calls = []
    monkeypatch.setattr(rebase_write, "run_tests", lambda cfg, opts: calls.append(opts.base) or 1)
    r = fork.cli("rebase", "--onto", B, "--test")
    assert calls == [B]
    assert r.rc == EXIT_FAILED and "tests FAILED" in r.out
    assert config.load(fork.root).pin.version == B  # the rebase itself is written


# --- the series around a rebase: check --all-bases --test, export after a rebase ---------------------


def test_check_all_bases_test_runs_the_fork_tests_on_each_base(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {UTILS: P2_CODE}))
    fork.ok("rebase", "--onto", B)
    calls = []
    monkeypatch.setattr(
        cmd_check, "run_tests", lambda cfg, opts: calls.append(opts.base) or (1 if opts.base == A else 0)
    )
    r = fork.cli("check", "--all-bases", "--test")
    assert calls == [A, B]
    assert r.rc == EXIT_FAILED and f"[{A}] the fork's tests failed (exit 1)" in r.out


def test_export_after_a_rebase_keeps_variants_attached_to_renamed_patches(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        size = sizes[i]\n", "        size = int(sizes[i])\n")})
    fork = make(tmp_path, monkeypatch, b)
    fork.ok("rebase", "--onto", B)
    variant = fork.variants()[f"{A}/{fork.names[0]}"]
    # A maintainer inserts a new first patch in the pin's tree (build/fork), then exports.
    tree, head = fork.tree, git.out(["rev-parse", "HEAD"], fork.tree)
    git.run(["reset", "-q", "--hard", f"v{B}"], tree)
    fork.commit(tree, "[Doc][Misc] Say what the fork is", {"README.md": const("# the fork\n")})
    git.run(["cherry-pick", f"v{B}..{head}"], tree)
    fork.ok("export")
    names = fork.series()
    assert [n[:5] for n in names] == ["0001-", "0002-", "0003-", "0004-"]
    assert names[1].endswith(fork.names[0][5:])
    assert fork.variants() == {f"{A}/{names[1]}": variant}  # the variant follows its patch's new name
    assert list(config.load(fork.root).fork_only) == [names[3]]
    fork.ok("check", "--all-bases")


def test_export_keeps_a_variant_only_patch_in_the_series(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, SERIES[1][1]))  # patch 2 already upstream in 1.1
    fork.ok("rebase", "--onto", B)
    listed = fork.series()
    fork.commit(
        fork.tree, "[Test][Misc] One more test", {"tests/ut/test_more.py": const("def test_more():\n    pass\n")}
    )
    fork.ok("export")
    assert fork.series()[:3] == listed and fork.series()[3].startswith("0003-Test-Misc")
    fork.ok("check", "--all-bases")


def test_empty_series_just_moves_the_pin(tmp_path, monkeypatch):
    fork = Fork(tmp_path, monkeypatch, {A: UPSTREAM, B: edited(UPSTREAM, {"README.md": const("x\n")})}, A, [A, B])
    r = fork.ok("rebase", "--onto", B)
    assert config.load(fork.root).pin.version == B and fork.series() == []
    assert "#  patch" in r.out


def test_onto_a_known_base_from_an_upstream_checkout(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {"README.md": const("# 1.1\n")})
    fork = make(tmp_path, monkeypatch, b)
    checkout = tmp_path / "checkout"
    for path, text in {**b, "PKG-INFO": f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {B}\n"}.items():
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        (checkout / path).write_text(text)
    r = fork.ok("rebase", "--onto", B, "--checkout", str(checkout))
    assert f"checkout at {B}" in r.out
    assert config.load(fork.root).pin == config.Base(B, fork.sha[B])  # the pin stays the sdist's sha256
    assert_tree(fork, expected_tree(b))


def test_workflow_giving_an_older_base_its_own_version_of_a_patch(tmp_path, monkeypatch):
    """The documented way to make a variant: rebase onto the older base, fold the base-specific
    change into the patch there, export, rebase back: `rebase` stores the variant."""
    code_upstream = edited(UPSTREAM, {UTILS: P2_CODE})  # the newer release already has patch 2's code
    test_only = [SERIES[0], (SERIES[1][0], {SNAPSHOT_TEST: SERIES[1][1][SNAPSHOT_TEST]}), SERIES[2]]
    fork = Fork(tmp_path, monkeypatch, {A: UPSTREAM, B: code_upstream}, B, [B, A])
    fork.names = fork.make_series(test_only)
    fork.ok("rebase", "--onto", A, "--older")
    assert fork.variants() == {}  # test-only patch 2 is the same change on both
    tree = fork.tree
    second = git.out(["rev-list", "--reverse", f"v{A}..HEAD"], tree).split()[1]
    (tree / UTILS).write_text(P2_CODE(UPSTREAM[UTILS]))
    git.run(["commit", "-q", "-a", f"--fixup={second}"], tree)
    git.run(["rebase", "-q", "-i", "--autosquash", f"v{A}"], tree, env={"GIT_SEQUENCE_EDITOR": "true"})
    fork.ok("export")
    assert set(series.file_sections(fork.patch(fork.names[1]))) == {SNAPSHOT_TEST, UTILS}
    r = fork.ok("rebase", "--onto", B)
    assert outcomes(fork, r.out)[fork.names[1]].startswith("partially upstream")
    assert set(series.file_sections(fork.patch(fork.names[1]))) == {SNAPSHOT_TEST}
    assert set(series.file_sections(fork.patch(fork.names[1], A))) == {SNAPSHOT_TEST, UTILS}
    fork.ok("check", "--all-bases")


def test_first_use_from_the_cache_and_from_the_registry(tmp_path, monkeypatch):
    from tools.fork.core import registry, upstream
    from tools.fork.tests.synthetic import make_sdist

    fork = make(tmp_path, monkeypatch, None)
    c_files = edited(UPSTREAM, {"README.md": const("# 1.2\n")})
    _, sha_c = make_sdist(fork.cache / "sdists", C, c_files)  # in the cache, not in fork.toml
    r = fork.ok("rebase", "--onto", C)
    assert "TRUST ON FIRST USE" in r.err and "the cached sdist (not yet in fork.toml)" in r.err
    assert config.load(fork.root).pin == config.Base(C, sha_c)

    downloads = []

    def fake_pip_download(cfg, version, dest):  # what pip leaves behind: one sdist in dest
        downloads.append(version)
        return make_sdist(dest, version, c_files)[0]

    monkeypatch.setattr(registry, "_pip_download", fake_pip_download)
    r = fork.ok("rebase", "--onto", "1.3")
    assert downloads == ["1.3"] and "downloaded from the package registry" in r.err
    cached = fork.cache / "sdists" / "vllm_ascend-1.3.tar.gz"
    assert config.load(fork.root).pin == config.Base("1.3", upstream.sha256_of(cached))
    assert [b.version for b in config.load(fork.root).bases] == [A, C, "1.3"]


def test_a_base_may_give_a_file_the_fork_adds_its_own_bytes_in_its_own_version_of_a_patch(tmp_path, monkeypatch):
    """The overlay is the pin's end state. On an older base, a test file that base's own version of a
    patch adds may differ from it (a test of what that release has); without a variant it may not."""
    code_upstream = edited(UPSTREAM, {UTILS: P2_CODE})  # the newer release already has patch 2's code
    test_only = [SERIES[0], (SERIES[1][0], {SNAPSHOT_TEST: SERIES[1][1][SNAPSHOT_TEST]}), SERIES[2]]
    fork = Fork(tmp_path, monkeypatch, {A: UPSTREAM, B: code_upstream}, B, [B, A])
    fork.names = fork.make_series(test_only)
    fork.ok("rebase", "--onto", A, "--older")
    tree, name = fork.tree, fork.names[1]
    second = git.out(["rev-list", "--reverse", f"v{A}..HEAD"], tree).split()[1]
    (tree / UTILS).write_text(P2_CODE(UPSTREAM[UTILS]))
    git.run(["commit", "-q", "-a", f"--fixup={second}"], tree)
    git.run(["rebase", "-q", "-i", "--autosquash", f"v{A}"], tree, env={"GIT_SEQUENCE_EDITOR": "true"})
    fork.ok("export")
    fork.ok("rebase", "--onto", B)
    variant = fork.root / "patches" / "bases" / A / name
    pin_patch = fork.patch(name)
    variant.write_bytes(variant.read_bytes().replace(b"+    assert True\n", b"+    assert 1.0\n"))
    assert variant.read_bytes().count(b"+    assert 1.0\n") == 1
    fork.ok("check", "--all-bases")
    assert fork.patch(name) == pin_patch
    variant.unlink()  # 1.0 now applies the pin's version: its file must equal the overlay
    shared = fork.root / SNAPSHOT_TEST
    shared.write_text(shared.read_text() + "# the overlay changed, the patch did not\n")
    r = fork.cli("check", "--all-bases")
    assert r.rc == EXIT_FAILED and f"{SNAPSHOT_TEST}: overlay differs" in r.out


def test_a_skip_marker_may_say_why_its_base_skips_the_patch(tmp_path, monkeypatch):
    """A variant with no diff skips the patch on its base; its text is the reason, which status prints."""
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, SERIES[1][1]))  # 1.1 lacks what patch 2 changes
    marker = fork.root / "patches" / "bases" / B / fork.names[1]
    r = fork.cli("check", "--all-bases")
    assert r.rc == EXIT_FAILED and f"[{B}] patch {fork.names[1]} does not apply" in r.out
    marker.parent.mkdir(parents=True)
    marker.write_text(f"not applicable: {B} has no such code\nto change\n")
    cfg = config.load(fork.root)
    assert [p.name for p in series.read(cfg, B)] == [fork.names[0], fork.names[2]]
    fork.ok("check", "--all-bases")
    assert f"{fork.names[1]} (skipped: not applicable: {B} has no such code to change)" in fork.ok("status").out
    marker.write_text("")  # an empty marker: the release has the change already
    assert f"{fork.names[1]} (skipped: already upstream there)" in fork.ok("status").out
