"""What a base asks of its CPU test environment, read from the base's own files, and the recipes that name its venvs.

The recipe of a venv is everything its content depends on; the hash of it names the venv's directory
(testenv.py), so a changed constant here builds a new environment beside the old one.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.core.errors import BadInput

# Bump when the build logic changes in a way the constants below do not show.
RECIPE_VERSION = 4

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
# The registry's torchvision is a CUDA build. Beside a CUDA torch (what pip installs when it finds no
# local CPU wheel) its C++ ops load and define torchvision::nms/qnms themselves; beside the CPU torch
# wheel they do not load, and its Python side then fails registering fake kernels for those two ops.
# Upstream's suite needs it importable (transformers' Qwen2-VL image processor, reached from
# vllm_ascend's patches, imports torchvision.transforms.v2), not its ops: TORCHVISION_SHIM defines
# the two schemas, but only when torchvision's own extension has not (decided by what is registered
# when torchvision reaches its fake kernels, not by version strings).
TORCHVISION = "torchvision==0.28.0"  # the release paired with torch 2.13
# The shim's text is part of every test venv's recipe hash: editing it, even its comments, rebuilds
# every cached test environment.
TORCHVISION_SHIM = """\
# Written by tools/fork/testenv.py (the fork's CPU test env). torchvision loads its C++ extension
# (torchvision.extension), then registers fake kernels for torchvision::nms / qnms
# (torchvision._meta_registrations), which needs their schemas. Beside a torch its extension was not
# built for, the extension does not load and nothing defines them: just before
# torchvision._meta_registrations is imported, define the two schemas if, and only if, they are
# missing then. An extension that loaded has defined them; defining them again would abort.
import sys as _sys


class _TorchvisionCpuShim:
    libs = []

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision._meta_registrations":
            return None
        _sys.meta_path.remove(self)
        try:
            import torch

            if not hasattr(torch.ops.torchvision, "nms"):
                lib = torch.library.Library("torchvision", "DEF")
                lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                self.libs.append(lib)  # kept alive: a collected Library drops its definitions
        except Exception:
            pass
        return None  # the regular finders import the module itself


_sys.meta_path.insert(0, _TorchvisionCpuShim())
"""
TORCHVISION_SHIM_MODULE = "_fork_torchvision_shim"  # written with a .pth that imports it
UNINSTALL_AFTER = ("triton",)
TRITON_SITE_SPEC = "triton==3.7.1"


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
