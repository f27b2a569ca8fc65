"""The CPU test environment of a base: derived from the base itself, built once, cached.

Where it comes from, per base tree (docs/testing.md):
  vLLM          the version the base pairs with: its own docs/source/community/versioning_policy.md
                ("Release compatibility matrix", the row for the base), else the X.Y.Z rule
                (vllm-ascend X.Y.Z[rcN|.postN] -> vLLM X.Y.Z). Built from vLLM's sdist as pure
                Python (VLLM_TARGET_DEVICE=empty) with its build tools (setuptools-rust included).
  requirements  the base's own requirements.txt minus the NPU/CUDA-only and build-only entries
                (transformers and every other pin as the base writes it).
  torch         the CPU wheel this kind of machine holds (TORCH); the base's own torch pin is
                for torch-npu and is reported when it differs.
  test deps     pytest<9 as upstream pins, pytest-asyncio, pytest-mock, hypothesis, ray.
Upstream `triton` is uninstalled afterwards (upstream's CPU CI does this too); torchvision 0.28.0
(PyPI's CUDA build) gets a `sitecustomize` shim that lets it import beside CPU torch.

Where it lives: under the user cache (`config.cache_dir()`: ~/.cache/vllm-ascend-fork, FORK_CACHE
overrides), so clean clones and CI reuse it:
  testenv/venv-<recipe hash>/     venv/, stamp.json (written only after a complete build), build.log,
                                  freeze.txt, base-results/ (cached base-suite results), lock
  testenv/triton-<recipe hash>/   site/ (`pip install --target ... --no-deps triton==3.7.1`, the
                                  Triton interpreter for the kernel op tests), stamp.json
The directory name is the hash of the recipe (everything the content depends on), so two bases
with the same recipe share one environment, and a changed recipe builds a new one beside the old.
`build/testenv/venv` is a link to the environment used last (for tools that look there).

`vllm_ascend` itself is not part of the environment: `install_tree()` installs a materialized tree
editable into the venv just before its suite runs, under the environment's lock (one suite run at
a time per environment, across processes).

Run `python -m tools.fork test --base VERSION --env-only` to build or check one alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.config import cache_dir
from tools.fork.errors import BadInput, ForkError

# Bump when the build logic changes in a way the constants below do not show.
RECIPE_VERSION = 2

TORCH = "torch==2.13.0"  # the CPU wheel this kind of machine holds (pip takes it from disk)
VERSIONING_POLICY = "docs/source/community/versioning_policy.md"
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


_VERSION_CELL = re.compile(r"^v?(\d+(?:\.\d+)*(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?)$")


def xyz_rule(version: str) -> str:
    """vllm-ascend X.Y.Z[rcN|.postN] -> vLLM X.Y.Z."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise BadInput(f"vllm-ascend {version!r}: cannot read X.Y.Z from it to pair a vLLM version")
    return ".".join(m.groups())


def matrix_vllm(policy_text: str, version: str) -> str | None:
    """The vLLM version the "Release compatibility matrix" table pairs with vllm-ascend `version`."""
    section = policy_text.split("Release compatibility matrix", 1)
    if len(section) != 2:
        return None
    header: list[str] | None = None
    for line in section[1].splitlines():
        if line.startswith("#"):
            break  # the next section
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        row = dict(zip(header, cells))
        ours, theirs = row.get("vllm ascend", ""), row.get("vllm", "")
        m, n = _VERSION_CELL.match(ours), _VERSION_CELL.match(theirs)
        if m and n and m.group(1) == version:
            return n.group(1)
    return None


def paired_vllm(tree: Path, version: str) -> tuple[str, str]:
    """(vLLM version, where it was read) for the base `version` materialized in `tree`."""
    policy = tree / VERSIONING_POLICY
    if policy.is_file():
        found = matrix_vllm(policy.read_text(errors="replace"), version)
        if found:
            return found, f"{VERSIONING_POLICY} (Release compatibility matrix)"
        return xyz_rule(version), f"the X.Y.Z rule ({VERSIONING_POLICY} has no row for {version})"
    return xyz_rule(version), f"the X.Y.Z rule (no {VERSIONING_POLICY} in the base)"


def requirement(lines: list[str], name: str) -> str | None:
    """The requirement line for `name` in `lines`, if any."""
    for line in lines:
        m = _REQ_NAME.match(line)
        if m and _canon(m.group(1)) == _canon(name):
            return line.split(";", 1)[0].strip()
    return None


@dataclass(frozen=True)
class BaseRecipe:
    """What a base asks of its test environment, read from the base's own files."""

    version: str  # vllm-ascend
    vllm: str  # the paired vLLM version
    vllm_from: str  # where that pairing was read
    requirements: list[str] = field(default_factory=list)  # the base's requirements.txt, filtered
    dropped: list[str] = field(default_factory=list)
    torch_pin: str | None = None  # the base's own torch line (for torch-npu)

    @property
    def transformers(self) -> str | None:
        return requirement(self.requirements, "transformers")


def read_base(tree: Path, version: str) -> BaseRecipe:
    """The recipe inputs of the base `version` materialized (unpatched) in `tree`."""
    reqs = tree / "requirements.txt"
    if not reqs.is_file():
        raise BadInput(f"{reqs} not found: the base tree has no requirements.txt to build its test environment from")
    text = reqs.read_text()
    kept, dropped = filter_requirements(text)
    torch_pin = requirement(
        [ln.split(" #", 1)[0].strip() for ln in text.splitlines() if not ln.startswith("#")], "torch"
    )
    vllm, how = paired_vllm(tree, version)
    return BaseRecipe(version, vllm, how, kept, dropped, torch_pin)


def venv_recipe(base: BaseRecipe) -> dict:
    """Everything the venv's content depends on; its hash names the venv (not the base version:
    bases with the same recipe share one)."""
    return {
        "recipe_version": RECIPE_VERSION,
        "python": ".".join(map(str, sys.version_info[:3])),
        "torch": TORCH,
        "torchvision": [TORCHVISION, hashlib.sha256(TORCHVISION_SHIM.encode()).hexdigest()],
        "vllm": f"vllm=={base.vllm}",
        "vllm_build_tools": list(VLLM_BUILD_TOOLS),
        "requirements": base.requirements,
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
    """`stamp.json`: the recipe hash a part was built from, written only after a full build."""

    path: Path

    def read(self) -> str | None:
        try:
            return json.loads(self.path.read_text())["hash"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def matches(self, digest: str) -> bool:
        return self.read() == digest

    def write(self, digest: str, recipe: dict, seconds: float, extra: dict | None = None) -> None:
        data = {"hash": digest, "recipe": recipe, "build_seconds": round(seconds, 1), **(extra or {})}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class TestEnv:
    __test__ = False  # not a pytest class

    root: Path  # <cache>/testenv/venv-<hash>
    venv_hash: str
    triton_hash: str
    triton_root: Path | None = None  # <cache>/testenv/triton-<hash>
    base: BaseRecipe | None = field(default=None, compare=False)

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def triton_site(self) -> Path:
        return (self.triton_root or self.root) / "site"

    @property
    def results_dir(self) -> Path:
        """Cached base-suite results (shared by every checkout that uses this environment)."""
        return self.root / "base-results"

    @property
    def stamp(self) -> str:
        """Identifies the whole environment (for result caches)."""
        return hashlib.sha256(f"{self.venv_hash}:{self.triton_hash}".encode()).hexdigest()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return run_env(self.venv, extra)

    @contextmanager
    def lock(self, what: str = "a suite run"):
        """Exclusive use of the venv (its editable vllm_ascend) across processes."""
        with _locked(self.root / "lock", f"{self.root.name} ({what})"):
            yield


@contextmanager
def _locked(path: Path, what: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process using {what} ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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


def _build_venv(root: Path, base: BaseRecipe, log: Path) -> None:
    requirements = base.requirements
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
    vllm_env = dict(env, VLLM_TARGET_DEVICE="empty", VLLM_VERSION_OVERRIDE=base.vllm)
    vllm = f"vllm=={base.vllm}"
    pins = [base.transformers] if base.transformers else []
    _run(
        _pip(venv, "install", "-q", "--no-build-isolation", "--no-binary", "vllm", vllm, *pins),
        env=vllm_env,
        log=log,
        what=f"install {vllm} from its sdist as pure Python",
    )
    # The base's own pins win over vLLM's (e.g. 0.30.0rc2's fastapi<0.124.0): vLLM is not named again,
    # so pip installs them and only warns about vLLM's declared range.
    reqs = root / "requirements.filtered.txt"
    reqs.write_text("".join(f"{r}\n" for r in requirements))
    _run(
        _pip(venv, "install", "-q", "-r", str(reqs), *TEST_DEPS, TORCH, TORCHVISION, *pins),
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
    (root / "freeze.txt").write_text(freeze.stdout)


def _build_triton_site(root: Path, log: Path) -> None:
    site = root / "site"
    if site.exists():
        shutil.rmtree(site)
    _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), TRITON_SITE_SPEC],
        env=run_env(None),
        log=log,
        what=f"install {TRITON_SITE_SPEC} into {root.name}/site (--target, --no-deps)",
    )


def default_root() -> Path:
    return cache_dir() / "testenv"


def _part(root: Path, name: str, recipe: dict, content: str, build, *, rebuild: bool, note=None) -> tuple[str, Path]:
    """Build `<root>/<name>-<hash16>/` once (under its lock); the stamp is written after a full build."""
    digest = recipe_hash(recipe)
    home = root / f"{name}-{digest[:16]}"
    home.mkdir(parents=True, exist_ok=True)
    stamp = Stamp(home / "stamp.json")
    with _locked(home / "lock", f"{home.name} (build)"):
        if not rebuild and stamp.matches(digest) and (home / content).is_dir():
            _say(f"{name}: up to date ({home})")
            return digest, home
        why = "forced" if rebuild else ("incomplete build" if (home / content).exists() else "not built yet")
        _say(f"{name}: building ({why}) in {home}, log {home / 'build.log'}")
        if note:
            note()
        stamp.clear()
        log = home / "build.log"
        log.write_text("")
        t1 = time.monotonic()
        build(home, log)
        stamp.write(digest, recipe, time.monotonic() - t1)
        _say(f"{name}: built in {time.monotonic() - t1:.1f} s")
    return digest, home


def ensure(
    base_tree: Path, version: str, *, rebuild: bool = False, root: Path | None = None, link_dir: Path | None = None
) -> TestEnv:
    """The test environment of the base `version` (materialized, unpatched, in `base_tree`):
    built when missing or incomplete, a no-op when current. `link_dir/venv` links to it."""
    t0 = time.monotonic()
    root = root or default_root()
    base = read_base(base_tree, version)
    _say(
        f"base vllm-ascend {version}: vLLM {base.vllm} (from {base.vllm_from}); "
        f"{base.transformers or 'no transformers pin'} (its requirements.txt); {TORCH} CPU"
        + (f" (the base pins {base.torch_pin} for torch-npu)" if base.torch_pin and base.torch_pin != TORCH else "")
    )

    def note():
        _say(f"  requirements from {base_tree / 'requirements.txt'}, left out: {', '.join(base.dropped) or '(none)'}")

    venv_hash, venv_home = _part(
        root, "venv", venv_recipe(base), "venv", lambda home, log: _build_venv(home, base, log),
        rebuild=rebuild, note=note,
    )  # fmt: skip
    triton_hash, triton_home = _part(
        root, "triton", triton_recipe(), "site", _build_triton_site, rebuild=rebuild
    )  # fmt: skip
    if link_dir is not None:
        _link(link_dir / "venv", venv_home / "venv")
    _say(f"ready in {time.monotonic() - t0:.1f} s ({venv_home})")
    return TestEnv(venv_home, venv_hash, triton_hash, triton_home, base)


def _link(link: Path, target: Path) -> None:
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():
            shutil.rmtree(link)  # an old in-repo venv (before environments moved to the cache)
        link.symlink_to(target)
    except OSError:
        pass  # a convenience only


def install_tree(tenv: TestEnv, tree: Path, version: str) -> None:
    """Install the materialized `tree` editable into the venv (once per tree switch); call it
    under `tenv.lock()`."""
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
