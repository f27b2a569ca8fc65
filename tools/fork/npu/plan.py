"""What an NPU report runs, derived from the series: its op tests, the trees, and which patch each file is.

Derived, never listed by hand, so that it follows the series as patches come and go:
- the series' own op tests: the test files the patches add or change under KERNEL_TEST_DIR;
- upstream's e2e tests of the modules the series changes (upstream_e2e.select_tests);
- the tests of the grouped copy module: the series' tests under tests/ut/worker/ that import it
  (upstream's tests/ut mirrors the source tree);
- per upstream patch (fork-only ones left out), the files it touches: phases and test files are
  mapped to patches through them.

A plan is JSON (`save`/`load`), so that a folder staged here (`stage`) runs on a machine with no
git, no network access and no vLLM (a GPU or NPU host): the trees are paths relative to the plan's folder.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.fork.core import series
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput
from tools.fork.testing.junit import is_test_file
from tools.fork.testing.steps import KERNEL_TEST_DIR
from tools.fork.testing.upstream_e2e import changed_modules, imported_modules, select_tests

PLAN_FILE = "npu-plan.json"
GROUPED_COPY_MODULE = "vllm_ascend.worker.mamba_copy_groups"  # the default `torch` path's copy module
# What a staged tree keeps besides the test files and the modules the series touches: the kernels.
KERNEL_DIRS = ("vllm_ascend/ops/triton",)


@dataclass(frozen=True)
class PatchInfo:
    number: int  # 1-based position in patches/series
    name: str
    title: str
    upstream: bool  # False: fork-only (fork.toml), never sent upstream
    files: tuple[str, ...]


@dataclass
class Plan:
    tests_tree: str  # the materialized fork: the test files are read from here
    fork_tree: str  # the fork's kernels: a tree, or the folder holding an installed vllm_ascend
    base_tree: str  # the unpatched base's kernels
    version: str  # the base release
    op_tests: list[str] = field(default_factory=list)  # test files (relative to tests_tree)
    grouped_copy_tests: list[str] = field(default_factory=list)
    patches: list[PatchInfo] = field(default_factory=list)
    # test file -> the files of the modules the series changes that it imports (upstream's e2e tests)
    imports: dict[str, list[str]] = field(default_factory=dict)

    def resolved(self, where: Path) -> Plan:
        """The plan with its trees as absolute paths (relative ones taken from `where`)."""
        out = Plan(**{**self.__dict__})
        for name in ("tests_tree", "fork_tree", "base_tree"):
            path = Path(getattr(self, name))
            setattr(out, name, str(path if path.is_absolute() else (where / path).resolve()))
        return out


def derive(cfg: ForkConfig, tests_tree: Path, fork_tree: Path, base_tree: Path) -> Plan:
    """The plan for the pin's series, the fork materialized in `tests_tree`, the base in `base_tree`."""
    for what, tree in (("fork", tests_tree), ("base", base_tree)):
        if not (tree / "vllm_ascend").is_dir():
            fix = "python3 -m tools.fork apply" + (" --base-only" if what == "base" else "")
            raise BadInput(f"no {what} tree at {tree}: run `{fix}` first, or name one with --{what}-tree")
    patches = series.read(cfg)
    infos = [
        PatchInfo(i + 1, p.name, p.info.subject, p.name not in cfg.fork_only, tuple(series.file_sections(p.data)))
        for i, p in enumerate(patches)
    ]
    touched = {f for p in infos for f in p.files}
    own = sorted(f for f in touched if f.startswith(KERNEL_TEST_DIR + "/") and is_test_file(f))
    modules = changed_modules(patches, base_tree)  # {module: its file}
    upstream_tests = select_tests([base_tree, tests_tree], modules, exclude=own)
    op_tests = sorted(f for f in {*own, *upstream_tests} if (tests_tree / f).is_file())
    # upstream's tests/ut mirrors the source tree: vllm_ascend/worker/x.py is tested under tests/ut/worker/
    unit_dir = "tests/ut/" + GROUPED_COPY_MODULE.split(".", 1)[1].rsplit(".", 1)[0].replace(".", "/") + "/"
    grouped_tests = sorted(
        f
        for f in touched
        if f.startswith(unit_dir)
        and is_test_file(f)
        and (tests_tree / f).is_file()
        and GROUPED_COPY_MODULE in imported_modules((tests_tree / f).read_text(errors="replace"))
    )
    return Plan(
        tests_tree=str(tests_tree),
        fork_tree=str(fork_tree),
        base_tree=str(base_tree),
        version=cfg.pin.version,
        op_tests=op_tests,
        grouped_copy_tests=grouped_tests,
        patches=infos,
        imports={f: [modules[m] for m in upstream_tests.get(f, [])] for f in op_tests},
    )


def save(plan: Plan, path: Path) -> None:
    path.write_text(json.dumps(asdict(plan), indent=1) + "\n")


def load(path: Path) -> Plan:
    """A plan written by `save` (`--plan FILE`); its relative trees are taken from the file's folder."""
    try:
        data = json.loads(path.read_text())
        data["patches"] = [PatchInfo(**{**p, "files": tuple(p["files"])}) for p in data["patches"]]
        return Plan(**data).resolved(path.resolve().parent)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such plan (write one with `npu-report --stage DIR`)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{path}: not a plan written by `npu-report --stage` ({exc})") from None


def stage(plan: Plan, dest: Path) -> Plan:
    """Copy what the report runs from each tree into `dest/fork` and `dest/base` (the kernels, the
    modules the series touches, the test files), with `dest/npu-plan.json`: a folder that a device
    call can carry beside this repository's working tree (which holds tools/ and benchmarks/)."""
    if dest.exists() and not dest.is_dir():
        raise BadInput(f"--stage {dest}: not a folder")
    if dest.is_dir() and any(dest.iterdir()):
        if not (dest / PLAN_FILE).is_file():  # never empty a folder this did not write
            raise BadInput(f"--stage {dest}: not empty and not a staged folder: name a new one")
        shutil.rmtree(dest)
    touched = {f for p in plan.patches for f in p.files}
    tests = {*plan.op_tests, *plan.grouped_copy_tests}
    for label, tree in (("fork", Path(plan.fork_tree)), ("base", Path(plan.base_tree))):
        wanted = {f for f in touched if f.startswith("vllm_ascend/")} | {"vllm_ascend/_version.py"}
        for d in KERNEL_DIRS:
            wanted.update(p.relative_to(tree).as_posix() for p in (tree / d).rglob("*.py"))
        if label == "fork":
            tests_tree = Path(plan.tests_tree)
            for f in tests:
                _copy(tests_tree / f, dest / label / f)
        for f in sorted(wanted):
            _copy(tree / f, dest / label / f)
    staged = Plan(**{**plan.__dict__, "tests_tree": "fork", "fork_tree": "fork", "base_tree": "base"})
    dest.mkdir(parents=True, exist_ok=True)
    save(staged, dest / PLAN_FILE)
    return staged


def _copy(src: Path, dst: Path) -> None:
    if src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
