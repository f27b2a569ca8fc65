"""The deploy test against a REAL installation: what an image goes through, on this CPU.

  1. vllm-ascend <base> is installed NON-editable from a Python-only wheel built from its verified
     sdist (`SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 pip wheel --no-deps
     --no-build-isolation <sdist>`, cached), into a venv of its own that sees the test
     environment's packages (torch, vLLM, pytest, ...) through a .pth line;
  2. `docker/deploy-installed.sh` (the very script docker/Dockerfile.deploy runs) finds the
     installed vllm_ascend, deploys the series into it and verifies it;
  3. the fork's own CPU tests (the files the series adds under tests/ut/) run against the
     installed package, from a copy of the fork's tests/ that holds no vllm_ascend/, and every
     vllm_ascend module they load is checked to come from site-packages;
  4. `deploy --verify` passes, `deploy --revert` runs, site-packages is byte-identical to step 1
     (every path and every byte: folders and __pycache__ included), and `deploy --verify` now fails.

    python -m tools.fork.deploy.check [--python PY] [-C ROOT]

`check()` is what the `test` verb calls. PY is the test environment's Python (default:
build/testenv/venv/bin/python); it is used read-only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.core import config, upstream
from tools.fork.core.errors import BadInput, ForkError
from tools.fork.core.outputs import output_dir
from tools.fork.deploy.expected import PACKAGE, Expected, expected, sha256
from tools.fork.deploy.target import BACKUP_DIR
from tools.fork.testing import base_recipe, junit, venvs

SCRIPT = Path("docker") / "deploy-installed.sh"
PIP_ENV = {"SOC_VERSION": "ascend910b1", "COMPILE_CUSTOM_KERNELS": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

# Loaded by pytest from the root of the copied tests: proves where vllm_ascend came from.
_WHERE_CONFTEST = """\
import json, os, sys
from pathlib import Path

# vllm_ascend is checked at the end, not imported here: this conftest loads before upstream's
# tests/ut/conftest.py, which stubs torch_npu, and under vLLM 0.30 importing vllm_ascend resolves
# vLLM's platform (the ascend plugin imports torch_npu).
_PKG = Path(os.environ["FORK_DEPLOY_PKG"]).resolve()


def pytest_sessionfinish(session, exitstatus):
    mods = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if n.split(".")[0] == "vllm_ascend"}
    outside = sorted(n for n, f in mods.items() if f and not Path(f).resolve().is_relative_to(_PKG))
    if "vllm_ascend" not in mods:
        outside.append("vllm_ascend (never imported)")
    Path(os.environ["FORK_DEPLOY_REPORT"]).write_text(json.dumps({"modules": sorted(mods), "outside": outside}))
"""


@dataclass
class Result:
    version: str
    package: Path
    changed: list[str]  # files the series changes in the package
    tests: dict[str, int] = field(default_factory=dict)  # junit counts of the fork's tests
    test_files: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        t = ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())
        counts = ", ".join(f"{v} {k}" for k, v in self.tests.items())
        return (
            f"deploy check: vllm-ascend {self.version} installed from a wheel at {self.package}: "
            f"{len(self.changed)} file(s) deployed, verified, fork tests ({len(self.test_files)} file(s)): "
            f"{counts or 'none'}; reverted byte-identical (every path and byte of site-packages). Timings: {t}"
        )


def default_python(cfg: config.ForkConfig) -> Path:
    env = os.environ.get("FORK_DEPLOY_PYTHON")
    if env:
        return Path(env)
    return cfg.build_dir / "testenv" / "venv" / "bin" / "python"


def _run(cmd: list[str], *, what: str, cwd: Path | None = None, env: dict | None = None, ok=(0,)) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or venvs.run_env(None),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode not in ok:
        tail = "\n    ".join(out.strip().splitlines()[-30:])
        raise ForkError(f"deploy check: {what} failed (exit {proc.returncode}):\n    {tail}")
    return out


def wheel_for(cfg: config.ForkConfig, version: str, python: Path, work: Path) -> Path:
    """The Python-only wheel of the base release, built once from its sha256-checked sdist."""
    wheels = work / "wheels" / version
    found = sorted(wheels.glob(f"vllm_ascend-{version}-*.whl"))
    if found:
        return found[-1]
    sdist = upstream.obtain(cfg, version).source.sdist
    tmp = wheels.with_name(wheels.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # pip, as an image's vllm-ascend is built and installed with pip (the test venv is seeded with it).
    cmd = [python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp, sdist]
    _run(cmd, what=f"building the vllm-ascend {version} wheel", env=venvs.run_env(None, PIP_ENV))
    (built,) = tmp.glob("*.whl")
    tmp.rename(wheels)
    return wheels / built.name


def fresh_venv(python: Path, wheel: Path, work: Path) -> tuple[Path, Path]:
    """A venv that sees `python`'s site-packages (read-only) and has the wheel installed in its own."""
    base_site = venvs.purelib(python)
    venv = work / "venv"
    vpython = venv / "bin" / "python"
    if not vpython.exists() or _read(venv / "base.txt") != str(base_site):
        shutil.rmtree(venv, ignore_errors=True)
        _run([python, "-m", "venv", "--without-pip", venv], what="creating the venv")
        (venv / "base.txt").write_text(str(base_site))
    site = venvs.purelib(vpython)
    for old in [site / PACKAGE, site / BACKUP_DIR, *site.glob("vllm_ascend-*.dist-info")]:
        shutil.rmtree(old, ignore_errors=True)  # ours: left over from an earlier run
    # The test environment's site-packages as a path, not as a site dir (its .pth files would bring
    # its editable vllm_ascend); its torchvision shim, which a .pth of its own loads, is loaded here.
    lines = [str(base_site)]
    if (base_site / f"{base_recipe.TORCHVISION_SHIM_MODULE}.py").exists():
        lines.append(f"import {base_recipe.TORCHVISION_SHIM_MODULE}")
    (site / "_fork_deploy_check_base.pth").write_text("\n".join(lines) + "\n")
    # -I: the test environment may hold an (editable) vllm_ascend of its own; never touch it.
    _run(
        [vpython, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--no-index", wheel],
        what="installing the wheel",
        env=venvs.run_env(None, PIP_ENV),
    )
    return vpython, site


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def added_tests(exp: Expected) -> list[str]:
    """The CPU test files the series adds (tests/ut/**/test_*.py)."""
    return [
        ch.path
        for ch in exp.changes
        if ch.path.startswith("tests/ut/") and ch.base is None and ch.fork is not None
        and Path(ch.path).name.startswith("test_") and ch.path.endswith(".py")
    ]  # fmt: skip


def run_fork_tests(vpython: Path, pkg: Path, tree: Path, files: list[str], work: Path) -> dict[str, int]:
    """Run `files` from a copy of the fork's tests/ (no vllm_ascend/ beside it) against `pkg`."""
    if not files:
        return {}
    with tempfile.TemporaryDirectory(prefix="fork-deploy-tests-", dir=work) as tmp:
        root = Path(tmp)
        shutil.copytree(tree / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        if (tree / "pyproject.toml").exists():  # upstream's pytest settings (markers, asyncio mode)
            shutil.copy2(tree / "pyproject.toml", root / "pyproject.toml")
        (root / "conftest.py").write_text(_WHERE_CONFTEST)
        report, junit = root / "where.json", root / "junit.xml"
        env = venvs.run_env(None, {"FORK_DEPLOY_PKG": str(pkg), "FORK_DEPLOY_REPORT": str(report)})
        cmd = [
            vpython,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "--rootdir",
            root,
            *files,
        ]
        out = _run(cmd, what="the fork's tests against the installed package", cwd=root, env=env, ok=(0, 1))
        counts = junit_counts(junit)
        where = json.loads(report.read_text()) if report.exists() else None
    if counts.get("failed") or counts.get("error") or not counts.get("passed"):
        tail = "\n    ".join(out.strip().splitlines()[-40:])
        raise ForkError(f"deploy check: the fork's tests failed against the installed package ({counts}):\n    {tail}")
    if counts.get("skipped"):
        raise ForkError(
            f"deploy check: fork tests were skipped against the installed package ({counts}); they must run"
        )
    if where is None or where["outside"]:
        raise ForkError(f"deploy check: vllm_ascend modules loaded from outside {pkg}: {where}")
    return counts


def junit_counts(path: Path) -> dict[str, int]:
    """passed / failed / error / skipped (xfailed counted as skipped) of a junit XML."""
    c = junit.counts(junit.parse_junit(path.read_text()))
    return {"passed": c["passed"], "failed": c["failed"], "error": c["error"], "skipped": c["skipped"] + c["xfailed"]}


def tree_state(root: Path) -> dict[str, str]:
    """Every path under `root`, folders and compiled files (__pycache__) included: relative path ->
    "dir", "link -> TARGET" or the file's sha256. `deploy --revert` must give back exactly this."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = sha256(path.read_bytes())
    return out


def state_differences(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return [
        f"{rel}: {'missing' if rel not in after else 'added' if rel not in before else 'content differs'}"
        for rel in sorted(set(before) | set(after))
        if before.get(rel) != after.get(rel)
    ]


def check(cfg: config.ForkConfig, python: Path | None = None, *, version: str | None = None, work: Path | None = None):
    """Install, deploy, test, verify, revert, compare. Raises ForkError on any failure."""
    if work is not None:
        output_dir(work, "--work")  # before any work
    python = Path(python or default_python(cfg))
    if not python.exists():
        raise BadInput(
            f"deploy check: no test environment Python at {python}; build it (`python -m tools.fork test "
            "--env-only`) or set FORK_DEPLOY_PYTHON"
        )
    version = cfg.base(version).version
    # One folder a base: `make test` checks two bases side by side.
    work = output_dir(work or cfg.build_dir / "deploy-check" / version, "--work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t = time.monotonic()

    def lap(name: str) -> None:
        nonlocal t
        now = time.monotonic()
        timings[name] = now - t
        t = now

    exp = expected(cfg, version, scope=None)
    tree, test_files = exp.tree, added_tests(exp)
    changed = [
        f"{ch.status} {ch.path}" for ch in exp.changes if ch.status != "=" and ch.path.startswith("vllm_ascend/")
    ]
    if not changed:
        raise BadInput(f"deploy check: the series changes nothing under vllm_ascend/ on {version}: nothing to deploy")
    lap("materialize")
    wheel = wheel_for(cfg, version, python, work)
    vpython, site = fresh_venv(python, wheel, work)
    pkg = site / PACKAGE
    before = tree_state(site)
    lap("install")

    root_args = ["-C", str(cfg.root)]
    script_env = venvs.run_env(None, {"FORK_REPO": str(cfg.root)})
    out = _run(["sh", config.REPO_ROOT / SCRIPT, vpython], what=str(SCRIPT), cwd=work, env=script_env)
    if f"imports vllm_ascend from {pkg}" not in out:
        raise ForkError(f"deploy check: {SCRIPT} did not find the installed package {pkg}:\n{out}")
    lap("deploy+verify")
    counts = run_fork_tests(vpython, pkg, tree, test_files, work)
    lap("fork tests")
    fork_cli = [vpython, "-m", "tools.fork", *root_args, "deploy"]
    _run([*fork_cli, "--verify", pkg], what="deploy --verify after the tests", cwd=config.REPO_ROOT)
    _run([*fork_cli, "--revert", pkg], what="deploy --revert", cwd=config.REPO_ROOT)
    differ = state_differences(before, tree_state(site))
    if differ:
        raise ForkError(
            f"deploy check: after --revert, site-packages differs from before the deploy ({len(before)} paths "
            f"compared, folders and __pycache__ included): {differ[:20]}"
        )
    _run(
        [*fork_cli, "--verify", pkg], what="deploy --verify after the revert (must fail)", cwd=config.REPO_ROOT, ok=(1,)
    )
    lap("verify+revert+compare")
    pip_uninstall_leaves_nothing(python, vpython, site, script_env, exp)
    lap("deploy+pip uninstall")
    return Result(version, pkg, changed, counts, test_files, timings)


def pip_uninstall_leaves_nothing(python: Path, vpython: Path, site: Path, script_env: dict, exp) -> None:
    """Deploy again, compile the added modules, `pip uninstall`: nothing of vllm_ascend may remain."""
    _run(["sh", config.REPO_ROOT / SCRIPT, vpython], what=f"{SCRIPT} (again)", cwd=site, env=script_env)
    added = [str(site / ch.path) for ch in exp.changes if ch.status == "A" and ch.path.startswith("vllm_ascend/")]
    py_added = [f for f in added if f.endswith(".py")]
    if py_added:
        _run([vpython, "-m", "py_compile", *py_added], what="compiling the added modules")
    # The test env's site-packages may hold a vllm_ascend of its own: set the .pth aside so the
    # uninstall can only see ours (pip runs from the test env, inside our venv's interpreter).
    pth = site / "_fork_deploy_check_base.pth"
    aside = site.parent / (pth.name + ".aside")
    pth.rename(aside)
    try:
        _run([python, "-m", "pip", "--python", vpython, "uninstall", "-y", "vllm-ascend"], what="pip uninstall")
    finally:
        aside.rename(pth)
    left = sorted(p.name for p in site.iterdir() if p.name.startswith(("vllm_ascend", BACKUP_DIR)))
    if left:
        raise ForkError(f"deploy check: `pip uninstall vllm-ascend` after a deploy left {left} in {site}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.fork.deploy.check", description=__doc__.split("\n\n")[0])
    p.add_argument("-C", dest="root", type=Path, default=config.REPO_ROOT, help="the fork repository")
    p.add_argument("--python", type=Path, help="the test environment's Python (default build/testenv/venv/bin/python)")
    p.add_argument("--base", help="a base in fork.toml (default: the pin)")
    p.add_argument(
        "--work", type=Path, help="working directory (default: build/deploy-check/VERSION of the repository)"
    )
    args = p.parse_args(argv)
    try:
        cfg = config.load(args.root.resolve())
        result = check(cfg, args.python, version=args.base, work=args.work)
    except ForkError as exc:
        print(str(exc), file=sys.stderr)
        return exc.exit_code
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
