"""Every command of README.md, run verbatim from a fresh clone with the machine's plain `python3`.

A new user copies them as they are; none may end in a traceback. Commands that need an NPU,
docker or minutes of work have a cheap form or a stated reason here (RULES); every other code
line of the README runs exactly as written. `python3`/`python` are the plain interpreter that made
the tools' venv (no setuptools-scm, no pytest), except in "Put the fork into an image", where they
are a fresh venv of it: the Python that serves, which the section itself fills with vllm-ascend
(from the pinned sdist in the cache, not from the registry) before the deploy commands run again.
About 1-2 minutes: the venv, the sdist install, `make fork`'s wheel build and a deploy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tools.fork.core import config, upstream

pytestmark = pytest.mark.slow

REPO = config.REPO_ROOT
IMAGE_SECTION = "## Put the fork into an image"


@dataclass(frozen=True)
class Rule:
    pattern: str  # regex searched in the command
    skip: str = ""  # why it is not run here
    replace: tuple[str, str] | None = None  # (regex, replacement): the cheap form
    ok: tuple[int, ...] = (0,)  # exit codes that are right here (a refusal is one line, never a traceback)


RULES = [
    Rule(r"^make test\b", skip="CI runs it: `.ci/run` is `make test`, and this test runs inside it"),
    Rule(
        r"tools\.fork test\b",
        skip="`make test` runs the test verb on the pin and on the newest final; this test runs inside it",
    ),
    Rule(r"^make fork\b", replace=(r"^make ", "make -o build/tools-venv/.stamp ")),  # the tools venv is linked in
    Rule(r"^docker ", skip="needs docker; the image build has a CI step of its own"),
    Rule(r"^podman ", skip="the image build has a CI step of its own (`make image`, .ci/image.sh)"),
    Rule(r"^pytest tests/e2e/", skip="op tests on an Ascend NPU (`test` runs them under the Triton interpreter)"),
    Rule(r"benchmarks/copy_paths\.py", skip="the NPU benchmark run"),
    Rule(r"^python3 -m pip install --no-deps dist/", skip="installs the wheel over an image's vllm-ascend"),
    # another release would be downloaded: the same command onto the pin is refused at once
    Rule(r"rebase --onto \S+", replace=(r"--onto \S+", "--onto {pin}"), ok=(2,)),
    Rule(r"rebase --(continue|abort)", ok=(2,)),  # nothing in progress: refused in one line
    Rule(r'"vllm-ascend==\$V"', replace=(r'"vllm-ascend==\$V"', '"{sdist}"')),  # the cached sdist, offline
]


def readme_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(section title, commands) of every code block, in order; `\\` continuations joined."""
    out: list[tuple[str, list[str]]] = []
    section, prev_indent, prev_blank = "", 0, True
    block: list[str] | None = None
    block_indent = 0
    fenced = False
    for raw in text.splitlines():
        stripped = raw.strip()
        indent = len(raw) - len(raw.lstrip())
        if stripped.startswith("```"):
            fenced = not fenced
            if fenced:
                block = []
                out.append((section, block))
            else:
                block = None
            continue
        if fenced:
            block.append(stripped)
            continue
        if block is not None and stripped and indent < block_indent:
            block = None
        if block is None and stripped and prev_blank and indent >= prev_indent + 4:
            block, block_indent = [], indent
            out.append((section, block))
        if block is not None:
            if stripped:
                block.append(stripped)
        elif stripped:
            prev_indent = indent
            if stripped.startswith("#"):
                section = stripped
        prev_blank = not stripped
    result = []
    for title, lines in out:
        joined: list[str] = []
        for line in lines:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1].rstrip() + " " + line
            else:
                joined.append(line)
        result.append((title, [c for c in joined if not c.startswith("#")]))
    return result


def rule_for(command: str) -> Rule | None:
    found = [r for r in RULES if re.search(r.pattern, command)]
    return found[0] if found else None


def plain_python() -> Path:
    """The machine's python3 that the tools' venv was made from (not a venv itself)."""
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    return base


def _bin(dest: Path, python: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("python3",):  # no `python`: Debian's python3 has none (the README must not need it)
        # a wrapper, not a symlink: a venv's Python is a venv only when run by its own path
        (dest / name).write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
        (dest / name).chmod(0o755)
    return dest


def fresh_clone(tmp: Path) -> Path:
    """A clone of this repository with its uncommitted files laid over it (what is under test)."""
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    changed = subprocess.run(
        ["git", "ls-files", "-z", "-m", "-o", "--exclude-standard"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, changed.split("\0")):
        if (REPO / rel).is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, clone / rel)
    for rel in subprocess.run(["git", "ls-files", "-z", "-d"], cwd=REPO, capture_output=True, check=True).stdout.split(
        b"\0"
    ):
        if rel:
            (clone / rel.decode()).unlink(missing_ok=True)
    return clone


def run_commands(commands: list[tuple[str, tuple[int, ...]]], cwd: Path, env: dict) -> list[tuple[str, int, str]]:
    """Run the commands in one bash session (variables carry over, as in a terminal): (command, rc, output)."""
    script = ["exec 2>&1"]  # each command's output, both streams, between its markers
    for i, (cmd, _ok) in enumerate(commands):
        script += [f"echo '@@start {i}'", cmd, f'echo "@@rc {i} $?"']
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    output = proc.stdout + proc.stderr
    results = []
    for i, (cmd, _ok) in enumerate(commands):
        m = re.search(rf"^@@rc {i} (\d+)$", proc.stdout, re.M)
        body = proc.stdout.split(f"@@start {i}\n", 1)[-1].split(f"@@rc {i} ", 1)[0]
        results.append((cmd, int(m.group(1)) if m else -1, body))
    assert "Traceback" not in output, output[-4000:]
    return results


# A bare `python` command (not python3, not a venv's bin/python): absent where only python3 is installed.
BARE_PYTHON = re.compile(r"(?:^|[\s`(;&|])python(?=\s)")


@pytest.mark.parametrize("doc", ["README.md", "CONTRIBUTING.md", "docs", "tools/kernel_harness/README.md"])
def test_documented_commands_need_no_bare_python(doc):
    """Every command the docs give runs where `python3` is the only Python command."""
    files = sorted((REPO / doc).glob("*.md")) if (REPO / doc).is_dir() else [REPO / doc]
    found = [
        f"{f.relative_to(REPO)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if BARE_PYTHON.search(line)
    ]
    assert not found, "\n".join(found)


def test_bare_python_pattern():
    assert BARE_PYTHON.search("    python -m tools.fork apply") and BARE_PYTHON.search("(`python -m x`)")
    assert not BARE_PYTHON.search("python3 -m x build/tools-venv/bin/python -m x the Python package")


def test_readme_blocks_are_found():
    blocks = readme_blocks((REPO / "README.md").read_text())
    commands = [c for _, cmds in blocks for c in cmds]
    assert "make fork" in " ".join(commands) and any(c.startswith("PKG=$(") for c in commands)
    assert any("deploy --revert" in c for c in commands)


def test_readme_commands_verbatim(tmp_path):
    cfg = config.load(REPO)
    # The pin's verified sdist: from the cache, or the package registry on a fresh machine.
    cached = upstream.obtain(cfg).source.sdist
    assert cached is not None and cached.is_file(), cached
    clone = fresh_clone(tmp_path)
    cache = tmp_path / "cache"
    (cache / "sdists").mkdir(parents=True)
    shutil.copy2(cached, cache / "sdists" / cached.name)
    venv = REPO / "build" / "tools-venv"
    (clone / "build").mkdir(exist_ok=True)
    if venv.is_dir():
        (clone / "build" / "tools-venv").symlink_to(venv)
    plain = plain_python()
    purelib = subprocess.run(
        [str(plain), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    plain_site = sorted(os.listdir(purelib))
    serving = tmp_path / "serving"
    subprocess.run([str(plain), "-m", "venv", str(serving)], check=True)
    subs = {"pin": cfg.pin.version, "sdist": str(cache / "sdists" / cached.name)}
    base_env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    base_env["FORK_CACHE"] = str(cache)
    base_env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    path = base_env.get("PATH", "")
    path = os.pathsep.join(p for p in path.split(os.pathsep) if not p.startswith(str(REPO / "build")))

    def env_for(python: Path, name: str) -> dict:
        return dict(base_env, PATH=f"{_bin(tmp_path / name, python)}{os.pathsep}{path}")

    plain_cmds: list[tuple[str, tuple[int, ...]]] = []
    image_cmds: list[tuple[str, tuple[int, ...]]] = []
    skipped = []
    for title, commands in readme_blocks((clone / "README.md").read_text()):
        for cmd in commands:
            rule = rule_for(cmd)
            ok: tuple[int, ...] = (0,)
            if rule is not None:
                if rule.skip:
                    skipped.append((cmd, rule.skip))
                    continue
                if rule.replace:
                    cmd = re.sub(rule.replace[0], rule.replace[1].format(**subs), cmd)
                ok = rule.ok
            if cmd.startswith("make ") and not venv.is_dir():
                skipped.append((cmd, "no build/tools-venv in the repository under test"))
                continue
            (image_cmds if title == IMAGE_SECTION else plain_cmds).append((cmd, ok))
    plain_cmds.append(("python3 -m tools.fork status", (0,)))  # the README's summary command, inline

    problems = []
    for (cmd, ok), (_, rc, out) in zip(plain_cmds, run_commands(plain_cmds, clone, env_for(plain, "plain-bin"))):
        if rc not in ok:
            problems.append(f"{cmd!r}: exit {rc} (expected {ok}):\n{out[-2000:]}")

    # The image section, as written, in a Python that serves but has no vllm-ascend yet: the package
    # finder says so in words and deploy refuses the empty path; after the install all of it works.
    deploy = [(c, ok) for c, ok in image_cmds if c.startswith("PKG=") or " -m tools.fork deploy " in c]
    first = [(c, (1,) if c.startswith("PKG=") else (2,)) if (c, ok) in deploy else (c, ok) for c, ok in image_cmds]
    second = [(c, ok) for c, ok in deploy]
    serving_python = serving / "bin" / "python3"
    results = run_commands(first + second, clone, env_for(serving_python, "serving-bin"))
    assert str(serving) in results[0][2], "the commands ran in the serving venv"
    for (cmd, ok), (_, rc, out) in zip(first + second, results):
        if rc not in ok:
            problems.append(f"[serving Python] {cmd!r}: exit {rc} (expected {ok}):\n{out[-2000:]}")
        if cmd.startswith("PKG=") and ok == (1,):
            assert "has no vllm_ascend" in out, out
        if " deploy " in cmd and ok == (2,):
            assert len(out.strip().splitlines()) == 1 and "empty" in out, out
    after_install = "".join(out for _cmd, _rc, out in results[len(first) :])
    assert "patched in place" in after_install and ": reverted" in after_install, after_install
    assert sorted(os.listdir(purelib)) == plain_site, "the machine's python3 must be left as it was"
    assert not problems, "\n\n".join(problems)
    assert all(reason for _, reason in skipped)
