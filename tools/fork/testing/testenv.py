"""The CPU test environment of a base: derived from the base itself, built once by uv, cached.

What goes into it and why: docs/testing.md, "The test environment" (the constants and the reading of
the base are base_recipe.py's, the uv and venv mechanics venvs.py's). Where it lives, under the user
cache (`config.cache_dir()`: ~/.cache/vllm-ascend-fork, FORK_CACHE overrides):
  testenv/venv-<recipe hash>/     venv/, stamp.json (written only after a complete build), build.log,
                                  freeze.txt, base-results/ (cached base-suite results), lock
  testenv/triton-<recipe hash>/   site/ (triton==3.7.1 by `--target`, the interpreter for the kernel
                                  op tests), stamp.json
  uv/                             uv's cache, which every environment's files are hard links into
Two bases with the same recipe share one environment; a changed recipe builds a new one beside the
old. `build/testenv/venv` links to the environment used last. `vllm_ascend` itself is installed
editable by `install_tree()` just before its suite runs, under the environment's lock.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.core.config import cache_dir
from tools.fork.core.errors import ForkError
from tools.fork.testing import base_recipe as recipe
from tools.fork.testing import venvs
from tools.fork.testing.base_recipe import BaseRecipe, read_base
from tools.fork.testing.venvs import pip, run_logged, say, uv_env


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
        return venvs.run_env(self.venv, extra)

    @contextmanager
    def lock(self, what: str = "a suite run"):
        """Exclusive use of the venv (its editable vllm_ascend) across processes."""
        with venvs.locked(self.root / "lock", f"{self.root.name} ({what})"):
            yield


def install_torchvision_shim(site: Path) -> Path:
    """Write the torchvision shim into `site` as a module that a .pth file imports at start-up.

    Not as sitecustomize.py: a distribution's Python may ship a sitecustomize of its own (Debian's
    python3 does) that shadows the venv's, and the shim would silently not load.
    """
    module = site / f"{recipe.TORCHVISION_SHIM_MODULE}.py"
    module.write_text(recipe.TORCHVISION_SHIM)
    (site / f"{recipe.TORCHVISION_SHIM_MODULE}.pth").write_text(f"import {recipe.TORCHVISION_SHIM_MODULE}\n")
    return module


# The built venv's check: it imports what the suites need, one module at a time, saying which first
# (a crash inside an import leaves that line last), and ends with one summary line.
CHECK = """\
import importlib, importlib.util, sys
mods = {}
for name in ("torch", "torchvision", "vllm", "transformers", "pytest",
             "transformers.models.qwen2_vl.image_processing_qwen2_vl"):
    print("importing " + name, flush=True)
    mods[name] = importlib.import_module(name)
torch = mods["torch"]
build = "CUDA %s build, run on the CPU" % torch.version.cuda if torch.version.cuda else "CPU build"
print("checking that triton is gone", flush=True)
if importlib.util.find_spec("triton") is not None:
    sys.exit("triton is still importable (the kernel tests need the interpreter's triton-site)")
print(" | ".join("%s %s" % (n, mods[n].__version__) for n in ("torch", "torchvision", "vllm", "transformers", "pytest"))
      + " (torch: " + build + ")")
"""


def torch_build(venv: Path) -> tuple[str, int]:
    """(torch's version, how many nvidia-* distributions came with it) in `venv`, from metadata alone."""
    probe = (
        "import importlib.metadata as m\n"
        "names = [(d.metadata['Name'] or '').lower() for d in m.distributions()]\n"
        "print(m.version('torch'), sum(n.startswith('nvidia-') for n in names))\n"
    )
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        env=venvs.run_env(venv), capture_output=True, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    version, _, nvidia = proc.stdout.strip().partition(" ")
    return version or "(unknown version)", int(nvidia or 0)


def requirements_of(venv: Path, dist: str) -> list[str]:
    """The requirements of `dist` as installed in `venv` (its extras' left out)."""
    probe = f"import importlib.metadata as m\nfor r in m.requires({dist!r}) or []:\n    'extra ==' in r or print(r)"
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        env=venvs.run_env(venv), capture_output=True, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if proc.returncode != 0:
        raise ForkError(f"test env: reading {dist}'s requirements failed: {proc.stderr.strip()[-300:]}")
    return proc.stdout.splitlines()


def check_failure(returncode: int, stdout: str, stderr: str, log: Path) -> str:
    """The cause of a failed CHECK in two lines: what failed and why (the first line of the error,
    not a C++ trace), then where the whole output is and what to set."""
    lines = stdout.strip().splitlines()
    doing = lines[-1] if lines else "checking the venv"
    errors = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    # The exception line of a Python traceback ("SomeError: message"), else the last line.
    cause = next((ln for ln in errors if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", ln)), None)
    cause = cause or (errors[-1] if errors else "")
    if returncode < 0:
        cause = f"killed by signal {-returncode}" + (f" ({cause})" if cause else "")
    cause = cause if len(cause) <= 300 else cause[:297] + "..."
    return (
        f"test env: the built venv fails {doing}: {cause}\n"
        f"  whole output: {log}; the torch uv chose is in its freeze.txt. To use a local CPU torch wheel, "
        f"set PIP_FIND_LINKS=DIR (a folder holding {recipe.TORCH.replace('==', '-')}+cpu-*.whl) and run again."
    )


def _build_venv(root: Path, base: BaseRecipe, log: Path) -> None:
    with venvs.installing():
        _install_venv(root, base, log)


def _install_venv(root: Path, base: BaseRecipe, log: Path) -> None:
    requirements = base.requirements
    venv = root / "venv"
    env = uv_env(venvs.run_env(venv))
    # Seeded with pip: the deploy check installs and uninstalls a vllm-ascend wheel with the
    # environment's pip, as an image's pip does.
    venvs.create(venv, log=log, seed=True)
    # torch first, so that nothing later picks another build of it.
    # A local CPU wheel when uv finds one (PIP_FIND_LINKS), else the registry's CUDA build: both run
    # on the CPU; the CUDA one brings its nvidia-* libraries (a few GB, hard-linked from uv's cache).
    run_logged(pip(venv, "install", "-q", recipe.TORCH), env=env, log=log, what=f"install {recipe.TORCH}")
    version, nvidia = torch_build(venv)
    say(
        f"  torch {version}: "
        + (
            f"a CUDA build with {nvidia} nvidia-* libraries (it runs on the CPU; a folder holding the CPU "
            "wheel in PIP_FIND_LINKS saves the download)"
            if nvidia
            else "no CUDA libraries"
        )
    )
    run_logged(
        pip(venv, "install", "-q", "--no-deps", recipe.TORCHVISION),
        env=env,
        log=log,
        what=f"install {recipe.TORCHVISION} (--no-deps)",
    )
    shim = install_torchvision_shim(venvs.purelib(venv / "bin" / "python"))
    say(f"  torchvision shim: {shim}, loaded by its .pth")
    run_logged(pip(venv, "install", "-q", *recipe.VLLM_BUILD_TOOLS), env=env, log=log, what="install vLLM build tools")
    vllm_env = dict(env, VLLM_TARGET_DEVICE="empty", VLLM_VERSION_OVERRIDE=base.vllm)
    vllm = f"vllm=={base.vllm}"
    pins = [base.transformers] if base.transformers else []
    # --no-cache: uv would keep the unpacked sdist (about 175 MB a vLLM version) beside the 10 MB
    # wheel it builds; an environment is built once per recipe, so a rebuild costs 15 s instead.
    run_logged(
        pip(venv, "install", "-q", "--no-cache", "--no-deps", "--no-build-isolation", "--no-binary", "vllm", vllm),
        env=vllm_env,
        log=log,
        what=f"install {vllm} from its sdist as pure Python",
    )
    # Then what that build requires. Not in one step: uv resolves with the registry's wheel metadata
    # (CUDA: torchaudio, flashinfer, CUTLASS, another torch), not with the pure-Python build's.
    deps = root / "vllm-requirements.txt"
    deps.write_text("".join(f"{r}\n" for r in requirements_of(venv, "vllm")))
    run_logged(
        pip(venv, "install", "-q", "-r", str(deps), *pins), env=env, log=log, what=f"install what {vllm} requires"
    )
    # The base's own pins win over vLLM's (e.g. 0.30.0rc2's fastapi<0.124.0): vLLM is not named again,
    # so uv installs them (it resolves only what it is given) and only warns about vLLM's declared range.
    reqs = root / "requirements.filtered.txt"
    reqs.write_text("".join(f"{r}\n" for r in requirements))
    run_logged(
        pip(venv, "install", "-q", "-r", str(reqs), *recipe.TEST_DEPS, recipe.TORCH, recipe.TORCHVISION, *pins),
        env=env,
        log=log,
        what="install upstream's requirements (filtered) + test deps",
    )
    uninstall = recipe.UNINSTALL_AFTER
    run_logged(pip(venv, "uninstall", *uninstall), env=env, log=log, what="uninstall " + " ".join(uninstall))
    freeze = subprocess.run(pip(venv, "freeze"), env=env, capture_output=True, text=True)
    (root / "freeze.txt").write_text(freeze.stdout)
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", CHECK], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    with log.open("a") as f:
        f.write(f"\n$ python -c CHECK (testenv.CHECK)\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        raise ForkError(check_failure(proc.returncode, proc.stdout, proc.stderr, log))
    say(f"  check: {proc.stdout.strip().splitlines()[-1]}")


def _build_triton_site(root: Path, log: Path) -> None:
    site = root / "site"
    if site.exists():
        shutil.rmtree(site)
    spec = recipe.TRITON_SITE_SPEC
    cmd = [venvs.uv(), "pip", "install", "-q", "--python", sys.executable, *venvs.index_options(),
           "--no-deps", "--target", str(site), spec]  # fmt: skip
    with venvs.installing():
        run_logged(
            cmd,
            env=uv_env(venvs.run_env(None)),
            log=log,
            what=f"install {spec} into {root.name}/site (--target, --no-deps)",
        )


def default_root() -> Path:
    return cache_dir() / "testenv"


def ensure(
    base_tree: Path, version: str, *, rebuild: bool = False, root: Path | None = None, link_dir: Path | None = None
) -> TestEnv:
    """The test environment of the base `version` (materialized, unpatched, in `base_tree`):
    built when missing or incomplete, a no-op when current. `link_dir/venv` links to it."""
    t0 = time.monotonic()
    root = root or default_root()
    base = read_base(base_tree, version)
    say(
        f"base vllm-ascend {version}: vLLM {base.vllm} (from {base.vllm_from}); "
        f"{base.transformers or 'no transformers pin'} (its requirements.txt); {recipe.TORCH}"
        + (
            f" (the base pins {base.torch_pin} for torch-npu)"
            if base.torch_pin and base.torch_pin != recipe.TORCH
            else ""
        )
    )

    def note():
        say(f"  requirements from {base_tree / 'requirements.txt'}, left out: {', '.join(base.dropped) or '(none)'}")

    venv_hash, venv_home = venvs.build_part(
        root, "venv", recipe.venv_recipe(base), "venv", lambda home, log: _build_venv(home, base, log),
        rebuild=rebuild, note=note,
    )  # fmt: skip
    triton_hash, triton_home = venvs.build_part(
        root, "triton", recipe.triton_recipe(), "site", _build_triton_site, rebuild=rebuild
    )  # fmt: skip
    if link_dir is not None:
        venvs.link(link_dir / "venv", venv_home / "venv")
    say(f"ready in {time.monotonic() - t0:.1f} s ({venv_home})")
    return TestEnv(venv_home, venv_hash, triton_hash, triton_home, base)


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
        say(f"vllm_ascend editable from {tree}: already installed")
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
    # --no-cache: the build itself must run, as it writes vllm_ascend/_build_info.py into the tree.
    run_logged(
        pip(tenv.venv, "install", "-q", "--no-cache", "--no-deps", "--no-build-isolation", "-e", str(tree)),
        env=env,
        log=log,
        what=f"install vllm_ascend editable from {tree}",
    )
    marker.write_text(json.dumps(want) + "\n")
