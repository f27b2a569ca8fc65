"""Starting a rebase: the new release's source (trusted on first use when new) and the rebase tree."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tools.fork.core import git, materialize, upstream
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput, ForkError, LocalEdits
from tools.fork.core.materialize import ApplyFailed
from tools.fork.core.series import base_tag
from tools.fork.rebase.report import loud
from tools.fork.rebase.state import OLD_REF, Item, State, digest, protected_files


def require_no_unexported_edits(cfg: ForkConfig) -> None:
    tree = cfg.default_fork_dir()
    if git.is_repo(tree) and materialize.base_version(tree) == cfg.pin.version:
        edits = materialize.local_edits(tree)
        if edits:
            raise LocalEdits(
                f"{tree} has work that is not in patches/ and would be left out of the rebase:\n  - "
                + "\n  - ".join(edits)
                + "\nExport it first (`python -m tools.fork export`), or discard it "
                "(`python -m tools.fork apply --force`)."
            )


def announce_first_use(cfg: ForkConfig, release: upstream.Release) -> None:
    """A release fork.toml does not list yet: say loudly which sha256 the pin will record (TOFU)."""
    version, src = release.base.version, release.source
    if not release.sdist_sha256:
        raise BadInput(
            f"vllm-ascend {version} is not in fork.toml, and a pin records the release's sdist sha256: get the "
            f"sdist once (`python -m tools.fork test --base {version} --env-only`, or --sdist PATH) and run again"
        )
    if src.checkout:
        where = f"files from {src.checkout} ({src.verified}); the pin records the cached sdist's"
    else:
        where = f"{release.origin}:\n  {src.sdist}"
    loud(
        f"TRUST ON FIRST USE: vllm-ascend {version} is not in fork.toml. Using {where}\n"
        f"  sha256 {release.base.sha256}\n"
        "This sha256 is recorded in fork.toml if the rebase completes. Compare it with the hash the "
        f"package registry publishes for {cfg.dist} {version} before you commit fork.toml."
    )


def _release_key(version: str) -> tuple:
    """Order of releases: X.Y.Z, then a, b, rc (pre-releases before the final), then .postN."""
    m = re.match(r"^(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?", version)
    nums = tuple(int(x) for x in m.group(1).split("."))
    nums += (0,) * (4 - len(nums))
    pre = ({"a": 0, "b": 1, "rc": 2}[m.group(2)], int(m.group(3))) if m.group(2) else (3, 0)
    return nums, pre, int(m.group(4) or 0)


def is_older(version: str, than: str) -> bool:
    return _release_key(version) < _release_key(than)


def setup(cfg, work: Path, old_pin: str, old_patches, version: str, source, target) -> State:
    """The rebase tree: a clone of the old series (materialized as `apply` does, in build/fork when
    that is free) for range-diff and evidence, plus the new release as a second root commit, on
    which branch `fork` starts."""
    old_tree, tree, queue = _old_series_tree(cfg, work, old_pin, old_patches), work / "tree", work / "queue"
    # --local: objects are hard-linked, not copied; the clone is a standalone repository.
    git.run(["clone", "-q", "--local", "--no-checkout", "--no-tags", "--single-branch", "-b", materialize.BRANCH,
             str(old_tree), str(tree)], work)  # fmt: skip
    git.run(["fetch", "-q", str(old_tree), f"refs/tags/{base_tag(old_pin)}:refs/tags/{base_tag(old_pin)}"], tree)
    git.run(["update-ref", OLD_REF, f"refs/heads/{materialize.BRANCH}"], tree)
    git.run(["remote", "remove", "origin"], tree)
    git.run(["config", "core.commentChar", ";"], tree)  # keep `### ...` PR sections when messages are edited
    if old_tree.parent == work:
        shutil.rmtree(old_tree)
    # The new release: a root commit on an unborn branch, which becomes `fork`.
    git.run(["symbolic-ref", "HEAD", "refs/heads/rebase-new-base"], tree)
    git.run(["read-tree", "--empty"], tree)
    upstream.extract(source, tree)
    materialize.commit_release(source, tree)
    git.run(["branch", "-M", materialize.BRANCH], tree)
    queue.mkdir()
    items = []
    for name, path in target:
        if path is None:
            items.append(Item(name, None, "not needed on this base"))
            continue
        shutil.copyfile(path, queue / name)
        items.append(Item(name, f"queue/{name}", path.relative_to(cfg.root).as_posix()))
    head = git.out(["rev-parse", "HEAD"], tree)
    return State(
        onto=version, onto_sha256="", first_use=False, old_pin=old_pin, drop_old_base=False, test=False,
        digest=digest(protected_files(cfg)), items=items, head=head,
    )  # fmt: skip


def _old_series_tree(cfg: ForkConfig, work: Path, old_pin: str, old_patches) -> Path:
    """The old series materialized on the old pin: build/fork (brought up to date as `apply` would),
    or, when build/fork is on another base, a private tree under build/rebase."""
    fork = cfg.default_fork_dir()
    tree = fork if not fork.exists() or materialize.base_version(fork) == old_pin else work / "old"
    try:
        materialize.materialize(tree, lambda: upstream.obtain(cfg, old_pin).source, old_pin, old_patches)
    except ApplyFailed as exc:
        raise ForkError(
            f"the current series does not apply to its pin {old_pin}: {exc}\n"
            "Fix it first (`python -m tools.fork check`)."
        ) from None
    return tree
