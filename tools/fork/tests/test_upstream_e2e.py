"""`test`'s step for upstream's e2e tests of the modules the series changes (tools/fork/testing/upstream_e2e.py).

Synthetic trees: an upstream module, an upstream e2e test file that imports it, a series that changes
it. The two passes run real pytest processes; only what needs the real environment is replaced: the
run pass is plain pytest instead of the Triton harness, the import check collects with the tree on
PYTHONPATH instead of an editable install.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools.fork.core.series import Patch, base_tag
from tools.fork.testing import testenv, upstream_e2e
from tools.fork.tests.conftest import GIT_ENV

E2E_FILE = "tests/e2e/nightly/ops/test_kern.py"
NPU_FILE = "tests/e2e/nightly/ops/test_kern_on_npu.py"

KERN = """\
def helper(x):
    return x + 1


def npu_helper(x):
    return x * 2


def main(x):
    return helper(x)
"""
# upstream's test: two tests that run anywhere, one that needs an NPU operator (fails on the CPU, on any tree)
E2E_TEST = """\
import pytest

from vllm_ascend.ops.kern import helper, main


@pytest.mark.parametrize("x", [1, 2])
def test_helper(x):
    assert helper(x) == x + 1


def test_main():
    assert main(1) == 2


def test_needs_npu_operator():
    raise RuntimeError("needs an NPU operator")
"""
# a file none of whose tests pass on the CPU: import-checked only
NPU_TEST = """\
from vllm_ascend.ops.kern import npu_helper


def test_on_npu():
    raise RuntimeError("NPU required: npu_helper on the device")
"""
UNRELATED_TEST = "from vllm_ascend.ops.other import f\n\n\ndef test_f():\n    assert f() == 1\n"
BASE = {
    "vllm_ascend/__init__.py": "",
    "vllm_ascend/ops/__init__.py": "",
    "vllm_ascend/ops/kern.py": KERN,
    "vllm_ascend/ops/other.py": "def f():\n    return 1\n",
    "vllm_ascend/envs.py": "X = 1\n",
    E2E_FILE: E2E_TEST,
    NPU_FILE: NPU_TEST,
    "tests/e2e/nightly/ops/test_other.py": UNRELATED_TEST,
    "tests/e2e/conftest.py": "raise RuntimeError('upstream e2e conftest needs an NPU')\n",
}


def write(tree: Path, files: dict[str, str | None]) -> None:
    for rel, text in files.items():
        path = tree / rel
        if text is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=GIT_ENV).stdout


def make_series(tmp: Path, edits: dict[str, str | None], extra=None) -> tuple[Path, Path, list[Patch]]:
    """(base tree, fork tree, the series as format-patch files) for base = BASE + `extra`, fork = base + `edits`."""
    base, fork = tmp / "base", tmp / "fork"
    write(base, {**BASE, **(extra or {})})
    write(fork, {**BASE, **(extra or {})})
    git(fork, "init", "-q")
    git(fork, "add", "-A")
    git(fork, "commit", "-q", "-m", "upstream")
    git(fork, "tag", base_tag("1.0.0"))
    write(fork, edits)
    git(fork, "add", "-A")
    git(fork, "commit", "-q", "-m", "[Ops][BugFix] Change the kernel")
    out = tmp / "patches"
    names = git(fork, "format-patch", "-o", str(out), "-1").split()
    return base, fork, [Patch(Path(n).name, Path(n)) for n in names]


@pytest.fixture
def harness(tmp_path, monkeypatch):
    """The step with plain pytest in place of the Triton harness and of the editable install."""
    cache = tmp_path / "cache"
    tenv = SimpleNamespace(
        python=Path(sys.executable),
        results_dir=cache,
        stamp="synthetic-env",
        env=lambda extra=None: {**os.environ, **(extra or {})},
        lock=lambda what: contextlib.nullcontext(),
    )
    calls, ran = [], {}

    def run_command(tenv_, root, tree, files, junit):
        calls.append(("run", tree.name))
        ran[tree.name] = list(files)
        argv = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
                "--continue-on-collection-errors", "-o", "junit_family=xunit1", f"--junitxml={junit}",
                f"--rootdir={tree}", *files]  # fmt: skip
        return argv, {**os.environ, "PYTHONPATH": str(tree)}, tree

    def import_command(tenv_, tree, files, junit):
        calls.append(("import", tree.name))
        argv, _, cwd = real_import_command(tenv_, tree, files, junit)
        return argv, {**os.environ, "PYTHONPATH": str(tree)}, cwd

    real_import_command = upstream_e2e.import_command
    monkeypatch.setattr(upstream_e2e, "run_command", run_command)
    monkeypatch.setattr(upstream_e2e, "import_command", import_command)
    monkeypatch.setattr(testenv, "install_tree", lambda tenv_, tree, version: None)

    def step(edits, *, added=(), fork_only=False, extra=None):
        base, fork, patches = make_series(tmp_path / f"s{len(calls)}", edits, extra)
        cfg = SimpleNamespace(root=tmp_path, build_dir=tmp_path / "build")
        return upstream_e2e.upstream_e2e_step(
            cfg, tenv, version="1.0.0", base_sha256="ab" * 32, base_tree=base, fork_tree=fork,
            patches=patches, added=list(added), fork_only=fork_only,
        )  # fmt: skip

    return SimpleNamespace(step=step, calls=calls, ran=ran)


def test_changed_modules_are_the_upstream_files_the_series_modifies_or_deletes(tmp_path):
    base, _, patches = make_series(
        tmp_path,
        {
            "vllm_ascend/ops/kern.py": KERN + "\n# changed\n",
            "vllm_ascend/envs.py": None,  # deleted
            "vllm_ascend/ops/new.py": "NEW = 1\n",  # added: the fork's own, no upstream test imports it
            "tests/ut/test_new.py": "def test_new():\n    pass\n",
        },
    )
    assert upstream_e2e.changed_modules(patches, base) == {
        "vllm_ascend.envs": "vllm_ascend/envs.py",
        "vllm_ascend.ops.kern": "vllm_ascend/ops/kern.py",
    }


def test_tests_are_selected_by_what_they_import(tmp_path):
    write(tmp_path, BASE)
    write(
        tmp_path,
        {
            "tests/e2e/a/test_module_import.py": "import vllm_ascend.ops.kern as k\n",
            "tests/e2e/a/test_from_package.py": "from vllm_ascend.ops import kern\n",
            "tests/e2e/a/test_in_function.py": "def test_x():\n    from vllm_ascend.ops.kern import main\n",
            "tests/e2e/a/test_fork_added.py": "from vllm_ascend.ops.kern import main\n",
            "tests/e2e/a/helpers.py": "from vllm_ascend.ops.kern import main\n",  # not a test file
            "tests/ut/test_ut.py": "from vllm_ascend.ops.kern import main\n",  # not under tests/e2e
        },
    )
    selected = upstream_e2e.select_tests(
        [tmp_path], ["vllm_ascend.ops.kern"], exclude=["tests/e2e/a/test_fork_added.py"]
    )
    assert selected == {
        "tests/e2e/a/test_from_package.py": ["vllm_ascend.ops.kern"],
        "tests/e2e/a/test_in_function.py": ["vllm_ascend.ops.kern"],
        "tests/e2e/a/test_module_import.py": ["vllm_ascend.ops.kern"],
        E2E_FILE: ["vllm_ascend.ops.kern"],
        NPU_FILE: ["vllm_ascend.ops.kern"],
    }


def test_a_change_that_keeps_the_tests_passing_passes(harness, capsys):
    step = harness.step({"vllm_ascend/ops/kern.py": KERN.replace("return x + 1", "return 1 + x")})
    out = capsys.readouterr().out
    assert step.status == "passed", step.detail
    assert step.counts["passed"] == 3 and not step.counts["failed"] + step.counts["error"]
    # the tests that fail on the base too are import-checked only, and named
    assert "2 import-checked only" in step.detail
    assert f"{E2E_FILE}: 1 of 4 test(s) (RuntimeError: needs an NPU operator)" in out
    assert f"{NPU_FILE}: 1 of 1 test(s)" in out
    assert "test_other.py" not in out  # it imports no changed module


def test_the_base_runs_only_the_files_where_the_fork_does_not_pass_every_test(harness):
    # Where the fork passes every test the base collects, the base's run cannot change the verdict.
    passing = "tests/e2e/nightly/ops/test_kern_main.py"
    extra = {passing: "from vllm_ascend.ops.kern import main\n\n\ndef test_main_again():\n    assert main(1) == 2\n"}
    step = harness.step({"vllm_ascend/ops/kern.py": KERN.replace("return x + 1", "return 1 + x")}, extra=extra)
    assert step.status == "passed", step.detail
    assert passing in harness.ran["fork"] and passing not in harness.ran["base"]
    assert sorted(harness.ran["base"]) == sorted([E2E_FILE, NPU_FILE])  # each has a test the fork fails


def test_deleting_a_function_an_upstream_test_imports_fails_the_step(harness, capsys):
    step = harness.step({"vllm_ascend/ops/kern.py": KERN.replace("def helper(x):\n    return x + 1\n\n\n", "")})
    out = capsys.readouterr().out
    assert step.failed
    # the file is named with its import error, once, not as 3 lost tests and 4 uncollected ones
    assert step.detail.startswith("test_kern.py does not import on the fork (ImportError: cannot import name 'helper'")
    assert "missing from the fork" not in step.detail and "collected on the base and not" not in step.detail
    assert f"{E2E_FILE}: does not import: ImportError: cannot import name 'helper'" in out
    assert "(4 test(s) collected on the base, 3 of them pass there)" in out
    assert step.counts["error"] == 3  # the three that passed on the base


def test_a_test_that_passes_on_the_base_and_fails_on_the_fork_fails_the_step(harness, capsys):
    step = harness.step({"vllm_ascend/ops/kern.py": KERN.replace("return helper(x)", "return helper(x) + 1")})
    out = capsys.readouterr().out
    assert step.failed and "1 pass on the base and not on the fork" in step.detail
    assert f"{E2E_FILE}::test_main: failed" in out
    assert step.counts["passed"] == 2 and step.counts["failed"] == 1


def test_cases_a_patch_adds_to_an_upstream_test_must_pass_on_the_fork(harness):
    passing = E2E_TEST + "\n\ndef test_added_by_the_series():\n    assert main(2) == 3\n"
    kern = {"vllm_ascend/ops/kern.py": KERN.replace("return x + 1", "return 1 + x")}
    step = harness.step({**kern, E2E_FILE: passing})
    assert step.status == "passed", step.detail
    failing = E2E_TEST + "\n\ndef test_added_by_the_series():\n    assert main(2) == 4\n"
    step = harness.step({**kern, E2E_FILE: failing})
    assert step.failed and "1 that the series adds do not pass on the fork" in step.detail


def test_an_import_checked_only_file_that_no_longer_imports_fails_the_step(harness, capsys):
    # every test of NPU_FILE fails on the base (no NPU): only its import is checked, and it breaks
    step = harness.step({"vllm_ascend/ops/kern.py": KERN.replace("def npu_helper(x):\n    return x * 2\n\n\n", "")})
    out = capsys.readouterr().out
    assert step.failed
    assert step.detail.startswith("test_kern_on_npu.py does not import on the fork (ImportError: cannot import name")
    assert f"{NPU_FILE}: does not import" in out and "(1 test(s) collected on the base, 0 of them pass there)" in out
    assert step.counts["passed"] == 3 and not step.counts["error"]  # the tests that run are unaffected


def test_a_file_that_does_not_import_on_the_base_either_is_no_loss(harness, capsys):
    broken = "from vllm_ascend.ops.kern import main\nimport module_nobody_has\n\n\ndef test_x():\n    pass\n"
    step = harness.step(
        {"vllm_ascend/ops/kern.py": KERN + "\n"}, extra={"tests/e2e/nightly/ops/test_broken_upstream.py": broken}
    )
    assert step.status == "passed", step.detail
    out = capsys.readouterr().out
    assert (
        "tests/e2e/nightly/ops/test_broken_upstream.py: does not import on the base 1.0.0 either "
        "(ModuleNotFoundError: No module named 'module_nobody_has')" in out
    )


def test_base_results_are_cached(harness):
    edits = {"vllm_ascend/ops/kern.py": KERN + "\n"}
    assert harness.step(edits).status == "passed"
    first = list(harness.calls)
    assert ("run", "base") in first and ("import", "base") in first
    assert harness.step(edits).status == "passed"
    assert harness.calls[len(first) :] == [("import", "fork"), ("run", "fork")]  # the base's came from the cache


def test_a_run_stopped_in_the_base_run_pass_resumes_from_the_cached_import_check(harness, monkeypatch):
    edits = {"vllm_ascend/ops/kern.py": KERN + "\n"}
    run_pass = upstream_e2e.run_pass

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(upstream_e2e, "run_pass", stopped)
    with pytest.raises(KeyboardInterrupt):
        harness.step(edits)
    monkeypatch.setattr(upstream_e2e, "run_pass", run_pass)
    first = len(harness.calls)
    assert harness.step(edits).status == "passed"
    assert harness.calls[first:] == [("import", "fork"), ("run", "fork"), ("run", "base")]


def test_fork_only_without_cached_base_results_checks_the_fork_imports(harness, capsys):
    step = harness.step(
        {"vllm_ascend/ops/kern.py": KERN.replace("def npu_helper(x):\n    return x * 2\n\n\n", "")}, fork_only=True
    )
    assert step.failed and "no base comparison" in step.detail
    assert all(side == "fork" for _, side in harness.calls)
    assert f"{NPU_FILE}: does not import on the fork: " in capsys.readouterr().out


def test_nothing_to_run_when_no_upstream_test_imports_a_changed_module(harness):
    step = harness.step(
        {"vllm_ascend/ops/other.py": "def f():\n    return 1\n\n\n# changed\n"},
        added=["tests/e2e/nightly/ops/test_other.py"],
    )
    assert step.status == "none" and not harness.calls


def test_import_results_round_trip_through_junit(tmp_path):
    from tools.fork.testing.junit import Result, parse_junit

    results = {
        "tests/e2e/t/test_a.py::test_x[1-a]": Result("tests/e2e/t/test_a.py::test_x[1-a]", "passed"),
        "tests/e2e/t/test_a.py::TestK::test_y": Result("tests/e2e/t/test_a.py::TestK::test_y", "passed"),
        "tests/e2e/t/test_b.py": Result("tests/e2e/t/test_b.py", "error", "ImportError: cannot import name 'f'"),
    }
    upstream_e2e.write_junit(results, tmp_path / "j.xml")
    assert parse_junit((tmp_path / "j.xml").read_text()) == results


def test_a_series_that_deletes_upstream_tests_lists_them_as_removed(harness, capsys):
    # as for tests/ut: a PR may delete a test it makes obsolete; its tests are listed, not judged
    step = harness.step({"vllm_ascend/ops/kern.py": KERN + "\n", E2E_FILE: None, NPU_FILE: None})
    out = capsys.readouterr().out
    assert step.status == "passed", step.detail
    assert "their file deleted by a patch of the series (not judged)" in out
    assert f"{E2E_FILE}::test_main" in out
    assert ("run", "fork") not in harness.calls  # no file left to run: nothing else of the tree is collected


def test_a_series_that_deletes_some_tests_of_a_file_it_keeps_loses_them(harness):
    kept = E2E_TEST.replace("def test_main():", "def _main():")
    step = harness.step({"vllm_ascend/ops/kern.py": KERN + "\n", E2E_FILE: kept})
    assert step.failed and "1 pass on the base and are missing from the fork" in step.detail


def test_an_import_checked_only_file_always_gets_a_reason():
    from tools.fork.testing.junit import Result

    ids = [f"{E2E_FILE}::test_a", f"{E2E_FILE}::test_b"]
    base_run = {ids[0]: Result(ids[0], "skipped"), ids[1]: Result(ids[1], "failed")}
    assert upstream_e2e._why(base_run, ids, E2E_FILE) == "failed/skipped on the base without a message"
    assert upstream_e2e._why({}, ids, E2E_FILE) == "not run on the base"
    base_run[ids[1]] = Result(ids[1], "failed", "RuntimeError:   NPU\nrequired")
    assert upstream_e2e._why(base_run, ids, E2E_FILE) == "RuntimeError: NPU required"
