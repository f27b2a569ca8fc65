"""Materialized trees: a base release as a git repository, with the series on top.

Layout of a materialized tree DIR:
  one commit "upstream <version>" tagged `v<version>` holding the release's files;
  then one commit per patch (`git am`), on branch `fork`;
  DIR/.git/fork-state.json records what was applied, so a later `apply` can tell
  "up to date" from "series changed" from "someone edited the tree".
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.fork.core import git, series, txn, upstream
from tools.fork.core.errors import BadInput, ForkError, LocalEdits
from tools.fork.core.series import Patch, base_tag

BRANCH = "fork"
BASE_AUTHOR = "vllm-ascend upstream <upstream@vllm-ascend.invalid>"


@dataclass
class State:
    base: str  # base version
    base_commit: str
    series: list[tuple[str, str]]  # (patch name, sha256 of the patch file) applied, in order
    head: str  # HEAD right after the last apply/export
    applying: bool = False  # saved before `git am` runs: a kill leaves the tool's own half-applied series

    @staticmethod
    def path(tree: Path) -> Path:
        return tree / ".git" / "fork-state.json"

    @classmethod
    def load(cls, tree: Path) -> State | None:
        try:
            data = json.loads(cls.path(tree).read_text())
            data["series"] = [tuple(x) for x in data["series"]]
            return cls(**data)
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            return None

    def save(self, tree: Path) -> None:
        tmp = self.path(tree).with_name("fork-state.json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, self.path(tree))


class ApplyFailed(ForkError):
    """A patch did not apply; names the patch and the files git complained about."""

    def __init__(self, patch: Patch, detail: str):
        self.patch = patch
        self.detail = detail
        super().__init__(f"patch {patch.name} does not apply:\n  {detail}")


PARTIAL_SUFFIX = ".fork-partial"


def create_base(source: upstream.Source, tree: Path) -> str:
    """Make `tree` a git repository holding exactly the base release; return its commit.

    It is made in `<tree>.fork-partial` and renamed into place when complete: a kill midway never
    leaves a half-extracted tree under the final name (the next run removes the partial one)."""
    if tree.exists() and any(tree.iterdir()):
        raise LocalEdits(f"{tree} exists and is not empty; refusing to overwrite it")
    partial = tree.with_name(tree.name + PARTIAL_SUFFIX)
    txn.discard(partial)
    partial.mkdir(parents=True)
    try:
        upstream.extract(source, partial)
        git.run(["init", "-q", "-b", BRANCH], partial)
        # Commit messages carry upstream's `### ...` PR sections: with git's default comment
        # character, editing a message (reword, squash) would silently strip them.
        git.run(["config", "core.commentChar", ";"], partial)
        commit = commit_release(source, partial)
        if tree.exists():
            tree.rmdir()  # empty (checked above)
        os.replace(partial, tree)
        return commit
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def commit_release(source: upstream.Source, tree: Path) -> str:
    """Commit the release files extracted in `tree` as "upstream <version>" on the current (unborn)
    branch, tagged v<version>; return the commit."""
    # -f: the release ships files its own .gitignore names (e.g. csrc/third_party);
    # generated files stay untracked so builds and installs can rewrite them.
    git.run(["add", "-A", "-f", "--", ".", *(f":!{p}" for p in upstream.GENERATED_FILES)], tree)
    name, email = BASE_AUTHOR[:-1].split(" <")
    env = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": git.FIXED_DATE}
    git.run(["commit", "-q", "--no-verify", "-m", f"upstream {source.version}"], tree, env=env)
    git.run(["tag", base_tag(source.version)], tree)
    return git.out(["rev-parse", "HEAD"], tree)


def base_version(tree: Path) -> str | None:
    """The base a materialized tree was made from (its `upstream <version>` root commit)."""
    if not git.is_repo(tree):
        return None
    root = git.run(["rev-list", "--max-parents=0", "HEAD"], tree, check=False).stdout.split()
    if len(root) != 1:
        return None
    subject = git.out(["log", "-1", "--format=%s", root[0]], tree)
    return subject.removeprefix("upstream ") if subject.startswith("upstream ") else None


def am(tree: Path, patch: Patch, *, three_way: bool = False) -> None:
    """Apply one patch as one commit. On failure the am session is left for the caller."""
    args = ["am", "--keep-non-patch", "--whitespace=nowarn"]
    if three_way:
        # merge.renames defaults to diff.renames, which git.py pins off: let the merge follow renames.
        args = ["-c", "merge.renames=true", *args, "-3"]
    proc = git.run([*args, str(patch.path.resolve())], tree, check=False)
    if proc.returncode != 0:
        raise ApplyFailed(patch, _am_failure_detail(proc.stdout + proc.stderr))


def _am_failure_detail(output: str) -> str:
    keep = [
        line.strip()
        for line in output.splitlines()
        if line.startswith(("error:", "CONFLICT", "Patch failed", "fatal:"))
        or "does not exist in index" in line
        or "patch does not apply" in line
    ]
    return "\n  ".join(keep or output.strip().splitlines()[-8:])


def abort_am(tree: Path) -> None:
    if git.am_in_progress(tree):
        git.run(["am", "--abort"], tree, check=False)


def apply_series(tree: Path, patches: list[Patch], *, three_way: bool = False) -> None:
    for patch in patches:
        try:
            am(tree, patch, three_way=three_way)
        except ApplyFailed:
            abort_am(tree)
            raise


def local_edits(tree: Path) -> list[str]:
    """What in `tree` is not the tooling's own doing: dirty files, unexported commits."""
    problems = []
    if git.am_in_progress(tree):
        problems.append("a `git am` session is in progress")
    dirty = git.dirty_summary(tree)
    if dirty:
        problems.append(f"uncommitted changes: {dirty}")
    state = State.load(tree)
    head = git.rev(tree, "HEAD")
    if state is not None and head != state.head:
        n = git.out(["rev-list", "--count", f"{state.head}..HEAD"], tree, check=False) or "?"
        problems.append(f"HEAD moved since the last apply/export ({n} new commit(s) not exported)")
    return problems


def unheld_commits(tree: Path, version: str, patches: list[Patch], repo: Path | None = None) -> list[str]:
    """The commits on top of the base in `tree` whose change is held neither by one of `patches`
    (same `git patch-id`) nor by any patch file git knows in the fork repository (a commit that
    was exported once and committed, e.g. before a `git pull` changed patches/): "<sha> <subject>"."""
    base = git.rev(tree, base_tag(version))
    if base is None:
        return []
    commits = git.out(["rev-list", "--reverse", f"{base}..HEAD"], tree, check=False).split()
    if not commits:
        return []
    held = {series.patch_id(p.path.read_bytes()) for p in patches if p.path.is_file()}
    repo = repo or (patches[0].path.parent if patches else None)
    lost = []
    for c in commits:
        shown = git.run(["show", "--no-renames", "--format=commit %H", c], tree, check=False, binary=True).stdout
        if series.patch_id(shown) in held:
            continue
        if repo is not None:  # the exported form of this commit, as a blob the fork repository has
            rendered = git.run([*series.FORMAT_PATCH, "--stdout", "-1", c], tree, check=False, binary=True).stdout
            blob = git.run(["hash-object", "--stdin"], repo, input=rendered, check=False, binary=True).stdout
            blob = blob.decode().strip()
            if blob and git.run(["cat-file", "-e", blob], repo, check=False).returncode == 0:
                continue
        lost.append(git.out(["log", "-1", "--format=%h %s", c], tree))
    return lost


def materialize(
    tree: Path,
    source_for_base,
    version: str,
    patches: list[Patch],
    *,
    force: bool = False,
    repo: Path | None = None,
) -> str:
    """Make `tree` the base `version` plus `patches`. Idempotent.

    Returns what happened: "created", "reapplied" or "up to date".
    `source_for_base` is called (to download/verify) only when the base must be extracted.
    Refuses (LocalEdits) to discard local edits unless `force`: uncommitted changes, commits made
    since the last apply/export, and commits whose change neither `patches` nor the fork repository
    `repo` (default: the one holding the patches) holds, e.g. an export that was discarded.
    """
    wanted = [(p.name, p.sha256) for p in patches]
    txn.remove_trash(tree)  # a killed run's half-deleted tree
    if tree.exists() and not git.is_repo(tree) and any(tree.iterdir()):
        if not force:
            raise LocalEdits(
                f"{tree} exists and is not a materialized tree (a run killed while it was made or deleted?); "
                f"refusing to overwrite it. Delete it (`rm -rf {shlex.quote(str(tree))}`) or pass --force"
            )
        print(f"fork: {tree} is not a materialized tree (left by a killed run?): making it again", flush=True)
        txn.discard(tree)
    if git.is_repo(tree) and base_version(tree) != version:
        _replace_stale(tree, version, force=force)
    if git.is_repo(tree):
        state = State.load(tree)
        edits = local_edits(tree)
        if state is not None and state.applying:  # the tool's own `git am`s, cut short: not the user's work
            edits = []
        if edits and not force:
            raise LocalEdits(
                f"{tree} has local edits; refusing to overwrite them:\n  - "
                + "\n  - ".join(edits)
                + "\nExport them (`python -m tools.fork export`) or pass --force to discard them."
            )
        if not edits and state is not None and state.series == wanted and not state.applying:
            return "up to date"
        if not force and not (state is not None and state.applying):
            lost = unheld_commits(tree, version, patches, repo)
            if lost:
                raise LocalEdits(
                    f"{tree} has commits that patches/ does not hold; re-applying would drop them:\n  - "
                    + "\n  - ".join(lost)
                    + "\nKeep them: `python -m tools.fork export` (writes them to patches/), then commit patches/. "
                    "Drop them: `apply --force`."
                )
        abort_am(tree)
        git.run(["reset", "-q", "--hard", base_tag(version)], tree)
        git.run(["clean", "-q", "-fd"], tree)
        outcome = "reapplied"
    else:
        if tree.exists() and any(tree.iterdir()):
            raise LocalEdits(f"{tree} exists and is not a materialized tree; refusing to overwrite it")
        create_base(source_for_base(), tree)
        outcome = "created"
    base_commit = git.out(["rev-parse", base_tag(version)], tree)
    State(version, base_commit, wanted, base_commit, applying=True).save(tree)
    try:
        apply_series(tree, patches)
    except ApplyFailed:
        git.run(["reset", "-q", "--hard", base_tag(version)], tree)
        State(version, git.out(["rev-parse", base_tag(version)], tree), [], git.out(["rev-parse", "HEAD"], tree)).save(
            tree
        )
        raise
    State(version, git.out(["rev-parse", base_tag(version)], tree), wanted, git.out(["rev-parse", "HEAD"], tree)).save(
        tree
    )
    return outcome


def _replace_stale(tree: Path, version: str, *, force: bool) -> None:
    """A tree materialized on another release (e.g. by a rebase that was then discarded with git): made
    again on `version` when nothing in it is the user's own work (or with `force`); refused otherwise."""
    have = base_version(tree)
    edits = local_edits(tree) if have is not None else ["it is not a tree the tooling made (no upstream root commit)"]
    if edits and not force:
        raise LocalEdits(
            f"{tree} is materialized on vllm-ascend {have or '(unknown)'}, not {version}, and holds work of "
            "its own:\n  - "
            + "\n  - ".join(edits)
            + "\nKeep it: move the folder away. Drop it: `python -m tools.fork apply --force`."
        )
    print(
        f"fork: {tree} was materialized on vllm-ascend {have or '(unknown)'}, not {version}: making it again",
        flush=True,
    )
    txn.discard(tree)


def commits(tree: Path, version: str) -> list[str]:
    """The series commits of a materialized tree, oldest first."""
    return git.out(["rev-list", "--reverse", f"{base_tag(version)}..HEAD"], tree).split()


def require_tree(tree: Path) -> str:
    version = base_version(tree)
    if version is None:
        made = (
            "make it again with `python -m tools.fork apply --force`"
            if tree.exists()
            else "run `python -m tools.fork apply` first"
        )
        raise BadInput(f"{shlex.quote(str(tree))} is not a materialized tree ({made})")
    return version
