"""Print a patch of the series as an upstream pull request, ready to paste into upstream's PR form.

`pr N` takes N as the 1-based position in patches/series or as a patch name (or a unique part of
one). The title is the commit subject, `[Module][Action] Title`; the body is the commit message:
upstream's three PR template sections ("What this PR does / why we need it?", "Does this PR
introduce _any_ user-facing change?", "How was this patch tested?"). `Signed-off-by:` lines are
left out of the body: upstream's DCO rule (docs/source/developer_guide/contribution/index.md)
asks for them in commits, and the patch's commit keeps them; the PR form has no place for them.
Fork-only patches (fork.toml `[patches."NAME"] fork_only = true`) are not for upstream: `pr` says
so and prints nothing. `--all` prints every upstreamable patch. The patch itself, for the PR
branch: `git am --keep-non-patch patches/NAME` on upstream's tree (`export --upstream DIR` writes
them all).

`--npu-report DIR` (a folder `npu-report` wrote on an NPU) puts that run's lines for the patch at the
end of "How was this patch tested?", and turns each sentence saying there was no NPU run into a
pointer to them; a patch the report runs nothing of keeps its text (with a warning).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tools.fork.core import series
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import EXIT_FAILED, BadInput
from tools.fork.npu import report as npu_report

HELP = __doc__

# Upstream's PR bot (.github/workflows/bot_pr_create.yaml) runs `sed -i '/- vLLM .*$/d'` on the
# body: any line containing "- vLLM " is deleted from the PR description.
BOT_DELETES_RE = re.compile(r"- vLLM .*$")
SIGNOFF_RE = re.compile(r"^Signed-off-by: .*$\n?", re.M)


def add_arguments(p) -> None:
    p.add_argument("patch", nargs="?", metavar="N", help="position in patches/series (1-based) or patch name")
    p.add_argument("--all", action="store_true", help="every upstreamable patch, in series order")
    part = p.add_mutually_exclusive_group()
    part.add_argument("--title", action="store_true", help="print the title only")
    part.add_argument("--body", action="store_true", help="print the body only")
    p.add_argument("--npu-report", type=Path, metavar="DIR",
                   help="carry the numbers of this NPU report (`npu-report --out DIR`) in the body")  # fmt: skip


def find(cfg: ForkConfig, key: str) -> tuple[int, list[series.Patch]]:
    """(0-based index, the pin's series) of the patch named by `key`."""
    patches = series.read(cfg)
    if not patches:
        raise BadInput("patches/series is empty")
    if key.isdigit():
        n = int(key)
        if not 1 <= n <= len(patches):
            raise BadInput(f"patch {n}: the series has {len(patches)} patch(es) (1..{len(patches)})")
        return n - 1, patches
    exact = [i for i, p in enumerate(patches) if key in (p.name, p.name.removesuffix(".patch"))]
    found = exact or [i for i, p in enumerate(patches) if key.lower() in p.name.lower()]
    if len(found) == 1:
        return found[0], patches
    if not found:
        raise BadInput(f"no patch in patches/series matches {key!r}")
    raise BadInput(f"{key!r} matches several patches: " + ", ".join(patches[i].name for i in found))


def pull_request(patch: series.Patch, npu: tuple[Path, dict] | None = None) -> tuple[str, str, list[str]]:
    """(title, body, notes) of a patch as an upstream pull request; `npu`: (folder, record) of an NPU report
    whose lines the body then carries."""
    info = patch.info
    body = SIGNOFF_RE.sub("", info.message).strip() + "\n"
    notes = []
    if npu is not None:
        folder, rec = npu
        entry = npu_report.npu_entry(rec, folder, patch.name, info.subject)
        if entry["lines"]:
            body = npu_report.with_npu_run(body, entry, rec["date"])
        else:
            notes.append(f"{folder} runs nothing this patch changes: its text is unchanged")
    return info.subject, body, notes


def warnings(patch: series.Patch, body: str) -> list[str]:
    out = series.convention_problems(patch)
    for line in body.splitlines():
        if BOT_DELETES_RE.search(line):
            out.append(f"upstream's PR bot deletes body lines containing '- vLLM ': {line.strip()[:80]!r}")
    return out


def _print(patch: series.Patch, index: int, total: int, cfg: ForkConfig, args, npu=None) -> bool:
    title, body, notes = pull_request(patch, npu)
    if args.all:  # which patch each text is; a single `pr N` prints nothing but the text to paste
        print(
            f"fork pr: patch {index + 1}/{total} {patch.name} (vllm-ascend {cfg.pin.version}; "
            f"apply with `git am --keep-non-patch {patch.path.relative_to(cfg.root)}`)",
            file=sys.stderr,
        )
    if args.title:
        print(title)
    elif args.body:
        print(body, end="")
    else:
        print(f"{title}\n\n{body}", end="")
    problems = notes + warnings(patch, body)
    for msg in problems:
        print(f"fork pr: warning: {msg}", file=sys.stderr)
    return not problems


def run(args, cfg: ForkConfig) -> int:
    if args.all == bool(args.patch):
        raise BadInput("give one patch (N or a name) or --all")
    npu = (args.npu_report, npu_report.load_record(args.npu_report)) if args.npu_report else None
    if args.all:
        patches = series.read(cfg)
        ok, shown = True, 0
        for i, p in enumerate(patches):
            if p.name in cfg.fork_only:
                print(
                    f"fork pr: patch {i + 1} {p.name} is fork-only ({cfg.fork_only[p.name]}): left out", file=sys.stderr
                )
                continue
            if shown:
                print("\n" + "=" * 78 + "\n")
            ok = _print(p, i, len(patches), cfg, args, npu) and ok
            shown += 1
        return 0 if ok else EXIT_FAILED
    index, patches = find(cfg, args.patch)
    patch = patches[index]
    if patch.name in cfg.fork_only:
        raise BadInput(
            f"patch {index + 1} {patch.name} is fork-only ({cfg.fork_only[patch.name]}); it is not sent upstream "
            "(fork.toml marks it so)"
        )
    return 0 if _print(patch, index, len(patches), cfg, args, npu) else EXIT_FAILED
