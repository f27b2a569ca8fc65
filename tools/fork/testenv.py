"""The CPU test environment: one cached, idempotent build under `build/testenv/`.

What it holds (FACTS.md, "Upstream's CPU unit tests run here"):
  venv/         torch 2.13.0 CPU, vLLM 0.23.0 built from its sdist as pure Python
                (VLLM_TARGET_DEVICE=empty), upstream's requirements.txt minus the NPU/CUDA-only
                and build-only entries, the test dependencies (pytest<9 as upstream pins,
                pytest-asyncio, pytest-mock, hypothesis, ray for test_npu_ipc_engine.py);
                upstream `triton` uninstalled afterwards (xgrammar pulls it in; upstream's CPU CI
                uninstalls it too). torchvision 0.28.0 (PyPI's CUDA build) with a `sitecustomize`
                shim that lets it import beside CPU torch (see TORCHVISION_SHIM).
  triton-site/  `pip install --target ... --no-deps triton==3.7.1`: the Triton interpreter for the
                kernel op tests, put on PYTHONPATH only in their own process.
  *.stamp       a hash of the recipe (and of the requirements file); an unchanged recipe makes
                `ensure()` a no-op, a changed one rebuilds that part from scratch.

`vllm_ascend` itself is not part of the environment: `install_tree()` installs a materialized
tree editable into the venv just before its suite runs.

Run `python -m tools.fork test --env-only` to build or check it alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tools.fork.errors import BadInput, ForkError

# Bump when the build logic changes in a way the constants below do not show.
RECIPE_VERSION = 1

TORCH = "torch==2.13.0"  # the CPU wheel this kind of machine holds (pip takes it from disk)
VLLM = "vllm==0.23.0"
VLLM_VERSION = "0.23.0"
TRANSFORMERS = "transformers==5.5.4"  # as upstream's requirements.txt pins it
# Needed importable because vLLM's sdist is built with --no-build-isolation.
VLLM_BUILD_TOOLS = (
    "setuptools>=77.0.3,<81",
    "setuptools-scm>=8",
    "setuptools-rust",
    "wheel",
    "packaging",
    "cmake",
    "ninja",
    "jinja2",
)
# Test dependencies, as upstream's requirements-dev.txt pins them.
TEST_DEPS = (
    "pytest>=6.0,<9.0.0",
    "pytest-asyncio",
    "pytest-mock",
    "hypothesis",
    "ray>=2.47.1,<=2.48.0",
    # The kernel op tests run in this venv (+ triton-site): Triton's interpreter calls int() on
    # 1-element arrays, an error from numpy 2.4 on (seen by the kernel harness).
    "numpy<2.4",
)
# Entries of upstream's requirements.txt left out: NPU-only, CUDA-builds, build tools.
DROPPED_REQUIREMENTS = (
    "torch",  # installed first, the local CPU wheel
    "torch-npu",  # needs CANN (libhccl.so); upstream's tests/ut/conftest.py stubs it
    "torchvision",  # upstream pins 0.25.0 (torch 2.10); TORCHVISION below pairs with torch 2.13
    "torchaudio",
    "triton-ascend",  # ships its own `triton`; the NPU compiler
    "memfabric*",  # Ascend memory-pool backends (memfabric_hybrid)
    "memcache*",  # (memcache_hybrid)
    "arctic-inference",  # CUDA-only
    "cmake",
    "pip",
    "setuptools*",  # setuptools, setuptools-scm: build tools, pinned above
    "wheel",
)
# PyPI's torchvision is a CUDA build; beside CPU torch its C++ ops do not load and its Python
# side then fails registering fake kernels for torchvision::nms/qnms. Upstream's suite needs it
# importable (transformers' Qwen2-VL image processor, reached from vllm_ascend's patches, imports
# torchvision.transforms.v2), not its ops: TORCHVISION_SHIM defines the two schemas first.
TORCHVISION = "torchvision==0.28.0"  # the release paired with torch 2.13
TORCHVISION_SHIM = """\
# Written by tools/fork/testenv.py (the fork's CPU test env). PyPI's torchvision is a CUDA
# build whose C++ ops do not load beside the CPU torch wheel; its Python side then fails
# registering fake kernels for torchvision::nms / qnms. Define those two schemas just before
# torchvision is first imported (torch is not imported at interpreter start-up).
import sys as _sys


class _TorchvisionCpuShim:
    libs = []

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        _sys.meta_path.remove(self)
        try:
            import torch

            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            self.libs.append(lib)  # kept alive: a collected Library drops its definitions
        except Exception:
            pass
        return None  # the regular finders import torchvision itself


_sys.meta_path.insert(0, _TorchvisionCpuShim())
"""
UNINSTALL_AFTER = ("triton",)
TRITON_SITE_SPEC = "triton==3.7.1"

# The environment every command here and every test run gets.
RUN_ENV = {
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}
_STRIP_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "CONDA_PREFIX")


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dropped(name: str) -> bool:
    canon = _canon(name)
    for pattern in DROPPED_REQUIREMENTS:
        if pattern.endswith("*") and canon.startswith(_canon(pattern[:-1])):
            return True
        if canon == _canon(pattern):
            return True
    return False


_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def filter_requirements(text: str) -> tuple[list[str], list[str]]:
    """Upstream's requirements.txt -> (requirement lines kept, names dropped).

    Comments and blank lines go; `-r`/`-c`/option lines are refused (the recipe would not
    see what they pull in).
    """
    kept, dropped = [], []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = "" if raw.lstrip().startswith("#") else raw.split(" #", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-"):
            raise BadInput(f"requirements line {lineno}: option lines are not supported here: {line!r}")
        m = _REQ_NAME.match(line)
        if not m:
            raise BadInput(f"requirements line {lineno}: cannot read a package name in {line!r}")
        if _dropped(m.group(1)):
            dropped.append(m.group(1))
        else:
            kept.append(line)
    return kept, dropped


def venv_recipe(requirements: list[str]) -> dict:
    """Everything the venv's content depends on; its hash is the venv's stamp."""
    return {
        "recipe_version": RECIPE_VERSION,
        "python": ".".join(map(str, sys.version_info[:3])),
        "torch": TORCH,
        "torchvision": [TORCHVISION, hashlib.sha256(TORCHVISION_SHIM.encode()).hexdigest()],
        "vllm": [VLLM, VLLM_VERSION, TRANSFORMERS],
        "vllm_build_tools": list(VLLM_BUILD_TOOLS),
        "requirements": requirements,
        "test_deps": list(TEST_DEPS),
        "uninstall_after": list(UNINSTALL_AFTER),
    }


def triton_recipe() -> dict:
    return {
        "recipe_version": RECIPE_VERSION,
        "python": ".".join(map(str, sys.version_info[:2])),
        "spec": TRITON_SITE_SPEC,
    }


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Stamp:
    """`<part>.stamp`: the recipe hash a part was built from, written only after a full build."""

    path: Path

    def read(self) -> str | None:
        try:
            return json.loads(self.path.read_text())["hash"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def matches(self, digest: str) -> bool:
        return self.read() == digest

    def write(self, digest: str, recipe: dict, seconds: float) -> None:
        data = {"hash": digest, "recipe": recipe, "build_seconds": round(seconds, 1)}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class TestEnv:
    __test__ = False  # not a pytest class

    root: Path  # build/testenv
    venv_hash: str
    triton_hash: str

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def triton_site(self) -> Path:
        return self.root / "triton-site"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    @property
    def stamp(self) -> str:
        """Identifies the whole environment (for result caches)."""
        return hashlib.sha256(f"{self.venv_hash}:{self.triton_hash}".encode()).hexdigest()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return run_env(self.venv, extra)


def run_env(venv: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The process environment for commands in the test env: no PYTHONPATH, no cargo."""
    env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV}
    cargo = str(Path.home() / ".cargo" / "bin")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p.rstrip("/") != cargo]
    if venv is not None:
        path.insert(0, str(venv / "bin"))
        env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join(path)
    env.update(RUN_ENV)
    if extra:
        env.update(extra)
    return env


def _say(msg: str) -> None:
    print(f"testenv: {msg}", flush=True)


def _run(cmd: list[str], *, env: dict[str, str], log: Path, what: str) -> float:
    """Run a build step, output to `log`; raise with the log's tail on failure."""
    t0 = time.monotonic()
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-25:])
        raise ForkError(f"test env: {what} failed (exit {proc.returncode}, log {log}):\n    {tail}")
    _say(f"  {what}: {dt:.1f} s")
    return dt


def _pip(venv: Path, *args: str) -> list[str]:
    return [str(venv / "bin" / "python"), "-m", "pip", *args]


def _build_venv(root: Path, requirements: list[str], log: Path) -> None:
    venv = root / "venv"
    if venv.exists():
        shutil.rmtree(venv)
    env = run_env(venv)
    _run([sys.executable, "-m", "venv", str(venv)], env=run_env(None), log=log, what="create venv")
    _run(_pip(venv, "install", "-q", "--upgrade", "pip"), env=env, log=log, what="upgrade pip")
    # torch first, so that nothing later picks another build of it.
    _run(_pip(venv, "install", "-q", TORCH), env=env, log=log, what=f"install {TORCH} (CPU)")
    _run(
        _pip(venv, "install", "-q", "--no-deps", TORCHVISION),
        env=env,
        log=log,
        what=f"install {TORCHVISION} (--no-deps)",
    )
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "sitecustomize.py").write_text(TORCHVISION_SHIM)
    _say(f"  torchvision shim: {site / 'sitecustomize.py'}")
    _run(_pip(venv, "install", "-q", *VLLM_BUILD_TOOLS), env=env, log=log, what="install vLLM build tools")
    vllm_env = dict(env, VLLM_TARGET_DEVICE="empty", VLLM_VERSION_OVERRIDE=VLLM_VERSION)
    _run(
        _pip(venv, "install", "-q", "--no-build-isolation", "--no-binary", "vllm", VLLM, TRANSFORMERS),
        env=vllm_env,
        log=log,
        what=f"install {VLLM} from its sdist as pure Python",
    )
    reqs = root / "requirements.filtered.txt"
    reqs.write_text("".join(f"{r}\n" for r in requirements))
    _run(
        _pip(venv, "install", "-q", "-r", str(reqs), *TEST_DEPS, TORCH, TORCHVISION, TRANSFORMERS),
        env=env,
        log=log,
        what="install upstream's requirements (filtered) + test deps",
    )
    _run(
        _pip(venv, "uninstall", "-y", *UNINSTALL_AFTER), env=env, log=log, what="uninstall " + " ".join(UNINSTALL_AFTER)
    )
    check = (
        "import importlib.util as u, torch, torchvision, vllm, transformers, pytest\n"
        "import transformers.models.qwen2_vl.image_processing_qwen2_vl\n"
        "assert u.find_spec('triton') is None, 'triton still importable'\n"
        "assert torch.version.cuda is None, 'torch is a CUDA build: ' + torch.__version__\n"
        "mods = (torch, torchvision, vllm, transformers, pytest)\n"
        "print(' | '.join(f'{m.__name__} {m.__version__}' for m in mods))\n"
    )
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", check], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ForkError(f"test env: the built venv does not import as expected:\n{proc.stderr.strip()[-2000:]}")
    _say(f"  check: {proc.stdout.strip()}")
    freeze = subprocess.run(_pip(venv, "freeze", "--all"), env=env, capture_output=True, text=True)
    (root / "venv.freeze.txt").write_text(freeze.stdout)


def _build_triton_site(root: Path, log: Path) -> None:
    site = root / "triton-site"
    if site.exists():
        shutil.rmtree(site)
    _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), TRITON_SITE_SPEC],
        env=run_env(None),
        log=log,
        what=f"install {TRITON_SITE_SPEC} into {site.name}/ (--target, --no-deps)",
    )


def ensure(build_dir: Path, requirements_file: Path, *, rebuild: bool = False) -> TestEnv:
    """Build what is missing or stale under `build_dir/testenv`; a no-op when all is current."""
    t0 = time.monotonic()
    root = build_dir / "testenv"
    root.mkdir(parents=True, exist_ok=True)
    if not requirements_file.is_file():
        raise BadInput(f"{requirements_file} not found (materialize the fork first: `python -m tools.fork apply`)")
    requirements, dropped = filter_requirements(requirements_file.read_text())
    parts = [
        ("venv", venv_recipe(requirements), lambda log: _build_venv(root, requirements, log)),
        ("triton-site", triton_recipe(), lambda log: _build_triton_site(root, log)),
    ]
    hashes = {}
    for name, recipe, build in parts:
        digest = recipe_hash(recipe)
        hashes[name] = digest
        stamp = Stamp(root / f"{name}.stamp")
        if not rebuild and stamp.matches(digest) and (root / name).is_dir():
            _say(f"{name}: up to date (recipe {digest[:12]})")
            continue
        why = "forced" if rebuild else ("recipe changed" if stamp.read() else "not built yet")
        _say(f"{name}: building ({why}; recipe {digest[:12]}), log {root / (name + '.log')}")
        if name == "venv":
            _say(f"  requirements from {requirements_file}, left out: {', '.join(dropped) or '(none)'}")
        stamp.clear()
        log = root / f"{name}.log"
        log.write_text("")
        t1 = time.monotonic()
        build(log)
        stamp.write(digest, recipe, time.monotonic() - t1)
        _say(f"{name}: built in {time.monotonic() - t1:.1f} s")
    _say(f"ready in {time.monotonic() - t0:.1f} s ({root})")
    return TestEnv(root, hashes["venv"], hashes["triton-site"])


def install_tree(tenv: TestEnv, tree: Path, version: str) -> None:
    """Install the materialized `tree` editable into the venv (once per tree switch)."""
    marker = tenv.root / "editable.json"
    want = {"tree": str(tree.resolve()), "version": version, "venv": tenv.venv_hash}
    try:
        have = json.loads(marker.read_text())
    except (FileNotFoundError, ValueError):
        have = None
    if have == want and (tree / "vllm_ascend" / "_build_info.py").exists():
        _say(f"vllm_ascend editable from {tree}: already installed")
        return
    marker.unlink(missing_ok=True)
    env = tenv.env(
        {
            "SOC_VERSION": "ascend910b1",
            "COMPILE_CUSTOM_KERNELS": "0",
            "SETUPTOOLS_SCM_PRETEND_VERSION": version,
        }
    )
    log = tenv.root / "editable.log"
    log.write_text("")
    _run(
        _pip(tenv.venv, "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(tree)),
        env=env,
        log=log,
        what=f"install vllm_ascend editable from {tree}",
    )
    marker.write_text(json.dumps(want) + "\n")
