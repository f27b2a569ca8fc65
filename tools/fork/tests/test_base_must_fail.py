"""The regression proof of the kernel op tests: the cases that must fail on an unpatched base."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from tools.fork.testing import steps

TEST_FILE = f"{steps.KERNEL_TEST_DIR}/test_synthetic_kernel.py"


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository; a fork tree whose one kernel op test fails when the base's kernel says so; a base tree."""
    repo, fork, base = tmp_path / "repo", tmp_path / "fork", tmp_path / "base"
    repo.mkdir()
    (base / "vllm_ascend" / "ops" / "triton").mkdir(parents=True)
    test = fork / TEST_FILE
    test.parent.mkdir(parents=True)
    test.write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('case', ['proof', 'other'])\n"
        "def test_kernel(case):\n"
        "    assert os.environ['BASE_KERNEL'] == 'fixed'\n"
    )
    monkeypatch.setattr(steps, "BASE_MUST_FAIL", {TEST_FILE: "proof"})

    def plain_pytest(tenv, root, tree, files, junit):  # the kernel harness needs Triton: plain pytest here
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", steps.JUNIT_FAMILY,
                f"--junitxml={junit}", f"--rootdir={tree}"]  # fmt: skip
        return argv, tenv.env(), root

    monkeypatch.setattr(steps, "kernel_test_command", plain_pytest)
    return repo, base, fork


def _run(repo, base, fork, kernel: str):
    tenv = SimpleNamespace(env=lambda: {**os.environ, "BASE_KERNEL": kernel})
    return steps.base_must_fail_step(tenv, repo, base, fork, repo / "junit.xml")


def test_a_case_failing_on_the_base_proves_the_tests(repo):
    step = _run(*repo, kernel="broken")
    assert step.status == "passed" and step.counts["failed"] == 1 and step.counts["passed"] == 0
    assert not step.of_the_fork  # the base's counts: left out of the fork's closing total


def test_cases_passing_on_the_base_fail_the_step(repo):
    step = _run(*repo, kernel="fixed")
    assert step.failed and "no longer catch" in step.detail


def test_a_base_without_the_cases_has_nothing_to_prove(repo, monkeypatch):
    monkeypatch.setattr(steps, "BASE_MUST_FAIL", {TEST_FILE: "absent"})
    assert _run(*repo, kernel="broken").status == "none"
    monkeypatch.setattr(steps, "BASE_MUST_FAIL", {f"{steps.KERNEL_TEST_DIR}/test_not_in_the_fork.py": "proof"})
    assert _run(*repo, kernel="broken").status == "none"
