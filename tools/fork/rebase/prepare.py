"""Starting a rebase: the new release's source (trusted on first use when new) and the rebase tree."""

from __future__ import annotations

import shutil
from pathlib import Path

from tools.fork.core import git
from tools.fork.core import materialize
from tools.fork.core import registry
from tools.fork.core import upstream
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import BadInput, ForkError, LocalEdits
from tools.fork.core.materialize import ApplyFailed
from tools.fork.rebase.report import loud
from tools.fork.rebase.state import OLD_REF, Item, State, digest, protected_files
from tools.fork.core.series import base_tag


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


def first_use_source(
    cfg: ForkConfig, version: str, sdist: Path | None, checkout: Path | None, version_unchecked: bool = False
):
    """A release fork.toml does not list yet: take the sdist as it is and record its sha256 (TOFU).
    With --checkout the files come from the checkout (its version checked) and the pin's sha256
    from the release's sdist in the cache."""
    cached = registry.cached_sdist(cfg, version)
    if checkout is not None:
        src = upstream.from_checkout(checkout, version, version_unchecked=version_unchecked)
        if not cached.exists():
            raise BadInput(
                f"vllm-ascend {version} is not in fork.toml, and a pin records the release's sdist sha256: get the "
                f"sdist once (`python -m tools.fork test --base {version} --env-only`, or --sdist PATH) and run again"
            )
        upstream.require_sdist_version(cached, version)
        sha256 = upstream.sha256_of(cached)
        loud(
            f"TRUST ON FIRST USE: vllm-ascend {version} is not in fork.toml. Files from {checkout} "
            f"({src.verified}); the pin records the cached sdist's sha256 {sha256}."
        )
        return src, sha256
    path, where = upstream.fetch_unpinned(cfg, version, sdist=sdist)
    origin = {
        "given": "the given sdist",
        "cache": "the cached sdist (not yet in fork.toml)",
        "registry": "downloaded from the package registry",
    }[where]
    sha256 = upstream.sha256_of(path)
    loud(
        f"TRUST ON FIRST USE: vllm-ascend {version} is not in fork.toml. Using {origin}:\n"
        f"  {path}\n  sha256 {sha256}\n"
        "This sha256 is recorded in fork.toml if the rebase completes. Compare it with the hash the "
        f"package registry publishes for {cfg.dist} {version} before you commit fork.toml."
    )
    return upstream.Source(version, sdist=path, verified=f"sha256 {sha256[:12]} (first use)"), sha256


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
        materialize.materialize(tree, lambda: upstream.resolve(cfg, old_pin), old_pin, old_patches)
    except ApplyFailed as exc:
        raise ForkError(
            f"the current series does not apply to its pin {old_pin}: {exc}\n"
            "Fix it first (`python -m tools.fork check`)."
        ) from None
    return tree
