"""Deploy into a vllm-ascend git checkout: the series with `git am -3`, the HEAD before kept; revert resets to it."""

from __future__ import annotations

import re

from tools.fork.core import git, series
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput, ForkError, LocalEdits
from tools.fork.deploy.journal import write_json_atomic
from tools.fork.deploy.target import CHECKOUT_STATE, Target, load_json, refuse_if_deployed


def deploy_checkout(cfg: ForkConfig, target: Target, version: str) -> list[str]:
    root = target.root
    state_path = root / ".git" / CHECKOUT_STATE
    refuse_if_deployed(target)
    if git.am_in_progress(root) or (root / ".git" / "rebase-merge").exists():
        raise LocalEdits(f"{root}: a `git am` or `git rebase` is in progress; finish or abort it first")
    dirty = git.dirty_summary(root)
    if dirty:
        raise LocalEdits(f"{root} has uncommitted changes ({dirty}); commit or stash them first. Nothing was changed.")
    patches = series.read(cfg, version)
    if not patches:
        raise BadInput("patches/series is empty: nothing to deploy")
    pre = git.out(["rev-parse", "HEAD"], root)
    branch = git.run(["symbolic-ref", "-q", "--short", "HEAD"], root, check=False).stdout.strip() or None
    state = {
        "base": version,
        "pre_head": pre,
        "post_head": None,  # set when every commit is in: until then a kill is rolled back (recover_checkout)
        "branch": branch,
        "series": [[p.name, p.sha256] for p in patches],
    }
    write_json_atomic(state_path, state)
    proc = git.run(
        ["am", "-3", "--keep-non-patch", "--whitespace=nowarn", *(str(p.path.resolve()) for p in patches)],
        root,
        check=False,
    )
    if proc.returncode != 0:
        git.run(["am", "--abort"], root, check=False)
        if git.out(["rev-parse", "HEAD"], root) != pre:
            git.run(["reset", "-q", "--hard", pre], root)
        state_path.unlink()
        out = proc.stdout + proc.stderr
        failed = re.search(r"Patch failed at (\d+)", out)
        name = patches[int(failed.group(1)) - 1].name if failed else "?"
        already = "already patched: " if "Patch already applied" in out or "No changes" in out else ""
        detail = [
            ln.strip() for ln in out.splitlines() if ln.startswith(("error:", "CONFLICT", "Patch failed", "No changes"))
        ]
        raise ForkError(
            f"{already}patch {name} does not apply to {root} (vllm-ascend {version}); nothing was changed:\n  "
            + "\n  ".join(detail[-10:] or out.strip().splitlines()[-8:])
        )
    state["post_head"] = git.out(["rev-parse", "HEAD"], root)
    write_json_atomic(state_path, state)  # the commit point
    return [f"{p.name}" for p in patches]


def recover_checkout(target: Target) -> str | None:
    """Roll back a deploy killed before its commit point (`post_head` unset): abort the `git am`,
    reset to the HEAD before it. None when there is nothing to recover."""
    root = target.root
    state_path = root / ".git" / CHECKOUT_STATE
    state_path.with_name(state_path.name + ".tmp").unlink(missing_ok=True)
    state = load_json(state_path)
    if state is None or state.get("post_head") or not state.get("pre_head"):
        return None
    if git.am_in_progress(root):
        git.run(["am", "--abort"], root, check=False)
    git.run(["reset", "-q", "--hard", state["pre_head"]], root)
    state_path.unlink()
    return f"rolled back an interrupted deploy: HEAD is back at {state['pre_head'][:12]}"


def revert_checkout(target: Target, *, force: bool = False, recovered: bool = False) -> list[str]:
    root = target.root
    state_path = root / ".git" / CHECKOUT_STATE
    state = load_json(state_path)
    if state is None and recovered:
        return []
    if state is None:
        raise BadInput(f"{root}: no deploy record ({state_path} not found): nothing to revert")
    head = git.out(["rev-parse", "HEAD"], root)
    problems = []
    if head != state["post_head"]:
        problems.append(f"HEAD moved since the deploy ({state['post_head'][:12]} -> {head[:12]})")
    dirty = git.dirty_summary(root)
    if dirty:
        problems.append(f"uncommitted changes: {dirty}")
    if problems and not force:
        raise LocalEdits.revert_refused(
            f"{root}: reverting would discard work done after the deploy", problems, "reset to the pre-deploy HEAD"
        )
    git.run(["reset", "-q", "--hard", state["pre_head"]], root)
    state_path.unlink()
    return [
        f"reset {state.get('branch') or 'HEAD'} to {state['pre_head'][:12]} (dropped {len(state['series'])} commit(s))"
    ]
