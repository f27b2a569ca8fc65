"""The rebase in progress: its state in build/rebase/state.json and the files it must not overwrite."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.fork.core.config import OVERLAY_ROOTS, ForkConfig
from tools.fork.core.errors import InProgress, LocalEdits

OLD_REF = "refs/rebase/old"  # the old series, fetched into the rebase tree for range-diff and evidence

APPLIED_CLEANLY = "applied cleanly"
APPLIED_3WAY = "applied with 3-way merge"
PARTIALLY_UPSTREAM = "partially upstream"
ALREADY_UPSTREAM = "already upstream (dropped)"
RESOLVED = "conflict resolved"
RESOLVED_EMPTY = "dropped: resolved to nothing"
NOT_APPLIED = "not applied on this base"


@dataclass
class Item:
    name: str  # the patch's name in patches/series
    file: str | None  # its copy under build/rebase/queue/ applied on the new base; None: not applied there
    origin: str  # where it came from, for the report ("patches/NAME", "patches/bases/V/NAME", ...)


@dataclass
class Result:
    name: str
    outcome: str
    evidence: list[str] = field(default_factory=list)
    applied: bool = False  # a commit in the rebased tree stands for it


@dataclass
class State:
    onto: str
    onto_sha256: str
    first_use: bool  # VERSION was not in fork.toml: its sha256 is trusted on first use
    old_pin: str
    drop_old_base: bool
    test: bool
    digest: str  # of the protected files when the rebase started
    items: list[Item]
    index: int = 0  # the patch being (or next to be) applied
    head: str = ""  # HEAD after the last finished patch
    stopped: bool = False  # stopped at a conflict on items[index]
    phase: str = "apply"  # apply -> write -> written
    new_digest: str = ""  # of the protected files as the rebase writes them
    results: list[Result] = field(default_factory=list)
    # the tests before the write (rebase_test): off with --no-test
    no_test: bool = False
    series_only: bool = False
    test_python: str = ""
    source_sdist: str = ""
    source_checkout: str = ""
    tested: list[str] = field(default_factory=list)  # the test report's summary ("UNTESTED" with --no-test)
    test_failures: list[dict] = field(default_factory=list)  # set while stopped at failing tests
    test_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # the test report's counts, per run
    tried: dict[str, list[str]] = field(default_factory=dict)  # patch -> variant origins tried
    chosen: dict[str, str] = field(default_factory=dict)  # patch -> why the tests chose its variant
    conflict_files: list[str] = field(default_factory=list)  # files that conflicted in the stopped patch

    @staticmethod
    def load(work: Path) -> State:
        try:
            data = json.loads((work / "state.json").read_text())
            data["items"] = [Item(**i) for i in data["items"]]
            data["results"] = [Result(**r) for r in data["results"]]
            return State(**data)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise InProgress(
                f"{work} exists but its state is unreadable ({exc}); a rebase was cut short. "
                "Discard it with `python -m tools.fork rebase --abort`."
            ) from None

    def save(self, work: Path) -> None:
        tmp = work / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, work / "state.json")


def workdir(cfg: ForkConfig) -> Path:
    return cfg.build_dir / "rebase"


def protected_paths(cfg: ForkConfig) -> list[Path]:
    return [cfg.patches_dir, cfg.toml_path, *(cfg.root / r for r in OVERLAY_ROOTS)]


def protected_files(cfg: ForkConfig) -> dict[str, bytes]:
    snap = {}
    for root in protected_paths(cfg):
        if root.is_file():
            snap[root.relative_to(cfg.root).as_posix()] = root.read_bytes()
        elif root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
                    snap[p.relative_to(cfg.root).as_posix()] = p.read_bytes()
    return snap


def digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest())
    return h.hexdigest()


def require_unchanged(cfg: ForkConfig, st: State) -> None:
    if digest(protected_files(cfg)) != st.digest:
        raise LocalEdits(
            "patches/, fork.toml or the overlay changed since the rebase started; finishing it would overwrite "
            "those changes. Undo them (e.g. `git stash`), then `rebase --continue`; or `rebase --abort` and start "
            "again."
        )


def in_progress_message(cfg: ForkConfig) -> str:
    work = workdir(cfg)
    try:
        st = State.load(work)
        where = f"onto vllm-ascend {st.onto}"
        if st.stopped:
            where += f", stopped at a conflict in {st.items[st.index].name}"
    except InProgress:
        where = "(state unreadable)"
    return (
        f"a rebase is already in progress {where} ({work}).\n"
        "Resolve it and run `python -m tools.fork rebase --continue`, or discard it with "
        "`python -m tools.fork rebase --abort`."
    )
