"""What the rebase prints: a conflict, failing tests, the outcome table, loud notices and failures."""

from __future__ import annotations

import sys

from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import EXIT_FAILED, ForkError
from tools.fork.rebase.apply import Conflict
from tools.fork.rebase.state import State, workdir


def failure(exc: BaseException, what_now: str) -> ForkError:
    if isinstance(exc, KeyboardInterrupt):
        cause = "interrupted (SIGINT/SIGTERM)"
        code = EXIT_FAILED
    elif isinstance(exc, ForkError):
        cause, code = str(exc), exc.exit_code
    elif isinstance(exc, OSError):
        cause, code = f"{exc.strerror or exc} ({exc.filename or 'I/O error'})", EXIT_FAILED
    else:
        cause, code = f"{type(exc).__name__}: {exc}", EXIT_FAILED
    return ForkError(f"rebase failed: {cause}\n{what_now}", code)


def still_in_progress() -> str:
    return (
        "patches/, fork.toml and the overlay were not changed. The rebase is still in progress (build/rebase): "
        "fix the cause, then `python -m tools.fork rebase --continue`, or discard it with `--abort`."
    )


def written_but() -> str:
    return (
        "The rebase IS written (patches/, fork.toml, the overlay); what was cut short is the tidying up "
        "(build/fork, build/rebase): `python -m tools.fork rebase --continue` finishes it."
    )


def loud(message: str) -> None:
    bar = "!" * 78
    print(f"{bar}\n{message}\n{bar}", file=sys.stderr, flush=True)


def print_conflict(cfg: ForkConfig, st: State, c: Conflict) -> None:
    tree = workdir(cfg) / "tree"
    n = len(st.items)
    print(
        f"fork rebase: CONFLICT in patch {st.index + 1}/{n} {c.item.name} ({c.item.origin}) onto vllm-ascend {st.onto}"
    )
    tried = list(dict.fromkeys(st.tried.get(c.item.name, [])))
    if len(tried) > 1:
        print(f"  versions tried, none applies: {', '.join(tried)} (the conflict below is {c.item.origin}'s)")
    for line in c.files or [f"git am -3 could not apply it: {c.detail}"]:
        print(f"  {line}")
    unresolved = [line.split(":", 1)[0] for line in c.files]
    print("Resolve it in the rebase tree, then continue:")
    print(f"  cd {tree}")
    print("  git am --show-current-patch=diff    # the patch being applied")
    print("  # edit the files named above (remove the conflict markers); for a file deleted upstream,")
    print("  # move the change where it now belongs or accept the deletion with `git rm FILE`")
    print(f"  git add {' '.join(unresolved) if unresolved else 'FILES'}")
    print(f"  cd {cfg.root}")
    print("  python -m tools.fork rebase --continue   # or: python -m tools.fork rebase --abort")
    print("(Resolving to no change drops the patch; patches/, fork.toml and the overlay change only at the end.)")


def print_test_stop(cfg: ForkConfig, st: State) -> None:
    tree = workdir(cfg) / "tree"
    fails = st.test_failures
    print(f"fork rebase: TESTS FAILED on vllm-ascend {st.onto} ({len(fails)} test(s)); nothing was written")
    for f in fails[:30]:
        owner = f" (patch {f['patch']})" if f.get("patch") else ""
        msg = f"\n      {f['message']}" if f.get("message") else ""
        print(f"  {f['test']}: {f['outcome']}{owner}{msg}")
    if len(fails) > 30:
        print(f"  ... and {len(fails) - 30} more")
    for name, origins in st.tried.items():
        print(f"  versions of {name} tried: {', '.join(dict.fromkeys(origins))}")
    print("Fix it in the rebase tree (one patch is one commit: amend the patch's commit), then continue:")
    print(f"  cd {tree}")
    print(
        "  # edit, then `git commit --amend` (last patch) or `git commit --fixup=<commit>` + "
        "`git rebase -i --autosquash v" + st.onto + "`"
    )
    print(f"  cd {cfg.root}")
    print("  python -m tools.fork rebase --continue   # runs the tests again; or: python -m tools.fork rebase --abort")


def print_table(st: State) -> None:
    rows = [
        (str(i), r.name, r.outcome, "; ".join(r.evidence + ([st.chosen[r.name]] if r.name in st.chosen else [])))
        for i, r in enumerate(st.results, 1)
    ]
    head = ("#", "patch", "outcome", "evidence")
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(3)]
    for r in [head, *rows]:
        print("  " + "  ".join(r[k].ljust(widths[k]) for k in range(3)) + "  " + r[3])
