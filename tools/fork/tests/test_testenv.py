"""Tests of the test environment: the base's recipe, stamped builds, reuse (fast: no network, no venv build)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.fork.core.errors import BadInput, ForkError
from tools.fork.testing import base_recipe, testenv, venvs

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
    kept, dropped = base_recipe.filter_requirements(text)
    assert kept == ["numpy", "xgrammar>=0.1.30", "transformers==5.5.4", 'numba; platform_machine == "x86_64"']
    assert len(dropped) == 14


def test_filter_requirements_refuses_includes():
    with pytest.raises(BadInput, match="line 2"):
        base_recipe.filter_requirements("numpy\n-r other.txt\n")


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
        (root / base_recipe.VERSIONING_POLICY).parent.mkdir(parents=True, exist_ok=True)
        (root / base_recipe.VERSIONING_POLICY).write_text(policy)
    return root


@pytest.mark.parametrize(
    "version, vllm",
    [("0.30.0rc2", "0.30.0"), ("0.23.0.post1", "0.23.0"), ("0.14.0rc1", "0.14.1")],
)
def test_paired_vllm_comes_from_the_base_s_compatibility_matrix(tmp_path, version, vllm):
    found, how = base_recipe.paired_vllm(_base_tree(tmp_path), version)
    assert found == vllm and "compatibility matrix" in how


@pytest.mark.parametrize(
    "version, vllm", [("0.26.0rc1", "0.26.0"), ("0.23.0", "0.23.0"), ("9.9.9", "9.9.9"), ("1.2.3.post4", "1.2.3")]
)
def test_paired_vllm_falls_back_to_the_xyz_rule(tmp_path, version, vllm):
    # 9.9.9 is in a table of a later section, not the matrix
    found, how = base_recipe.paired_vllm(_base_tree(tmp_path), version)
    assert (found, "X.Y.Z rule" in how) == (vllm, True)
    found, how = base_recipe.paired_vllm(_base_tree(tmp_path / "nodoc", policy=None), version)
    assert found == vllm and "no docs/" in how


def test_recipe_reads_the_base_s_own_pins(tmp_path):
    reqs = "numpy\ntorch==2.10.0\ntransformers==5.14.1 # pinned\n"
    base = base_recipe.read_base(_base_tree(tmp_path, reqs), "0.30.0rc2")
    assert base.vllm == "0.30.0" and base.transformers == "transformers==5.14.1"
    assert base.torch_pin == "torch==2.10.0" and "torch" in base.dropped
    recipe = base_recipe.venv_recipe(base)
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
    monkeypatch.setattr(base_recipe, "TRITON_SITE_SPEC", "triton==9.9.9")
    testenv.ensure(tree, "0.23.0", root=cache)
    assert calls == ["venv 0.23.0", "triton", "triton"]
    monkeypatch.setattr(base_recipe, "TEST_DEPS", (*base_recipe.TEST_DEPS, "pytest-timeout"))
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
    env = venvs.run_env(tmp_path / "venv", {"X": "1"})
    assert "PYTHONPATH" not in env
    assert env["PATH"].split(":") == [str(tmp_path / "venv" / "bin"), "/usr/bin"]
    assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0" and env["X"] == "1"


# --- the one venv builder's spec-recorded venvs (the kernel harness's triton-ascend venv) --


def test_ensure_spec_reuses_an_unchanged_spec_and_installs_a_changed_one(tmp_path, monkeypatch):
    where = tmp_path / "ascend-venv"
    (where / "bin").mkdir(parents=True)
    (where / "bin" / "python").write_text("")
    (where / ".spec").write_text(json.dumps(["a==1"]))
    calls = []
    monkeypatch.setattr(venvs, "run_logged", lambda cmd, **kw: calls.append(cmd))
    assert venvs.ensure_spec(where, ["a==1"], ".spec") == where / "bin" / "python"
    assert calls == [], "an unchanged spec installs nothing"
    venvs.ensure_spec(where, ["a==2"], ".spec")
    assert calls == [venvs.pip(where, "install", "-q", "a==2")], "the venv exists: only pip runs"
    assert json.loads((where / ".spec").read_text()) == ["a==2"]


def test_the_torchvision_shim_loads_where_a_sitecustomize_shadows_the_venvs(tmp_path):
    """Debian's python3 ships a sitecustomize that shadows a venv's: the shim must load all the same."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    testenv.install_torchvision_shim(site)
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("SHADOW = True\n")
    probe = (
        "import sys, sitecustomize; print(sitecustomize.__file__); "
        "print(any(type(f).__name__ == '_TorchvisionCpuShim' for f in sys.meta_path))"
    )
    out = subprocess.check_output([str(python), "-c", probe], env={**os.environ, "PYTHONPATH": str(shadow)}, text=True)
    assert out.split() == [str(shadow / "sitecustomize.py"), "True"]


# --- the torchvision shim beside either torch build, and a failed check's message ----------------

REPO = Path(__file__).resolve().parents[3]
TV_INIT = "import torch\nfrom . import extension\nfrom torchvision import _meta_registrations\n__version__ = '0.0'\n"
# torchvision's C++ extension, where it loads: it defines the namespace's schemas (as TORCH_LIBRARY does).
TV_EXTENSION_LOADS = (
    "import torch\n_lib = torch.library.Library('torchvision', 'DEF')\n"
    "_lib.define('nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor')\n"
    "_lib.define('qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor')\n"
)
TV_EXTENSION_FAILS = "_lib = None  # the C++ extension was built for another torch: nothing registered\n"
TV_META = (
    "import torch\n"
    "for _op in ('nms', 'qnms'):\n"
    "    torch.library.register_fake('torchvision::' + _op)(lambda dets, scores, iou: dets.new_empty(0))\n"
)


def _python_with_torch() -> Path | None:
    """A Python with torch: this one (the tooling's tests run in the test environment under `test`),
    else the test environment's; None without either."""
    for python in (Path(sys.executable), REPO / "build" / "testenv" / "venv" / "bin" / "python"):
        if python.exists() and subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode == 0:
            return python
    return None


def _fake_torchvision(root: Path, extension: str) -> Path:
    pkg = root / "torchvision"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(TV_INIT)
    (pkg / "extension.py").write_text(extension)
    (pkg / "_meta_registrations.py").write_text(TV_META)
    return root


@pytest.mark.parametrize("extension_loads", [True, False], ids=["extension-loads", "extension-fails"])
def test_the_shim_defines_torchvision_s_schemas_only_where_its_extension_has_not(tmp_path, extension_loads):
    """Beside the CUDA torch the registry's torchvision loads its extension, which defines nms/qnms: the
    shim must not define them again (that aborts the import). Beside the CPU torch it does not load: the
    shim must define them, or registering their fake kernels fails."""
    python = _python_with_torch()
    if python is None:
        pytest.skip("no Python with torch here (the test environment runs this test under `test`)")
    site = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
    ).strip()
    fake = _fake_torchvision(tmp_path / "fake", TV_EXTENSION_LOADS if extension_loads else TV_EXTENSION_FAILS)
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir()
    testenv.install_torchvision_shim(shim_dir)
    probe = (
        f"import {base_recipe.TORCHVISION_SHIM_MODULE} as shim, torchvision, torch\n"
        "assert torchvision.__file__.startswith(%r), torchvision.__file__\n"
        "print(len(shim._TorchvisionCpuShim.libs), torch.ops.torchvision.nms.default._schema)\n" % str(fake)
    )
    # -S: none of the environment's own .pth files (its installed shim); the fake torchvision first.
    env = {**venvs.run_env(None), "PYTHONPATH": os.pathsep.join([str(fake), str(shim_dir), site])}
    proc = subprocess.run([str(python), "-S", "-c", probe], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    defined_by_shim, schema = proc.stdout.split(" ", 1)
    assert defined_by_shim == ("0" if extension_loads else "1"), proc.stdout
    assert schema.startswith("torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


CPP_TRACE = (
    "Only a single TORCH_LIBRARY can be used to register the namespace torchvision; please put all of your "
    "definitions in a single TORCH_LIBRARY block.\nException raised from registerLibrary at "
    "../aten/src/ATen/core/dispatch/Dispatcher.cpp:230 (most recent call first):\n"
    + "".join(f"frame #{i}: c10::Error::Error(c10::SourceLocation, std::string) + 0x{i:x}\n" for i in range(40))
)


def test_a_failed_check_says_its_cause_in_two_lines_not_a_cpp_trace(tmp_path):
    """The venv's check, run on stand-ins (a CUDA torch, a torchvision whose import raises with a C++
    trace): the message names what failed and why, where the output is, and what to set."""
    mods = tmp_path / "mods"
    (mods / "torch").mkdir(parents=True)
    (mods / "torch" / "__init__.py").write_text("__version__ = '2.13.0'\nclass version:\n    cuda = '13.0'\n")
    (mods / "torchvision").mkdir()
    (mods / "torchvision" / "__init__.py").write_text(f"raise RuntimeError({CPP_TRACE!r})\n")
    env = {**venvs.run_env(None), "PYTHONPATH": str(mods)}
    proc = subprocess.run([sys.executable, "-S", "-c", testenv.CHECK], env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "frame #39" in proc.stderr  # the stand-in fails as the real one did
    log = tmp_path / "build.log"
    message = testenv.check_failure(proc.returncode, proc.stdout, proc.stderr, log)
    lines = message.splitlines()
    assert len(lines) == 2, message
    assert lines[0].startswith("test env: the built venv fails importing torchvision: RuntimeError: Only a single")
    assert "frame #" not in message and str(log) in lines[1] and "PIP_FIND_LINKS=" in lines[1]


def test_a_check_that_dies_names_the_import_it_died_in():
    message = testenv.check_failure(-6, "importing torch\nimporting torchvision\n", "", Path("/x/build.log"))
    assert message.splitlines()[0] == "test env: the built venv fails importing torchvision: killed by signal 6"


def test_a_failed_build_step_says_pip_s_error_in_one_line_and_where_the_rest_is(tmp_path):
    log = tmp_path / "build.log"
    log.write_text("\n$ earlier step\nERROR: an earlier step's error\n")
    script = (
        "import sys\n"
        "for i in range(60): print(f'  building wheel line {i}')\n"
        "print('ERROR: Could not find a version that satisfies the requirement torch==2.13.0 (from versions: none)')\n"
        "print('ERROR: No matching distribution found for torch==2.13.0')\n"
        "sys.exit(1)\n"
    )
    with pytest.raises(ForkError) as exc:
        venvs.run_logged([sys.executable, "-c", script], env=venvs.run_env(None), log=log, what="install torch==2.13.0")
    lines = str(exc.value).splitlines()
    assert lines == [
        "test env: install torch==2.13.0 failed (exit 1): ERROR: Could not find a version that satisfies the "
        "requirement torch==2.13.0 (from versions: none) / ERROR: No matching distribution found for torch==2.13.0",
        f"  whole output: {log}",
    ]
    assert "building wheel line 59" in log.read_text()  # all of it kept in the log


def test_ensure_spec_runs_its_then_steps_after_the_install_and_records_them(tmp_path, monkeypatch):
    where = tmp_path / "ascend-venv"
    (where / "bin").mkdir(parents=True)
    (where / "bin" / "python").write_text("")
    (where / ".spec").write_text(json.dumps(["a==1"]))  # built before the steps existed: built again
    calls = []
    monkeypatch.setattr(venvs, "run_logged", lambda cmd, **kw: calls.append(cmd))
    then = (("uninstall", "-y", "b"), ("install", "--no-deps", "--force-reinstall", "a==1"))
    venvs.ensure_spec(where, ["a==1"], ".spec", then=then)
    assert calls == [
        venvs.pip(where, "install", "-q", "a==1"),
        venvs.pip(where, "uninstall", "-y", "b"),
        venvs.pip(where, "install", "--no-deps", "--force-reinstall", "a==1"),
    ]
    calls.clear()
    venvs.ensure_spec(where, ["a==1"], ".spec", then=then)
    assert calls == [], "unchanged spec and steps: nothing again"


def test_pip_s_index_variables_reach_uv_as_its_options():
    """uv reads no pip configuration: a folder in PIP_FIND_LINKS (README's CPU-wheel folder) must reach it."""
    env = {"PIP_FIND_LINKS": "/wheels /more", "PIP_INDEX_URL": "https://mirror/simple", "PIP_NO_INDEX": "0"}
    assert venvs.index_options(env) == [
        "--default-index", "https://mirror/simple", "--find-links", "/wheels", "--find-links", "/more",
    ]  # fmt: skip
    assert venvs.index_options({"PIP_FIND_LINKS": "/wheels", "UV_FIND_LINKS": "/uv"}) == [], "uv's own wins"
    assert venvs.index_options({"PIP_NO_INDEX": "true", "PIP_FIND_LINKS": "/w"}) == ["--no-index", "--find-links", "/w"]
    cmd = venvs.pip(Path("/v"), "uninstall", "triton")
    assert cmd[1:] == ["pip", "uninstall", "--python", "/v/bin/python", "triton"], "index options only for install"
