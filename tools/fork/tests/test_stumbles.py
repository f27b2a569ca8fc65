"""What a newcomer stumbled on , each fixed and kept fixed: one test per stumble."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.fork.core import config, git, registry
from tools.fork.core.errors import EXIT_BAD_INPUT, EXIT_CONFLICT, EXIT_LOCAL_EDITS
from tools.fork.tests.synthetic import (
    COPY,
    SERIES,
    UPSTREAM,
    A,
    B,
    Fork,
    const,
    edited,
    make,
    outcomes,
    replace,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


def _one_line(r, code: int, *words: str) -> None:
    assert r.rc == code, r.text
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    for w in words:
        assert w in lines[0], lines[0]


# --- a rebase to an older release warns and needs a flag ------------------------------------------


def test_a_rebase_onto_an_older_release_needs_older(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    fork.ok("rebase", "--onto", B)
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", A)
    _one_line(r, EXIT_BAD_INPUT, f"{A} is older than the pin {B}", "--older")
    assert fork.snapshot() == before and not (fork.root / "build" / "rebase").exists()
    fork.ok("rebase", "--onto", A, "--older")
    assert config.load(fork.root).pin.version == A


# --- any verb recovers from a stale build/fork ----------------------------------------------------


def _discard_rebase(fork: Fork) -> None:
    """The user throws the written rebase away with git, as README's example does."""
    (fork.root / ".gitignore").write_text("build/\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "series"]):
        git.run(args, fork.root)
    fork.ok("rebase", "--onto", B)
    git.run(["checkout", "-q", "--", "."], fork.root)
    git.run(["clean", "-q", "-fd", "--", "patches"], fork.root)
    assert config.load(fork.root).pin.version == A
    assert fork.tree.is_dir()  # build/fork is the discarded rebase's tree, on B


def test_apply_recovers_from_the_tree_of_a_discarded_rebase(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    _discard_rebase(fork)
    r = fork.ok("apply")
    assert f"was materialized on vllm-ascend {B}, not {A}: making it again" in r.out
    assert "created" in r.out
    fork.ok("check")


def test_a_stale_tree_with_own_work_is_kept_unless_forced(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, {"README.md": const("x\n")}))
    _discard_rebase(fork)
    (fork.tree / COPY).write_text("an edit of my own\n")
    r = fork.cli("apply")
    assert r.rc == EXIT_LOCAL_EDITS and "apply --force" in r.err, r.text
    assert (fork.tree / COPY).read_text() == "an edit of my own\n"
    fork.ok("apply", "--force")
    assert (fork.tree / COPY).read_text() != "an edit of my own\n"


# --- -C works from anywhere -----------------------------------------------------------------------


def test_the_tooling_runs_by_path_from_outside_the_repository(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "fork"), "-C", str(REPO_ROOT), "pr", "--help"],
        cwd=tmp_path, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "usage:" in p.stdout


# --- --sdist is always checked --------------------------------------------------------------------


def test_deploy_checks_a_named_sdist_first(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, None, bases=(A,))
    target = tmp_path / "site" / "vllm_ascend"
    target.mkdir(parents=True)
    r = fork.cli("deploy", "--to", str(target), "--sdist", str(tmp_path / "nonexistent.tar.gz"))
    _one_line(r, EXIT_BAD_INPUT, "--sdist", "no such file")


# --- an unknown version is exit 2 in one line on every verb ---------------------------------------


def _registry_without(tmp_path: Path, monkeypatch) -> None:
    """A stand-in for pip that knows the project but not the version asked for (pip's own words)."""
    fake = tmp_path / "fake-python"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "ERROR: Could not find a version that satisfies the requirement vllm-ascend==9.9 '
        '(from versions: 1.0, 1.1, 1.2rc1, 1.3)" >&2\n'
        'echo "ERROR: No matching distribution found for vllm-ascend==9.9" >&2\n'
        "exit 1\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(registry, "helper_python", lambda: fake)


@pytest.mark.parametrize(
    "argv", [("rebase", "--onto", "9.9"), ("test", "--base", "9.9"), ("apply", "--base", "9.9")], ids=lambda a: a[0]
)
def test_an_unknown_version_is_one_line_and_exit_2(tmp_path, monkeypatch, argv):
    fork = make(tmp_path, monkeypatch, None, bases=(A,))
    _registry_without(tmp_path, monkeypatch)
    before = fork.snapshot()
    r = fork.cli(*argv)
    _one_line(r, EXIT_BAD_INPUT, "9.9")
    assert "from versions" not in r.text
    assert fork.snapshot() == before


# --- conflict messages name every variant tried ---------------------------------------------------


def test_a_conflict_names_every_version_of_the_patch_tried(tmp_path, monkeypatch):
    # 1.1 changes the lines around the one patch 1 adds: the pin's version conflicts there and 1.0's
    # variant (another comment on that line) does not apply either.
    b = edited(
        UPSTREAM,
        {COPY: replace("        data = load(src[i], size)\n", "        data = load(src[i], size, fast=True)\n")},
    )
    fork = make(tmp_path, monkeypatch, b)
    variant = fork.root / "patches" / "bases" / A / fork.names[0]
    variant.parent.mkdir(parents=True)
    variant.write_bytes(
        fork.patch(fork.names[0]).replace(b"barrier()  # all loads before any store", b"barrier()  # loads first")
    )
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_CONFLICT, r.text
    header = next(line for line in r.out.splitlines() if "versions tried" in line)
    assert f"patches/{fork.names[0]}" in header and f"patches/bases/{A}/{fork.names[0]}" in header


# --- series numbering stays unique after a dropped patch ------------------------------------------


def test_a_patch_dropped_on_the_new_pin_keeps_a_number_of_its_own(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, SERIES[1][1]))  # 1.1 has patch 2 already
    r = fork.ok("rebase", "--onto", B)
    assert "already upstream" in outcomes(fork, r.out)[fork.names[1]]
    numbers = [n.split("-", 1)[0] for n in fork.series()]
    assert len(set(numbers)) == len(numbers) and numbers == sorted(numbers), fork.series()
    fork.ok("check", "--all-bases")


def test_check_names_two_patches_with_one_number(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, None, bases=(A,))
    first, second = fork.names[0], fork.names[1]
    clash = "0001-" + second.split("-", 1)[1]
    (fork.root / "patches" / second).rename(fork.root / "patches" / clash)
    (fork.root / "patches" / "series").write_text((fork.root / "patches" / "series").read_text().replace(second, clash))
    r = fork.cli("check")
    assert r.rc == 1 and "two or more patches are numbered 0001-" in r.out, r.text
    assert first in r.out


# --- the build prints no warning of upstream's metadata -------------------------------------------


def test_the_build_backend_silences_upstreams_licence_classifier_warning(tmp_path):
    # In a fresh interpreter: setuptools' distutils hack fails to install in a process where other
    # tests have already imported parts of the packaging stack.
    script = textwrap.dedent(
        f"""
        import os, warnings
        from tools.fork.queue import backend, wheel

        backend.config.load = lambda *a, **k: None
        wheel.materialized_pin = lambda cfg: {str(tmp_path)!r}
        wheel.build_environment = lambda cfg: (dict(os.environ), [])

        def upstream_metadata(directory, settings=None):  # what setuptools >= 77 does with upstream's setup.py
            warnings.warn("License classifiers are deprecated.\\n!!\\n  Please consider ...", DeprecationWarning, 2)
            return "vllm_ascend.dist-info"

        backend._setuptools.prepare_metadata_for_build_wheel = upstream_metadata
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert backend.prepare_metadata_for_build_wheel({str(tmp_path)!r}) == "vllm_ascend.dist-info"
        assert not [w for w in seen if "License classifiers" in str(w.message)], seen
        """
    )
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


# --- a fresh machine: empty home, no git identity -------------------------------------------------


def test_the_tooling_tests_need_no_home_and_no_git_identity(tmp_path):
    """The test that used to fail on a fresh machine (it runs `git rebase` itself), run as there."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "FORK_CACHE": str(tmp_path / "cache")}
    test = "tools/fork/tests/test_newcomer.py::test_apply_refuses_to_drop_an_exported_then_discarded_commit"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=REPO_ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
