"""Tests of the `test` verb's logic: exclusions, junit results, the base/fork comparison, steps (fast)."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from tools.fork.core.errors import BadInput
from tools.fork.testing import exclusions, junit, results, steps, suite, testenv

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
    ex = exclusions.parse_exclusions(text)
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
        exclusions.parse_exclusions(f"# header\n{line}\n", "ex.txt")
    assert "ex.txt:2" in str(info.value)


def test_exclusions_refuse_duplicates():
    with pytest.raises(BadInput, match="listed twice"):
        exclusions.parse_exclusions("tests/ut/a2/ # one\ntests/ut/a2 # two\n")


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
    ex = exclusions.load_exclusions(REPO)
    assert ex, "the repository's exclusions file lists nothing"
    assert all(e.reason for e in ex)
    ignored = {p for _, paths in exclusions.resolve_exclusions(ex, tmp_path) for p in paths}
    assert ignored == {"tests/ut/ops/a2", "tests/ut/eplb/core/a2", "tests/ut/ops/a3_2", "tests/ut/worker/310p"}


def test_exclusion_with_trailing_slash_matches_directories_only(tmp_path):
    _touch(tmp_path, "tests/ut/m/a2/test_x.py", "tests/ut/n/a2")  # n/a2 is a file
    ex = exclusions.parse_exclusions("tests/ut/**/a2/ # dirs\n")
    assert exclusions.resolve_exclusions(ex, tmp_path)[0][1] == ["tests/ut/m/a2"]


def test_node_id_exclusion_is_deselected_where_its_file_exists(tmp_path):
    """An upstream test that can hang: deselected by node id, the rest of its file still runs."""
    _touch(tmp_path, "tests/ut/d/test_x.py")
    ex = exclusions.parse_exclusions("tests/ut/d/test_x.py::test_hangs # a race\ntests/ut/e/test_y.py::t # gone\n")
    resolved = exclusions.resolve_exclusions(ex, tmp_path)
    assert [paths for _, paths in resolved] == [["tests/ut/d/test_x.py::test_hangs"], []]
    ignores = exclusions.ignored_paths(resolved)
    assert suite.ut_pytest_args(ignores, None, []) == ["tests/ut", "--deselect=tests/ut/d/test_x.py::test_hangs"]
    assert not exclusions.is_excluded("tests/ut/d/test_x.py", ignores)


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
def sample_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    for rel, body in _SAMPLE_TESTS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(body))
    return root


@pytest.fixture(scope="module")
def sample_results(sample_tree):
    """Real pytest junit output (xunit1, as the verb runs it) of a small suite."""
    root = sample_tree
    xml = root / "out.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
         "--continue-on-collection-errors", f"--junitxml={xml}", "tests/ut"],
        cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return junit.parse_junit(xml.read_text())


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
    c = junit.counts(sample_results)
    assert (c["passed"], c["failed"], c["error"], c["skipped"], c["xfailed"]) == (3, 2, 2, 1, 1)


def test_junit_worst_outcome_wins_for_a_repeated_id():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.ut.test_a" name="test_x" file="tests/ut/test_a.py"/>
      <testcase classname="tests.ut.test_a" name="test_x" file="tests/ut/test_a.py">
        <error message="teardown"/></testcase>
    </testsuite></testsuites>"""
    assert junit.parse_junit(xml)["tests/ut/test_a.py::test_x"].outcome == "error"


class _ThisPython:
    """A test environment that is this interpreter (no venv, no lock, nothing to install)."""

    python = sys.executable

    @staticmethod
    def env(extra=None):
        return {**os.environ, **(extra or {})}

    @staticmethod
    def lock(what=""):
        return contextlib.nullcontext()


def test_collected_ids_are_the_junit_ids_of_the_tests_that_run(sample_tree, sample_results, tmp_path, monkeypatch):
    # The base's collected ids and a run's junit ids must name a test alike: a run of only the files
    # the comparison needs is chosen by the one and compared by the other.
    monkeypatch.setattr(testenv, "install_tree", lambda *a: None)
    ids = suite.collect_ids(_ThisPython(), sample_tree, "1.0", ["tests/ut"], tmp_path)
    assert ids == {tid for tid in sample_results if "::" in tid}  # a file that cannot import has no ids


# --- base vs fork ------------------------------------------------------------------------


def _results(**outcomes: str) -> dict[str, junit.Result]:
    out = {}
    for key, outcome in outcomes.items():
        file, _, name = key.partition("__")
        tid = f"tests/ut/{file}.py::{name}"
        out[tid] = junit.Result(tid, outcome)
    return out


BASE = _results(test_a__t1="passed", test_a__t2="passed", test_b__t3="failed", test_b__t4="skipped")


def test_identical_runs_are_ok():
    cmp = results.compare(BASE, dict(BASE), [])
    assert cmp.ok and not cmp.new and not cmp.regressions
    assert results.verdict(cmp, []) == []


def test_pass_on_base_fail_on_fork_fails_the_run():
    fork = dict(BASE, **_results(test_a__t2="failed"))
    cmp = results.compare(BASE, fork, [])
    assert cmp.regressions == [("tests/ut/test_a.py::t2", "failed")]
    assert not cmp.ok
    assert any("pass on the base and not on the fork" in p for p in results.verdict(cmp, []))


@pytest.mark.parametrize("outcome", ["error", "skipped", "xfailed"])
def test_pass_on_base_not_passing_on_fork_fails_the_run(outcome):
    fork = dict(BASE, **_results(test_a__t1=outcome))
    assert not results.compare(BASE, fork, []).ok


def test_pass_on_base_missing_on_fork_fails_the_run():
    fork = {k: v for k, v in BASE.items() if not k.endswith("::t1")}
    cmp = results.compare(BASE, fork, [])
    assert cmp.lost == ["tests/ut/test_a.py::t1"] and not cmp.ok


def test_tests_of_a_file_a_patch_deletes_are_removed_not_lost():
    # A PR may replace an upstream test it makes obsolete: its tests are listed, not judged; a test
    # missing from any other file is still lost.
    fork = {k: v for k, v in BASE.items() if "test_a.py" not in k or k.endswith("::t2")}
    cmp = results.compare(BASE, fork, [], removed_files={"tests/ut/test_b.py"})
    assert cmp.lost == ["tests/ut/test_a.py::t1"] and not cmp.ok
    gone = {k: v for k, v in BASE.items() if "test_a.py" not in k}
    cmp = results.compare(BASE, gone, [], removed_files={"tests/ut/test_a.py"})
    assert cmp.ok and cmp.removed == ["tests/ut/test_a.py::t1", "tests/ut/test_a.py::t2"] and not cmp.lost


def test_failing_on_both_is_not_a_regression_and_a_fix_is_reported():
    fork = dict(BASE, **_results(test_b__t3="failed"))
    assert results.compare(BASE, fork, []).ok
    fixed = results.compare(BASE, dict(BASE, **_results(test_b__t3="passed")), [])
    assert fixed.ok and fixed.fixed == ["tests/ut/test_b.py::t3"]


def test_tests_broken_on_base_and_fork_alike_are_named(capsys):
    """docs/testing.md: tests that fail on both are listed (by id), not only counted, and not judged."""
    base = dict(BASE, **_results(test_c__t5="error", test_c__t6="failed"))
    fork = dict(base, **_results(test_c__t6="error", test_b__t3="passed"))
    cmp = results.compare(base, fork, [])
    assert cmp.ok and cmp.broken_both == ["tests/ut/test_c.py::t5", "tests/ut/test_c.py::t6"]
    results.print_comparison(cmp, True)
    out = capsys.readouterr().out
    listed = out.split("broken on base and fork alike", 1)[1].split("\n\n", 1)[0]
    assert "tests/ut/test_c.py::t5" in listed and "tests/ut/test_c.py::t6" in listed
    assert "test_b.py::t3" not in listed  # fixed on the fork: listed as such, not here


def test_each_base_s_results_have_a_folder_of_their_own(tmp_path):
    class Cfg:
        build_dir = tmp_path / "build"

    pin, final = suite.results_dir(Cfg, "1.0.0rc1"), suite.results_dir(Cfg, "0.9.0.post1")
    assert pin != final and pin.parent == final.parent == suite.results_dir(Cfg)
    Cfg.build_dir.mkdir()
    (Cfg.build_dir / "test-results").write_text("a file in the way\n")
    with pytest.raises(BadInput, match="is not a directory"):
        suite.results_dir(Cfg, "1.0.0rc1")
    assert (Cfg.build_dir / "test-results").read_text() == "a file in the way\n"


def test_new_fork_tests_are_listed_with_their_outcome():
    fork = dict(BASE, **_results(test_new__n1="passed", test_new__n2="failed"))
    cmp = results.compare(BASE, fork, ["tests/ut/test_new.py"])
    assert [(r.id, r.outcome) for r in cmp.new] == [
        ("tests/ut/test_new.py::n1", "passed"),
        ("tests/ut/test_new.py::n2", "failed"),
    ]
    assert cmp.fork_added_bad == [("tests/ut/test_new.py::n2", "failed")]
    assert not cmp.ok


@pytest.mark.parametrize("outcome", ["failed", "error", "skipped", "xfailed"])
def test_fork_added_test_not_passing_fails_the_run(outcome):
    fork = dict(BASE, **_results(test_new__n1=outcome))
    cmp = results.compare(BASE, fork, ["tests/ut/test_new.py"])
    assert not cmp.ok
    # ... also without a base run (--fork-only)
    assert not results.compare(None, fork, ["tests/ut/test_new.py"]).ok


def test_fork_added_file_that_ran_no_test_fails_the_run_unless_excluded():
    cmp = results.compare(BASE, dict(BASE), ["tests/ut/test_never.py"])
    assert cmp.fork_added_bad == [("tests/ut/test_never.py", "ran no test (not collected?)")]
    excluded = results.compare(BASE, dict(BASE), ["tests/ut/ops/a2/test_npu.py"], {"tests/ut/ops/a2/test_npu.py"})
    assert excluded.ok


def test_new_test_not_added_by_the_fork_may_fail():
    """A test id new in the fork outside the fork's own files (e.g. a new parameter of an
    upstream test) is listed, not judged; upstream tests are judged by the base comparison."""
    fork = dict(BASE, **_results(test_a__t9="failed"))
    cmp = results.compare(BASE, fork, [])
    assert cmp.ok and [r.id for r in cmp.new] == ["tests/ut/test_a.py::t9"]


def test_steps_failing_fail_the_run_and_nothing_to_run_does_not():
    cmp = results.compare(BASE, dict(BASE), [])
    nothing = steps.Step("tooling tests", "none", "(--no-tooling-tests)")
    failed = steps.Step("kernel op tests", "FAILED", "exit 1")
    assert results.verdict(cmp, [nothing]) == []
    assert results.verdict(cmp, [nothing, failed]) == ["kernel op tests failed"]


def _c(**kw):
    return Counter({o: kw.get(o, 0) for o in junit.OUTCOMES})


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
    assert steps.judge_step("s", rc, c, 1.0, junit=True, allow_skips=allow_skips).status == status


def test_step_without_junit_is_judged_by_exit_code():
    assert steps.judge_step("s", 0, _c(), 1.0, junit=False, allow_skips=False).status == "passed"
    assert steps.judge_step("s", 2, _c(), 1.0, junit=False, allow_skips=False).failed


def test_fork_added_test_files_are_those_the_series_adds_on_that_base(tmp_path):
    """From the base's fork tree, not the pin's overlay: a base that skips a patch lacks its tests."""
    from tools.fork.core.series import base_tag
    from tools.fork.tests.conftest import GIT_ENV

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, env=GIT_ENV)

    _touch(tmp_path, "tests/ut/worker/test_upstream.py", "tests/ut/worker/helpers.py")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "release")
    git("tag", base_tag("1.0.0"))
    _touch(
        tmp_path,
        "tests/ut/worker/test_mamba_copy.py",
        "tests/ut/worker/conftest_helpers.py",
        "tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_batch_memmove.py",
        "vllm_ascend/worker/test_not_a_test_dir.py",
    )
    (tmp_path / "tests/ut/worker/test_upstream.py").write_text("# a patch edits an upstream test\n")
    git("add", "-A")
    git("commit", "-q", "-m", "[Ops][BugFix] a patch")
    assert results.fork_added_test_files(tmp_path, "1.0.0") == [
        "tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_batch_memmove.py",
        "tests/ut/worker/test_mamba_copy.py",
    ]


def test_pytest_args_default_target_and_override():
    assert suite.ut_pytest_args(["tests/ut/ops/a2"], None, []) == ["tests/ut", "--ignore=tests/ut/ops/a2"]
    assert suite.ut_pytest_args([], "mamba", ["--", "-x", "tests/ut/worker"]) == [
        "-k", "mamba", "-x", "tests/ut/worker",
    ]  # fmt: skip


def test_base_cache_key_depends_on_base_env_and_selection(tmp_path):
    e1 = testenv.TestEnv(tmp_path, "v1", "t1")
    e2 = testenv.TestEnv(tmp_path, "v2", "t1")
    k = suite.base_cache_key("a" * 64, e1, ["tests/ut"])
    assert k == suite.base_cache_key("a" * 64, e1, ["tests/ut"])
    assert k != suite.base_cache_key("b" * 64, e1, ["tests/ut"])
    assert k != suite.base_cache_key("a" * 64, e2, ["tests/ut"])
    assert k != suite.base_cache_key("a" * 64, e1, ["tests/ut", "-k", "x"])


_OUTCOMES = ["passed", "passed", "passed", "failed", "error", "skipped", "xfailed", None]  # None: not collected


@pytest.mark.parametrize("seed", range(200))
def test_the_base_s_needed_files_give_the_whole_base_s_verdict(seed):
    # Random base and fork results over a few files; the comparison against the base's results in
    # only the files `files_the_base_must_run` names (with every id the base collects) finds the same
    # regressions, losses, removals, shared breakage and new tests as against the whole base.
    rng = random.Random(seed)
    ids = [f"tests/ut/test_{f}.py::t{i}" for f in "abcde" for i in range(4)]
    base = {t: junit.Result(t, o) for t in ids if (o := rng.choice(_OUTCOMES))}
    fork = {t: junit.Result(t, o) for t in ids if (o := rng.choice(_OUTCOMES))}
    if rng.random() < 0.3:  # a file the fork cannot import
        fork = {t: r for t, r in fork.items() if r.file != "tests/ut/test_b.py"}
        fork["tests/ut/test_b.py"] = junit.Result("tests/ut/test_b.py", "error")
    removed = {"tests/ut/test_e.py"} if rng.random() < 0.3 else set()
    if removed:
        fork = {t: r for t, r in fork.items() if r.file not in removed}
    collected = set(base)
    needed = set(results.files_the_base_must_run(collected, fork))
    part = {t: r for t, r in base.items() if r.file in needed}

    whole = results.compare(base, fork, [], removed_files=removed)
    got = results.compare(part, fork, [], removed_files=removed, base_collected=collected)
    for name in ("regressions", "lost", "removed", "broken_both", "new"):
        assert getattr(got, name) == getattr(whole, name), name
    assert got.ok == whole.ok
