"""Tests of the test environment and the `test` verb's logic (fast: no network, no venv build)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.fork import test as fork_test
from tools.fork import testenv
from tools.fork.errors import BadInput, ForkError

REPO = Path(__file__).resolve().parents[3]


# --- .ci/ut-exclusions.txt ---------------------------------------------------------------


def test_exclusions_parse_paths_and_reasons():
    text = textwrap.dedent(
        """\
        # a comment line

        tests/ut/**/a2/   # routed to A2 runners
        tests/ut/x/test_y.py # needs a thing # with a hash in the reason
        """
    )
    ex = fork_test.parse_exclusions(text)
    assert [(e.pattern, e.reason, e.lineno) for e in ex] == [
        ("tests/ut/**/a2/", "routed to A2 runners", 3),
        ("tests/ut/x/test_y.py", "needs a thing # with a hash in the reason", 4),
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ("tests/ut/a2/", "no reason"),
        ("tests/ut/a2/   #   ", "no reason"),
        ("/abs/tests/ut # why", "relative"),
        ("tests/../ut # why", "relative"),
        ("tests/ut/a tests/ut/b # why", "one path a line"),
    ],
)
def test_exclusions_refuse_bad_lines(line, message):
    with pytest.raises(BadInput, match=message) as info:
        fork_test.parse_exclusions(f"# header\n{line}\n", "ex.txt")
    assert "ex.txt:2" in str(info.value)


def test_exclusions_refuse_duplicates():
    with pytest.raises(BadInput, match="listed twice"):
        fork_test.parse_exclusions("tests/ut/a2/ # one\ntests/ut/a2 # two\n")


def _touch(root: Path, *rels: str) -> None:
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")


def test_repository_exclusions_match_npu_folders_only(tmp_path):
    """The real file: NPU-routed folders at any depth go, tests/ut/_310p and plain modules stay."""
    _touch(
        tmp_path,
        "tests/ut/ops/a2/test_a.py",
        "tests/ut/eplb/core/a2/test_b.py",
        "tests/ut/ops/a3_2/test_c.py",
        "tests/ut/worker/310p/test_d.py",
        "tests/ut/_310p/test_e.py",
        "tests/ut/ops/test_f.py",
        "tests/ut/ops/test_a2.py",
    )
    ex = fork_test.load_exclusions(REPO)
    assert ex, "the repository's exclusions file lists nothing"
    assert all(e.reason for e in ex)
    ignored = {p for _, paths in fork_test.resolve_exclusions(ex, tmp_path) for p in paths}
    assert ignored == {"tests/ut/ops/a2", "tests/ut/eplb/core/a2", "tests/ut/ops/a3_2", "tests/ut/worker/310p"}


def test_exclusion_with_trailing_slash_matches_directories_only(tmp_path):
    _touch(tmp_path, "tests/ut/m/a2/test_x.py", "tests/ut/n/a2")  # n/a2 is a file
    ex = fork_test.parse_exclusions("tests/ut/**/a2/ # dirs\n")
    assert fork_test.resolve_exclusions(ex, tmp_path)[0][1] == ["tests/ut/m/a2"]


# --- junit XML -> results per test id -----------------------------------------------------

_SAMPLE_TESTS = {
    "tests/__init__.py": "",
    "tests/ut/__init__.py": "",
    "tests/ut/pkg/__init__.py": "",
    "tests/ut/pkg/test_mixed.py": """
        import pytest

        def test_ok():
            pass

        def test_bad():
            assert 1 == 2

        @pytest.mark.skip(reason="not here")
        def test_skip():
            pass

        @pytest.mark.xfail(reason="known")
        def test_xfail():
            assert False

        @pytest.mark.parametrize("n", [1, 2])
        def test_param(n):
            assert n == 1

        class TestGroup:
            def test_in_class(self):
                pass

        @pytest.fixture
        def broken():
            raise RuntimeError("fixture")

        def test_error(broken):
            pass
    """,
    "tests/ut/pkg/test_broken_import.py": "import no_such_module_here\n",
}


@pytest.fixture(scope="module")
def sample_results(tmp_path_factory):
    """Real pytest junit output (xunit1, as the verb runs it) of a small suite."""
    root = tmp_path_factory.mktemp("suite")
    for rel, body in _SAMPLE_TESTS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(body))
    junit = root / "out.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
         "--continue-on-collection-errors", f"--junitxml={junit}", "tests/ut"],
        cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return fork_test.parse_junit(junit.read_text())


def test_junit_ids_and_outcomes(sample_results):
    f = "tests/ut/pkg/test_mixed.py"
    got = {tid: r.outcome for tid, r in sample_results.items()}
    assert got == {
        f"{f}::test_ok": "passed",
        f"{f}::test_bad": "failed",
        f"{f}::test_skip": "skipped",
        f"{f}::test_xfail": "xfailed",
        f"{f}::test_param[1]": "passed",
        f"{f}::test_param[2]": "failed",
        f"{f}::TestGroup::test_in_class": "passed",
        f"{f}::test_error": "error",
        "tests/ut/pkg/test_broken_import.py": "error",
    }
    assert sample_results[f"{f}::test_skip"].message == "not here"
    assert sample_results[f"{f}::test_bad"].file == f
    c = fork_test.counts(sample_results)
    assert (c["passed"], c["failed"], c["error"], c["skipped"], c["xfailed"]) == (3, 2, 2, 1, 1)


def test_junit_worst_outcome_wins_for_a_repeated_id():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.ut.test_a" name="test_x" file="tests/ut/test_a.py"/>
      <testcase classname="tests.ut.test_a" name="test_x" file="tests/ut/test_a.py">
        <error message="teardown"/></testcase>
    </testsuite></testsuites>"""
    assert fork_test.parse_junit(xml)["tests/ut/test_a.py::test_x"].outcome == "error"


# --- base vs fork ------------------------------------------------------------------------


def _results(**outcomes: str) -> dict[str, fork_test.Result]:
    out = {}
    for key, outcome in outcomes.items():
        file, _, name = key.partition("__")
        tid = f"tests/ut/{file}.py::{name}"
        out[tid] = fork_test.Result(tid, outcome)
    return out


BASE = _results(test_a__t1="passed", test_a__t2="passed", test_b__t3="failed", test_b__t4="skipped")


def test_identical_runs_are_ok():
    cmp = fork_test.compare(BASE, dict(BASE), [])
    assert cmp.ok and not cmp.new and not cmp.regressions
    assert fork_test.verdict(cmp, []) == []


def test_pass_on_base_fail_on_fork_fails_the_run():
    fork = dict(BASE, **_results(test_a__t2="failed"))
    cmp = fork_test.compare(BASE, fork, [])
    assert cmp.regressions == [("tests/ut/test_a.py::t2", "failed")]
    assert not cmp.ok
    assert any("pass on the base and not on the fork" in p for p in fork_test.verdict(cmp, []))


@pytest.mark.parametrize("outcome", ["error", "skipped", "xfailed"])
def test_pass_on_base_not_passing_on_fork_fails_the_run(outcome):
    fork = dict(BASE, **_results(test_a__t1=outcome))
    assert not fork_test.compare(BASE, fork, []).ok


def test_pass_on_base_missing_on_fork_fails_the_run():
    fork = {k: v for k, v in BASE.items() if not k.endswith("::t1")}
    cmp = fork_test.compare(BASE, fork, [])
    assert cmp.lost == ["tests/ut/test_a.py::t1"] and not cmp.ok


def test_failing_on_both_is_not_a_regression_and_a_fix_is_reported():
    fork = dict(BASE, **_results(test_b__t3="failed"))
    assert fork_test.compare(BASE, fork, []).ok
    fixed = fork_test.compare(BASE, dict(BASE, **_results(test_b__t3="passed")), [])
    assert fixed.ok and fixed.fixed == ["tests/ut/test_b.py::t3"]


def test_new_fork_tests_are_listed_with_their_outcome():
    fork = dict(BASE, **_results(test_new__n1="passed", test_new__n2="failed"))
    cmp = fork_test.compare(BASE, fork, ["tests/ut/test_new.py"])
    assert [(r.id, r.outcome) for r in cmp.new] == [
        ("tests/ut/test_new.py::n1", "passed"),
        ("tests/ut/test_new.py::n2", "failed"),
    ]
    assert cmp.fork_added_bad == [("tests/ut/test_new.py::n2", "failed")]
    assert not cmp.ok


@pytest.mark.parametrize("outcome", ["failed", "error", "skipped", "xfailed"])
def test_fork_added_test_not_passing_fails_the_run(outcome):
    fork = dict(BASE, **_results(test_new__n1=outcome))
    cmp = fork_test.compare(BASE, fork, ["tests/ut/test_new.py"])
    assert not cmp.ok
    # ... also without a base run (--fork-only)
    assert not fork_test.compare(None, fork, ["tests/ut/test_new.py"]).ok


def test_fork_added_file_that_ran_no_test_fails_the_run_unless_excluded():
    cmp = fork_test.compare(BASE, dict(BASE), ["tests/ut/test_never.py"])
    assert cmp.fork_added_bad == [("tests/ut/test_never.py", "ran no test (not collected?)")]
    excluded = fork_test.compare(BASE, dict(BASE), ["tests/ut/ops/a2/test_npu.py"], {"tests/ut/ops/a2/test_npu.py"})
    assert excluded.ok


def test_new_test_not_added_by_the_fork_may_fail():
    """A test id new in the fork outside the fork's own files (e.g. a new parameter of an
    upstream test) is listed, not judged; upstream tests are judged by the base comparison."""
    fork = dict(BASE, **_results(test_a__t9="failed"))
    cmp = fork_test.compare(BASE, fork, [])
    assert cmp.ok and [r.id for r in cmp.new] == ["tests/ut/test_a.py::t9"]


def test_steps_failing_fail_the_run_and_nothing_to_run_does_not():
    cmp = fork_test.compare(BASE, dict(BASE), [])
    nothing = fork_test.Step("tooling tests", "none", "(--no-tooling-tests)")
    failed = fork_test.Step("kernel op tests", "FAILED", "exit 1")
    assert fork_test.verdict(cmp, [nothing]) == []
    assert fork_test.verdict(cmp, [nothing, failed]) == ["kernel op tests failed"]


def _c(**kw):
    return fork_test.Counter({o: kw.get(o, 0) for o in fork_test.OUTCOMES})


@pytest.mark.parametrize(
    "rc, c, allow_skips, status",
    [
        (0, _c(passed=3), False, "passed"),
        (1, _c(passed=2, failed=1), True, "FAILED"),
        (0, _c(), True, "FAILED"),  # ran no test
        (0, _c(passed=2, skipped=1), False, "FAILED"),  # a fork-added kernel test skipped
        (0, _c(passed=2, xfailed=1), False, "FAILED"),
        (0, _c(passed=2, skipped=1), True, "passed"),  # the tooling's own tests may skip
    ],
)
def test_step_judgement(rc, c, allow_skips, status):
    assert fork_test.judge_step("s", rc, c, 1.0, junit=True, allow_skips=allow_skips).status == status


def test_step_without_junit_is_judged_by_exit_code():
    assert fork_test.judge_step("s", 0, _c(), 1.0, junit=False, allow_skips=False).status == "passed"
    assert fork_test.judge_step("s", 2, _c(), 1.0, junit=False, allow_skips=False).failed


def test_fork_added_test_files_come_from_the_overlay(tmp_path):
    _touch(
        tmp_path,
        "tests/ut/worker/test_mamba_copy.py",
        "tests/ut/worker/helpers.py",
        "tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_batch_memmove.py",
        "vllm_ascend/worker/test_not_a_test_dir.py",
    )
    assert fork_test.fork_added_test_files(tmp_path) == [
        "tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_batch_memmove.py",
        "tests/ut/worker/test_mamba_copy.py",
    ]


def test_pytest_args_default_target_and_override():
    assert fork_test.ut_pytest_args(["tests/ut/ops/a2"], None, []) == ["tests/ut", "--ignore=tests/ut/ops/a2"]
    assert fork_test.ut_pytest_args([], "mamba", ["--", "-x", "tests/ut/worker"]) == [
        "-k", "mamba", "-x", "tests/ut/worker",
    ]  # fmt: skip


def test_base_cache_key_depends_on_base_env_and_selection(tmp_path):
    e1 = testenv.TestEnv(tmp_path, "v1", "t1")
    e2 = testenv.TestEnv(tmp_path, "v2", "t1")
    k = fork_test.base_cache_key("a" * 64, e1, ["tests/ut"])
    assert k == fork_test.base_cache_key("a" * 64, e1, ["tests/ut"])
    assert k != fork_test.base_cache_key("b" * 64, e1, ["tests/ut"])
    assert k != fork_test.base_cache_key("a" * 64, e2, ["tests/ut"])
    assert k != fork_test.base_cache_key("a" * 64, e1, ["tests/ut", "-k", "x"])


# --- the environment: requirements, stamps, idempotency ----------------------------------


def test_filter_requirements_drops_npu_cuda_and_build_entries():
    text = textwrap.dedent(
        """\
        # comment
        cmake>=3.26
        numpy
        pip
        setuptools>=64
        setuptools-scm>=8
        torch==2.10.0
        torch-npu==2.10.0.post4
        torchvision==0.25.0
        torchaudio==2.10.0
        triton-ascend==3.2.2
        wheel
        xgrammar>=0.1.30  # inline comment
        memfabric_hybrid==1.2.0
        memcache_hybrid==1.2.0
        arctic-inference==0.1.1
        transformers==5.5.4
        Torch_NPU==1.0
        numba; platform_machine == "x86_64"
        """
    )
    kept, dropped = testenv.filter_requirements(text)
    assert kept == ["numpy", "xgrammar>=0.1.30", "transformers==5.5.4", 'numba; platform_machine == "x86_64"']
    assert len(dropped) == 14


def test_filter_requirements_refuses_includes():
    with pytest.raises(BadInput, match="line 2"):
        testenv.filter_requirements("numpy\n-r other.txt\n")


POLICY = """\
# Versioning policy

## Release compatibility matrix

The table below is the release compatibility matrix for vLLM Ascend release.

| vLLM Ascend | vLLM              | Python          | Stable CANN |
|-------------|-------------------|-----------------|-------------|
| v0.30.0rc2  | v0.30.0           | >= 3.10, < 3.13 | 9.1.0       |
| v0.23.0.post1 | v0.23.0         | >= 3.10, < 3.13 | 9.1.0       |
| v0.14.0rc1  | v0.14.1           | >= 3.10, < 3.12 | 8.5.0       |

## Release cadence

| v9.9.9 | v1.0.0 |
"""


def _base_tree(root: Path, reqs: str = "numpy\ntorch==2.10.0\ntransformers==5.5.4\n", policy: str | None = POLICY):
    root.mkdir(parents=True, exist_ok=True)
    (root / "requirements.txt").write_text(reqs)
    if policy is not None:
        (root / testenv.VERSIONING_POLICY).parent.mkdir(parents=True, exist_ok=True)
        (root / testenv.VERSIONING_POLICY).write_text(policy)
    return root


@pytest.mark.parametrize(
    "version, vllm",
    [("0.30.0rc2", "0.30.0"), ("0.23.0.post1", "0.23.0"), ("0.14.0rc1", "0.14.1")],
)
def test_paired_vllm_comes_from_the_base_s_compatibility_matrix(tmp_path, version, vllm):
    found, how = testenv.paired_vllm(_base_tree(tmp_path), version)
    assert found == vllm and "compatibility matrix" in how


@pytest.mark.parametrize(
    "version, vllm", [("0.26.0rc1", "0.26.0"), ("0.23.0", "0.23.0"), ("9.9.9", "9.9.9"), ("1.2.3.post4", "1.2.3")]
)
def test_paired_vllm_falls_back_to_the_xyz_rule(tmp_path, version, vllm):
    # 9.9.9 is in a table of a later section, not the matrix
    found, how = testenv.paired_vllm(_base_tree(tmp_path), version)
    assert (found, "X.Y.Z rule" in how) == (vllm, True)
    found, how = testenv.paired_vllm(_base_tree(tmp_path / "nodoc", policy=None), version)
    assert found == vllm and "no docs/" in how


def test_recipe_reads_the_base_s_own_pins(tmp_path):
    base = testenv.read_base(_base_tree(tmp_path, "numpy\ntorch==2.10.0\ntransformers==5.14.1 # pinned\n"), "0.30.0rc2")
    assert base.vllm == "0.30.0" and base.transformers == "transformers==5.14.1"
    assert base.torch_pin == "torch==2.10.0" and "torch" in base.dropped
    recipe = testenv.venv_recipe(base)
    assert recipe["vllm"] == "vllm==0.30.0" and "transformers==5.14.1" in recipe["requirements"]


@pytest.fixture
def fake_builds(tmp_path, monkeypatch):
    """ensure() with the two builds replaced by recorders that create the directories."""
    calls: list[str] = []

    def venv(home, base, log):
        calls.append(f"venv {base.vllm}")
        (home / "venv").mkdir(exist_ok=True)
        if getattr(venv, "fail", False):
            raise ForkError("pip failed")

    def triton(home, log):
        calls.append("triton")
        (home / "site").mkdir(exist_ok=True)

    monkeypatch.setattr(testenv, "_build_venv", venv)
    monkeypatch.setattr(testenv, "_build_triton_site", triton)
    tree = _base_tree(tmp_path / "base")
    return calls, venv, tmp_path / "cache", tree


def test_ensure_builds_once_then_is_a_no_op(fake_builds, capsys):
    calls, _, cache, tree = fake_builds
    e1 = testenv.ensure(tree, "0.23.0.post1", root=cache)
    assert calls == ["venv 0.23.0", "triton"]
    assert e1.root.parent == cache and e1.root.name == f"venv-{e1.venv_hash[:16]}"
    stamp = json.loads((e1.root / "stamp.json").read_text())
    assert stamp["hash"] == e1.venv_hash and stamp["recipe"]["requirements"] == ["numpy", "transformers==5.5.4"]
    e2 = testenv.ensure(tree, "0.23.0.post1", root=cache)
    assert calls == ["venv 0.23.0", "triton"], "second run rebuilt something"
    assert e2 == e1
    assert "venv: up to date" in capsys.readouterr().out


def test_bases_with_the_same_recipe_share_one_env_and_others_get_their_own(fake_builds):
    calls, _, cache, tree = fake_builds
    post1 = testenv.ensure(tree, "0.23.0.post1", root=cache)
    final = testenv.ensure(tree, "0.23.0", root=cache)  # same vLLM, same requirements
    assert final.root == post1.root and calls == ["venv 0.23.0", "triton"]
    rc = testenv.ensure(tree, "0.30.0rc2", root=cache)  # another vLLM
    assert rc.root != post1.root and calls == ["venv 0.23.0", "triton", "venv 0.30.0"]
    assert rc.triton_site == post1.triton_site
    # the old environment is still there (switching bases back and forth rebuilds nothing)
    assert testenv.ensure(tree, "0.23.0.post1", root=cache) == post1 and len(calls) == 3


def test_changed_requirements_make_a_new_env(fake_builds):
    calls, _, cache, tree = fake_builds
    e1 = testenv.ensure(tree, "0.23.0.post1", root=cache)
    (tree / "requirements.txt").write_text("numpy\nscipy\n")
    e2 = testenv.ensure(tree, "0.23.0.post1", root=cache)
    assert calls == ["venv 0.23.0", "triton", "venv 0.23.0"]
    assert e2.venv_hash != e1.venv_hash and e2.triton_hash == e1.triton_hash and e2.stamp != e1.stamp
    # a change in a dropped entry changes nothing
    (tree / "requirements.txt").write_text("numpy\nscipy\ntorch==9.9\n")
    assert testenv.ensure(tree, "0.23.0.post1", root=cache) == e2 and len(calls) == 3


def test_changed_recipe_rebuilds(fake_builds, monkeypatch):
    calls, _, cache, tree = fake_builds
    testenv.ensure(tree, "0.23.0", root=cache)
    monkeypatch.setattr(testenv, "TRITON_SITE_SPEC", "triton==9.9.9")
    testenv.ensure(tree, "0.23.0", root=cache)
    assert calls == ["venv 0.23.0", "triton", "triton"]
    monkeypatch.setattr(testenv, "TEST_DEPS", (*testenv.TEST_DEPS, "pytest-timeout"))
    testenv.ensure(tree, "0.23.0", root=cache)
    assert calls[-1] == "venv 0.23.0"


def test_failed_build_leaves_no_stamp_and_is_retried(fake_builds):
    calls, venv, cache, tree = fake_builds
    venv.fail = True
    with pytest.raises(ForkError):
        testenv.ensure(tree, "0.23.0", root=cache)
    assert not list(cache.glob("venv-*/stamp.json"))
    venv.fail = False
    testenv.ensure(tree, "0.23.0", root=cache)
    assert calls == ["venv 0.23.0", "venv 0.23.0", "triton"]


def test_missing_directory_or_rebuild_flag_rebuilds(fake_builds, tmp_path):
    calls, _, cache, tree = fake_builds
    e = testenv.ensure(tree, "0.23.0", root=cache, link_dir=tmp_path / "build" / "testenv")
    assert (tmp_path / "build" / "testenv" / "venv").resolve() == e.venv.resolve()
    e.triton_site.rmdir()
    testenv.ensure(tree, "0.23.0", root=cache)
    assert calls == ["venv 0.23.0", "triton", "triton"]
    testenv.ensure(tree, "0.23.0", root=cache, rebuild=True)
    assert calls[-2:] == ["venv 0.23.0", "triton"]


def test_default_root_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "c"))
    assert testenv.default_root() == tmp_path / "c" / "testenv"


def test_missing_requirements_file_is_a_clear_error(tmp_path):
    with pytest.raises(BadInput, match="no requirements.txt"):
        testenv.ensure(tmp_path / "base", "0.23.0", root=tmp_path / "cache")


def test_run_env_drops_pythonpath_and_cargo(monkeypatch, tmp_path):
    cargo = str(Path.home() / ".cargo" / "bin")
    monkeypatch.setenv("PATH", f"{cargo}:/usr/bin")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = testenv.run_env(tmp_path / "venv", {"X": "1"})
    assert "PYTHONPATH" not in env
    assert env["PATH"].split(":") == [str(tmp_path / "venv" / "bin"), "/usr/bin"]
    assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0" and env["X"] == "1"
