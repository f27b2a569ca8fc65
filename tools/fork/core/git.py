"""Running git with a fixed, user-config-independent environment.

Patch mechanics are git's (`am -3`, `format-patch`, `range-diff`, `patch-id`);
this module only makes every call reproducible: no global or system config,
fixed committer identity and dates, so materialized commits and exported
patches are byte-identical from one run to the next.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tools.fork.core.errors import ForkError

# Commits the tooling makes (the base commit, `git am`) get these. Author
# identity and date of a patch come from the patch itself.
COMMITTER_NAME = "vllm-ascend-fork"
COMMITTER_EMAIL = "fork@localhost"
FIXED_DATE = "2000-01-01T00:00:00+0000"

# Config that `format-patch`/`diff` output depends on, pinned.
_PINNED_CONFIG = {
    "core.abbrev": "12",
    "core.autocrlf": "false",
    "core.quotepath": "true",
    "diff.algorithm": "myers",
    "diff.noprefix": "false",
    "diff.mnemonicPrefix": "false",
    "diff.renames": "false",
    "diff.relative": "false",
    "diff.suppressBlankEmpty": "false",
    "format.numbered": "false",
    "am.threeWay": "false",
    "am.keepcr": "false",
    "apply.whitespace": "nowarn",
    "commit.gpgSign": "false",
    "tag.gpgSign": "false",
    "init.defaultBranch": "main",
    "advice.detachedHead": "false",
    "gc.auto": "0",
}


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_COMMITTER_NAME=COMMITTER_NAME,
        GIT_COMMITTER_EMAIL=COMMITTER_EMAIL,
        GIT_COMMITTER_DATE=FIXED_DATE,
        # Only commits the tooling makes itself (fixups, the base) use these; `git am`
        # takes the author from the patch.
        GIT_AUTHOR_NAME=COMMITTER_NAME,
        GIT_AUTHOR_EMAIL=COMMITTER_EMAIL,
        GIT_TERMINAL_PROMPT="0",
        LC_ALL="C",
    )
    if extra:
        env.update(extra)
    return env


def _argv(args: Sequence[str]) -> list[str]:
    argv = ["git"]
    for key, value in _PINNED_CONFIG.items():
        argv += ["-c", f"{key}={value}"]
    return argv + list(args)


def run(
    args: Sequence[str],
    cwd: Path,
    *,
    check: bool = True,
    input: str | bytes | None = None,
    env: dict[str, str] | None = None,
    binary: bool = False,
) -> subprocess.CompletedProcess:
    """Run git in `cwd`; raise ForkError with git's message on failure when `check`."""
    proc = subprocess.run(
        _argv(args),
        cwd=cwd,
        input=input,
        capture_output=True,
        text=not binary,
        env=git_env(env),
    )
    if check and proc.returncode != 0:
        err = proc.stderr if not binary else proc.stderr.decode(errors="replace")
        out = proc.stdout if not binary else proc.stdout.decode(errors="replace")
        detail = (err.strip() or out.strip()).splitlines()
        raise ForkError(f"git {' '.join(args[:2])} failed in {cwd}: " + "\n  ".join(detail[-15:]))
    return proc


def out(args: Sequence[str], cwd: Path, **kwargs) -> str:
    return run(args, cwd, **kwargs).stdout.strip()


def filter_bytes(args: Sequence[str], data: bytes, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a git command that reads `data` and needs no repository (`patch-id`, `mailinfo`); bytes out,
    unchecked: the caller reads the return code."""
    return subprocess.run(_argv(args), cwd=cwd, input=data, capture_output=True, env=git_env())


def is_repo(path: Path) -> bool:
    return (path / ".git").exists()


def rev(cwd: Path, name: str) -> str | None:
    proc = run(["rev-parse", "--verify", "--quiet", name + "^{commit}"], cwd, check=False)
    return proc.stdout.strip() or None


def is_clean(cwd: Path) -> bool:
    return out(["status", "--porcelain", "--untracked-files=all"], cwd) == ""


def dirty_paths(cwd: Path, untracked: bool = True) -> list[str]:
    # Not `out()`: stripping the output would eat the first line's leading status blank (" M path").
    flag = "--untracked-files=all" if untracked else "--untracked-files=no"
    lines = run(["status", "--porcelain", flag], cwd).stdout.splitlines()
    return [line[3:] for line in lines if line.strip()]


def dirty_summary(cwd: Path, untracked: bool = True) -> str | None:
    """The uncommitted paths of `cwd` for a message ("a, b, c and 4 more"), or None when it is clean."""
    dirty = dirty_paths(cwd, untracked)
    if not dirty:
        return None
    return ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")


def am_in_progress(cwd: Path) -> bool:
    return (cwd / ".git" / "rebase-apply").exists()


def added_paths(cwd: Path, since: str, under: str, until: str = "HEAD") -> list[str]:
    """Paths under `under` that commits `since..until` add (`git diff --diff-filter=A`), as git lists them."""
    return out(["diff", "--name-only", "--diff-filter=A", since, until, "--", under], cwd).split()


def deleted_paths(cwd: Path, since: str, under: str, until: str = "HEAD") -> list[str]:
    """Paths under `under` that commits `since..until` delete (`git diff --diff-filter=D`)."""
    return out(["diff", "--name-only", "--diff-filter=D", since, until, "--", under], cwd).split()
