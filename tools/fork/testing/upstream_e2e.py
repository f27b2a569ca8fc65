"""Upstream's own e2e tests of the modules the series changes: base vs fork, per test id.

The series changes some of upstream's modules (the files under vllm_ascend/ that its patches modify
or delete). Every upstream test file under tests/e2e that imports one of them (read with `ast`) is
run twice in each tree:

1. **import check**: collected (`pytest --collect-only`) the way upstream's CPU CI imports
   vllm_ascend: the tree installed editable, upstream's `tests/ut/conftest.py` loaded as a plugin
   (it stubs torch_npu). Every test id collected on the base must be collected on the fork.
2. **run**: under the Triton interpreter through the kernel harness, with the NPU mapped to the CPU
   (`--npu-on-cpu`, tools/kernel_harness/npu_cpu.py). Every test that passes on the base must pass
   on the fork (results.compare, as for tests/ut), and every test the series adds to these files
   (a patch's cases in an upstream test file) must pass on the fork.

The run pass on the base covers only the files where the fork's run fails, errors or skips a test
or lacks one the base collects (results.files_the_base_must_run, as for tests/ut). A test that passes
on neither tree under the interpreter (it needs an NPU operator, vLLM's engine, ...) is
import-checked only; `test` names those. The base's results of both passes are cached like the
tests/ut ones (per base sha256, environment, selection and harness).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import re
import subprocess
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.core import git
from tools.fork.core.series import Patch, base_tag, file_sections
from tools.fork.testing import testenv
from tools.fork.testing.junit import Result, counts, fmt_counts, is_test_file, parse_junit
from tools.fork.testing.results import compare, files_the_base_must_run, print_comparison, print_side_by_side
from tools.fork.testing.steps import Step, kernel_test_command
from tools.fork.testing.suite import SuiteRun, base_cache_path, load_cached, results_dir, store_cached

E2E_DIR = "tests/e2e"
PACKAGE = "vllm_ascend"
UT_CONFTEST = "tests/ut/conftest.py"  # upstream's CPU set-up: stubs torch_npu when there is no NPU
HARNESS_FILES = (
    "tools/kernel_harness/plugin.py",
    "tools/kernel_harness/loader.py",
    "tools/kernel_harness/npu_cpu.py",
    "tools/kernel_harness/ascend_ops.py",
)
# Bump when the way the two passes run changes (invalidates cached base results).
RUNNER_VERSION = 2
PASS_TIMEOUT_S = 20 * 60
NAME = "upstream e2e tests of changed modules"


def module_name(path: str) -> str | None:
    """`vllm_ascend/ops/x.py` -> `vllm_ascend.ops.x`; a package's `__init__.py` -> the package."""
    if not (path.startswith(PACKAGE + "/") and path.endswith(".py")):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def changed_modules(patches: list[Patch], base_tree: Path) -> dict[str, str]:
    """{module: path} of the upstream modules the series modifies or deletes (files it adds are its own)."""
    out: dict[str, str] = {}
    for patch in patches:
        for path in file_sections(patch.data):
            name = module_name(path)
            if name and (base_tree / path).is_file():
                out[name] = path
    return dict(sorted(out.items()))


def imported_modules(source: str) -> set[str]:
    """Absolute module names a file imports: `import a.b`, `from a.b import c` (a.b, and a.b.c if a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def select_tests(trees: list[Path], modules, exclude=()) -> dict[str, list[str]]:
    """{test file: the changed modules it imports} over upstream's test files under tests/e2e of `trees`
    (a file counts when it imports one in any of them); files in `exclude` (the fork's own) are left out."""
    wanted, skip = set(modules), set(exclude)
    found: dict[str, set[str]] = {}
    for tree in trees:
        for path in sorted((tree / E2E_DIR).rglob("*.py")) if (tree / E2E_DIR).is_dir() else []:
            rel = path.relative_to(tree).as_posix()
            if rel in skip or not is_test_file(rel):
                continue
            try:
                hits = imported_modules(path.read_text(errors="replace")) & wanted
            except SyntaxError:
                continue  # pytest reports it when the file is run
            if hits:
                found.setdefault(rel, set()).update(hits)
    return {f: sorted(m) for f, m in sorted(found.items())}


def harness_digest(root: Path) -> str:
    h = hashlib.sha256()
    for rel in HARNESS_FILES:
        path = root / rel
        h.update(rel.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return h.hexdigest()[:16]


# --- the two passes -----------------------------------------------------------------------------------


def run_command(tenv: testenv.TestEnv, root: Path, tree: Path, files: list[str], junit: Path):
    """The run pass: the kernel op tests' command (interpreter, harness) with the NPU mapped to the CPU."""
    argv, env, cwd = kernel_test_command(tenv, root, tree, files, junit)
    argv = [*argv[:3], "--npu-on-cpu", "--continue-on-collection-errors", "--tb=short", *argv[3:]]
    return argv, env, cwd


def import_command(tenv: testenv.TestEnv, tree: Path, files: list[str], junit: Path):
    """The import check: collect only, in upstream's CPU set-up (its tests/ut/conftest.py as a plugin)."""
    conftest = ["-p", UT_CONFTEST[:-3].replace("/", ".")] if (tree / UT_CONFTEST).is_file() else []
    argv = [
        str(tenv.python), "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "--noconftest", *conftest,
        "--continue-on-collection-errors", "-o", "junit_family=xunit1", f"--junitxml={junit}", f"--rootdir={tree}",
        *files,
    ]  # fmt: skip
    return argv, tenv.env({"VLLM_PLUGINS": "none"}), tree


def collected(stdout: str, files: list[str]) -> dict[str, Result]:
    """Test ids `pytest -q --collect-only` printed (one per line, relative to the rootdir)."""
    prefixes = tuple(f + "::" for f in files)
    return {line: Result(line, "passed") for line in stdout.splitlines() if line.startswith(prefixes)}


def write_junit(results: dict[str, Result], path: Path) -> None:
    """`results` as junit XML that junit.parse_junit reads back (to cache an import check)."""
    suite = ET.Element("testsuite", name="pytest")
    for r in results.values():
        file, _, rest = r.id.partition("::")
        module = file[:-3].replace("/", ".")
        parts = rest.split("::") if rest else []
        if not parts:  # a file-level entry (a collection error): parse_junit names it by its file
            case = ET.SubElement(suite, "testcase", classname="", name=module, file=file)
        else:
            classname = ".".join([module, *parts[:-1]])
            case = ET.SubElement(suite, "testcase", classname=classname, name=parts[-1], file=file)
        if r.outcome in ("failed", "error"):
            ET.SubElement(case, "failure" if r.outcome == "failed" else "error", message=r.message)
        elif r.outcome in ("skipped", "xfailed"):
            kind = {"type": "pytest.xfail"} if r.outcome == "xfailed" else {}
            ET.SubElement(case, "skipped", message=r.message, **kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = ET.Element("testsuites")
    root.append(suite)
    path.write_text(ET.tostring(root, encoding="unicode"))


def read_junit(junit: Path) -> dict[str, Result]:
    """parse_junit, with a file's collection error named by its exception line (pytest's message
    is "collection failure") rather than by pytest's generic message."""
    text = junit.read_text()
    results = parse_junit(text)
    for case in ET.fromstring(text).iter("testcase"):
        file = case.get("file")
        if case.get("classname") or not file or file not in results:
            continue
        for child in case:
            lines = [ln[1:].strip() for ln in (child.text or "").splitlines() if ln.startswith("E ")]
            if child.tag in ("error", "failure") and lines:
                results[file] = Result(file, results[file].outcome, lines[-1][:200])
    return results


def _run(argv, env, cwd, log: Path) -> tuple[int | None, str]:
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                stdin=subprocess.DEVNULL, timeout=PASS_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            f.write(exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or "")
            return None, ""
        f.write(proc.stdout)
    return proc.returncode, proc.stdout


class PassError(Exception):
    pass


def _outcome_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def run_pass(tenv, root: Path, tree: Path, version: str, label: str, files: list[str], out: Path) -> SuiteRun:
    """The run pass on one tree: results per test id."""
    junit, log = out / f"upstream-e2e-{label}.xml", out / f"upstream-e2e-{label}.log"
    if not files:  # the tree has none of them (pytest given no file would collect the whole directory)
        write_junit({}, junit)
        return SuiteRun(label, {}, 0.0, junit=junit)
    junit.unlink(missing_ok=True)
    print(f"fork test: [{NAME}: run, {label}] {len(files)} file(s) in {tree} (log {log})", flush=True)
    t0 = time.monotonic()
    rc, stdout = _run(*run_command(tenv, root, tree, files, junit), log)
    dt = time.monotonic() - t0
    print(f"fork test: [{NAME}: run, {label}]   {_outcome_line(stdout)} (exit {rc}, {dt:.0f} s)", flush=True)
    if rc is None:
        raise PassError(f"the run on the {label} ran past {PASS_TIMEOUT_S} s (see {log})")
    if rc not in (0, 1, 5) or not junit.exists():  # 5: nothing collected
        raise PassError(f"pytest could not run the tests on the {label} (exit {rc}; see {log})")
    results = read_junit(junit)
    write_junit(results, junit)  # with the collection errors' own messages, also in the cached copy
    return SuiteRun(label, results, dt, log=log, junit=junit)


def import_pass(tenv, tree: Path, version: str, label: str, files: list[str], out: Path) -> SuiteRun:
    """The import check on one tree: the ids it collects, and a `file: error` entry per file that does not."""
    junit, log = out / f"upstream-e2e-import-{label}.xml", out / f"upstream-e2e-import-{label}.log"
    if not files:
        write_junit({}, junit)
        return SuiteRun(label, {}, 0.0, junit=junit)
    junit.unlink(missing_ok=True)
    print(f"fork test: [{NAME}: import check, {label}] {len(files)} file(s) in {tree}", flush=True)
    t0 = time.monotonic()
    with tenv.lock(f"{label} import check"):
        testenv.install_tree(tenv, tree, version)
        rc, stdout = _run(*import_command(tenv, tree, files, junit), log)
    dt = time.monotonic() - t0
    print(f"fork test: [{NAME}: import check, {label}]   {_outcome_line(stdout)} (exit {rc}, {dt:.0f} s)", flush=True)
    if rc is None or not junit.exists():
        raise PassError(f"pytest could not collect the tests on the {label} (exit {rc}; see {log})")
    results = {**collected(stdout, files), **read_junit(junit)}  # junit: the collection errors
    write_junit(results, junit)
    return SuiteRun(label, results, dt, log=log, junit=junit)


# --- the step -------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the step found, for its summary and its tests."""

    files: dict[str, list[str]]
    run: object = None  # results.Comparison of the run pass (None: no base results)
    imports: object = None  # results.Comparison of the import check
    import_only: dict[str, list[str]] | None = None  # file -> its test ids that do not pass on the base
    fork_import_errors: list = field(default_factory=list)  # (file, why): without base results
    broken_files: dict[str, str] = field(default_factory=dict)  # file collected on the base, not on the fork: why


def import_checked_only(
    base_run: dict[str, Result], base_imports: dict[str, Result], fork_run: dict[str, Result]
) -> dict[str, list[str]]:
    """Test ids collected on the base that pass under the interpreter on neither tree, per file."""

    def passes(run, tid):
        return tid in run and run[tid].outcome == "passed"

    out: dict[str, list[str]] = {}
    for tid, r in sorted(base_imports.items()):
        if r.outcome == "passed" and not passes(base_run, tid) and not passes(fork_run, tid):
            out.setdefault(r.file, []).append(tid)
    return out


def _why(base_run: dict[str, Result], ids: list[str], file: str) -> str:
    """The first reason the base gives for a file's tests not passing."""
    for key in [file, *ids]:
        r = base_run.get(key)
        if r is not None and r.message:
            return re.sub(r"\s+", " ", r.message)[:140]
    outcomes = sorted({base_run[i].outcome for i in ids if i in base_run})
    if not outcomes:
        return "not run on the base"
    return f"{'/'.join(outcomes)} on the base without a message"


def upstream_e2e_step(
    cfg,
    tenv: testenv.TestEnv,
    *,
    version: str,
    base_sha256: str,
    base_tree: Path,
    fork_tree: Path,
    patches: list[Patch],
    added: list[str],
    fork_only: bool = False,
) -> Step:
    """Upstream's tests/e2e files that import a module the series changes: import check and run, base vs fork."""
    modules = changed_modules(patches, base_tree)
    files = select_tests([base_tree, fork_tree], modules, exclude=added)
    print(f"\nfork test: [{NAME}] the series changes {len(modules)} upstream module(s): {', '.join(modules) or '-'}")
    if not files:
        return Step(NAME, "none", f"no upstream test under {E2E_DIR} imports them")
    for f, mods in files.items():
        print(f"  {f}: imports {', '.join(mods)}")
    t0 = time.monotonic()
    out = results_dir(cfg, version)
    out.mkdir(parents=True, exist_ok=True)
    base_files = [f for f in files if (base_tree / f).is_file()]
    fork_files = [f for f in files if (fork_tree / f).is_file()]
    key = ["upstream-e2e", str(RUNNER_VERSION), harness_digest(cfg.root), *base_files]
    import_cache = base_cache_path(tenv, version, base_sha256, ["import", *key])
    try:
        base_imports = load_cached(import_cache)
        if base_imports is None and not fork_only:
            base_imports = import_pass(tenv, base_tree, version, "base", base_files, out)
            store_cached(base_imports, import_cache)
        fork_imports = import_pass(tenv, fork_tree, version, "fork", fork_files, out)
        fork_run = run_pass(tenv, cfg.root, fork_tree, version, "fork", fork_files, out)
        base_run = None
        if base_imports is not None:  # the base's run where the comparison needs it
            on_base = {tid for tid, r in base_imports.results.items() if r.outcome == "passed"}
            needed = [f for f in files_the_base_must_run(on_base, fork_run.results) if f in base_files]
            run_cache = base_cache_path(tenv, version, base_sha256, ["run", *key, "--files", *needed])
            base_run = load_cached(run_cache)
            if base_run is not None:
                print(f"fork test: [{NAME}] base results cached ({import_cache.name}, {run_cache.name})")
            elif not fork_only:
                base_run = run_pass(tenv, cfg.root, base_tree, version, "base", needed, out)
                store_cached(base_run, run_cache)
            if base_run is not None:
                base_run.files = len(needed)
    except PassError as exc:
        return Step(NAME, "FAILED", str(exc))
    removed = set(git.deleted_paths(fork_tree, base_tag(version), E2E_DIR))  # test files a patch replaces
    outcome = judge(files, base_run, base_imports, fork_run, fork_imports, version, removed)
    return summarize(outcome, base_run, fork_run, time.monotonic() - t0)


def judge(files, base_run, base_imports, fork_run, fork_imports, version: str, removed=frozenset()) -> Outcome:
    """Compare both passes per test id and print it (results.compare, as for tests/ut: the tests of a file
    a patch deletes, ``removed``, are listed as removed, not lost)."""
    outcome = Outcome(files)
    if base_run is None or base_imports is None:
        print(f"fork test: [{NAME}] no base results (--fork-only, none cached): the fork must collect every file")
        outcome.fork_import_errors = [
            (tid, r.message) for tid, r in sorted(fork_imports.results.items()) if r.outcome != "passed"
        ]
        for tid, why in outcome.fork_import_errors:
            print(f"  {tid}: does not import on the fork: {why}")
        return outcome
    on_base = {tid for tid, r in base_imports.results.items() if r.outcome == "passed"}
    outcome.imports = compare(base_imports.results, fork_imports.results, [], removed_files=removed)
    outcome.run = compare(base_run.results, fork_run.results, [], removed_files=removed, base_collected=on_base)
    outcome.import_only = import_checked_only(base_run.results, base_imports.results, fork_run.results)
    print_side_by_side(base_run, fork_run, version, title=f"upstream's {E2E_DIR} tests of the changed modules, run")
    # A file that no longer imports on the fork loses all its tests: named once, with its error.
    broken = {tid: r.message for tid, r in fork_imports.results.items() if r.outcome != "passed"}
    collected_on_base = {r.file for r in base_imports.results.values() if r.outcome == "passed"}
    outcome.broken_files = {f: why for f, why in sorted(broken.items()) if f in collected_on_base}
    lost = Counter(Result(tid, "passed").file for tid in outcome.run.lost)
    bad = outcome.broken_files
    shown = dataclasses.replace(
        outcome.run,
        lost=[t for t in outcome.run.lost if Result(t, "").file not in bad],
        new=[r for r in outcome.run.new if r.id not in bad],  # the broken file's own error entry
    )
    print_comparison(shown, True)
    gone = Counter(Result(tid, "").file for tid in outcome.imports.lost)
    if gone:
        print(f"\nfiles collected on the base {version}, NOT (all) on the fork:")
        for f in sorted(gone):
            why = f"does not import: {bad[f]}" if f in bad else "some of its tests are no longer collected"
            print(f"  {f}: {why} ({gone[f]} test(s) collected on the base, {lost[f]} of them pass there)")
        for tid in [t for t in outcome.imports.lost if Result(t, "").file not in bad][:50]:
            print(f"  {tid}: not collected on the fork")
    unchecked = {f: r.message for f, r in base_imports.results.items() if r.outcome != "passed"}
    if unchecked:
        print("\nnot checked:")
        for f, why in sorted(unchecked.items()):
            print(f"  {f}: does not import on the base {version} either ({why})")
    if outcome.import_only:
        print(f"\nimport-checked only (they do not pass on the base {version} under the interpreter):")
        for f, ids in outcome.import_only.items():
            n = sum(1 for tid in base_imports.results if base_imports.results[tid].file == f)
            print(f"  {f}: {len(ids)} of {n} test(s) ({_why(base_run.results, ids, f)})")
    return outcome


def problems(outcome: Outcome) -> list[str]:
    """Why the step fails: files that no longer import (named), then tests lost or regressed."""
    out = [f"{f.rsplit('/', 1)[-1]} does not import on the fork ({why})" for f, why in outcome.broken_files.items()]
    broken = set(outcome.broken_files)
    if outcome.run is not None:
        if outcome.run.regressions:
            out.append(f"{len(outcome.run.regressions)} pass on the base and not on the fork")
        lost = [t for t in outcome.run.lost if Result(t, "").file not in broken]
        if lost:
            out.append(f"{len(lost)} pass on the base and are missing from the fork")
        # cases a patch adds to an upstream test file: the series' own tests, so they must pass
        added = [r for r in outcome.run.new if r.outcome != "passed" and r.file not in broken]
        if added:
            out.append(f"{len(added)} that the series adds do not pass on the fork")
    if outcome.imports is not None:
        ids = [t for t, _ in outcome.imports.regressions] + outcome.imports.lost
        gone = [t for t in ids if Result(t, "").file not in broken]
        if gone:
            out.append(f"{len(gone)} collected on the base and not on the fork")
    if outcome.fork_import_errors:  # no base results: every file must import on the fork
        out.append(f"{len(outcome.fork_import_errors)} file(s) do not import on the fork")
    return out


def summarize(outcome: Outcome, base_run: SuiteRun | None, fork_run: SuiteRun, seconds: float) -> Step:
    """The step: FAILED on any loss; its counts are the fork's results of the tests judged by the run."""
    c = Counter()
    if base_run is not None:
        for tid, r in base_run.results.items():
            if r.outcome == "passed":
                f = fork_run.results.get(tid)
                c[f.outcome if f is not None else "error"] += 1
    n_only = sum(len(ids) for ids in (outcome.import_only or {}).values())
    detail = f"{len(outcome.files)} file(s); " + (
        f"base {fmt_counts(counts(base_run.results))} | fork {fmt_counts(counts(fork_run.results))}; "
        f"{n_only} import-checked only"
        if base_run is not None
        else "no base comparison (import check of the fork only)"
    )
    detail += f"; {seconds:.0f} s"
    found = problems(outcome)
    if found:
        return Step(NAME, "FAILED", "; ".join(found) + f" ({detail})", c)
    return Step(NAME, "passed", detail, c)
