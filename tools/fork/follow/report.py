"""What `follow` reports: one JSON document for a scheduler, the same as Markdown for a pull request."""

from __future__ import annotations

import json
from pathlib import Path

from tools.fork.rebase.engine import Outcome
from tools.fork.rebase.state import ALREADY_UPSTREAM, NOT_APPLIED, PARTIALLY_UPSTREAM

# report["status"]: what happened, one per exit code of `follow` (cmd_follow.py)
MOVED, NOTHING_NEWER, CONFLICT, TESTS_FAIL, FAILED = "moved", "nothing-newer", "conflict", "tests-fail", "failed"
_HEADLINE = {
    MOVED: "moved, tests green",
    NOTHING_NEWER: "nothing newer",
    CONFLICT: "NEEDS A PERSON: a patch conflicts",
    TESTS_FAIL: "NEEDS A PERSON: tests fail",
    FAILED: "FAILED",
}
_COUNTED = ("passed", "failed", "error", "skipped")
_RUNS = {"series": "the series' own tests", "base": "upstream's CPU suite, base", "fork": "upstream's CPU suite, fork"}


def _kind(outcome: str) -> str:
    if outcome == ALREADY_UPSTREAM:
        return "already upstream"
    if outcome == PARTIALLY_UPSTREAM:
        return "partially upstream"
    if outcome == NOT_APPLIED:
        return "not applied"
    return "applied"


def _variant(origin: str) -> str | None:
    """The base whose variant of the patch was used ("patches/bases/V/NAME" -> V); None: the series' own."""
    return origin.split("/")[2] if origin.startswith("patches/bases/") else None


def patch_entries(outcome: Outcome, planned: list[tuple[str, str]]) -> list[dict]:
    """Per patch of the series (`planned`: name and the version of it tried first, in series order):
    what the rebase did with it, which version it used, the evidence, every version tried."""
    done = {p.name: p for p in outcome.patches}
    out = []
    for name, first in planned:
        tried = list(outcome.variants_tried.get(name, []))
        p = done.get(name)
        if p is not None:
            entry = {"patch": name, "version": p.variant, "variant": _variant(p.variant), "kind": _kind(p.outcome),
                     "outcome": p.outcome, "evidence": list(p.evidence)}  # fmt: skip
        elif name == outcome.conflict:
            entry = {"patch": name, "version": first, "variant": _variant(first), "kind": "conflict",
                     "outcome": "CONFLICT", "evidence": [], "files": list(outcome.conflict_files)}  # fmt: skip
            tried = tried or [first]
        else:
            entry = {"patch": name, "version": first, "variant": _variant(first), "kind": "not reached",
                     "outcome": "not reached (an earlier patch conflicts)", "evidence": []}  # fmt: skip
        entry["tried"] = tried
        out.append(entry)
    return out


def test_section(outcome: Outcome) -> dict:
    failures = list(outcome.test_failures)
    return {
        "summary": list(outcome.tests),  # the gate's own lines, when it passed
        "counts": outcome.test_counts,  # "series", "base", "fork": outcome -> tests
        "failures": failures,
        "regressed": [f["test"] for f in failures if f.get("kind") == "suite" and not _missing(f)],
        "lost": [f["test"] for f in failures if _missing(f)],
    }


def _missing(failure: dict) -> bool:
    return failure["outcome"].startswith("missing")


def write(report: dict, directory: Path) -> tuple[Path, Path]:
    """follow.json and follow.md in `directory`; their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    js, md = directory / "follow.json", directory / "follow.md"
    js.write_text(json.dumps(report, indent=1) + "\n")
    md.write_text(markdown(report))
    return js, md


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(r: dict) -> str:
    """The report as a pull-request description (or an issue, when it needs a person)."""
    v = r.get("version") or "-"
    lines = [f"## Follow vllm-ascend {v}: {_HEADLINE[r['status']]}", ""]
    if r.get("version"):
        sha = r.get("sha256")  # absent when the release was never obtained (e.g. not on the registry)
        tofu = ", trusted on first use: compare it with the registry's hash" if r.get("first_use") else ""
        lines.append(
            f"- **Release:** vllm-ascend {v} (from {r['from']}"
            + (f"; sdist sha256 `{sha[:12]}`{tofu})" if sha else ")")
        )
        if r.get("vllm"):
            lines.append(f"- **Paired vLLM:** {r['vllm']}" + (f", from {r['vllm_from']}" if r.get("vllm_from") else ""))
    lines += [f"- **Exit code:** {r['exit_code']} ({r['status']})", f"- **Wall time:** {r['wall_s']:.0f} s"]
    if r.get("branch"):
        lines.append(f"- **Branch:** `{r['branch']}` (commit `{r['commit'][:12]}`)")
    if r.get("message"):
        lines += ["", r["message"]]
    if r.get("patches"):
        lines += ["", "### Patches", "", "| # | patch | outcome | version used | evidence |", "|---|---|---|---|---|"]
        for i, p in enumerate(r["patches"], 1):
            evidence = list(p["evidence"]) + [f"`{f}`" for f in p.get("files", [])]
            if p["kind"] == "conflict" or len(p["tried"]) > 1:
                evidence.append("versions tried: " + ", ".join(f"`{t}`" for t in p["tried"]))
            used = f"{p['variant']} variant" if p["variant"] else "series"
            lines.append(f"| {i} | `{p['patch']}` | {p['outcome']} | {used} | {_cell('; '.join(evidence)) or '-'} |")
    tests = r.get("tests")
    if tests and not tests["counts"] and not tests["failures"]:
        lines += ["", "### Tests", "", "Not run: the rebase stopped before them."]
    elif tests:
        lines += ["", f"### Tests (on vllm-ascend {v}, vLLM {r.get('vllm') or '?'})", ""]
        counts = tests["counts"]
        if counts:
            lines += ["| run | passed | failed | errors | skipped |", "|---|---|---|---|---|"]
            for key, label in _RUNS.items():
                if key in counts:
                    lines.append(f"| {label} | " + " | ".join(str(counts[key].get(o, 0)) for o in _COUNTED) + " |")
            lines.append("")
        lines += [f"- {line}" for line in tests["summary"]]
        lines.append(f"- regressed (pass on the base, not on the fork): {len(tests['regressed'])}; "
                     f"lost (pass on the base, missing on the fork): {len(tests['lost'])}")  # fmt: skip
        if tests["failures"]:
            lines += ["", "Failing tests:", ""]
            for f in tests["failures"][:30]:
                owner = f" (patch `{f['patch']}`)" if f.get("patch") else ""
                msg = f": {f['message']}" if f.get("message") else ""
                lines.append(f"- `{f['test']}`: {f['outcome']}{owner}{_cell(msg)}")
            if len(tests["failures"]) > 30:
                lines.append(f"- ... and {len(tests['failures']) - 30} more (follow.json)")
    if r.get("next"):
        lines += ["", "### What to do", "", *r["next"]]
    return "\n".join(lines) + "\n"
