"""The report's folder: its environment, the verdict on `memmove`, each patch's lines, report.md and report.json.

    OUT/report.md        for people: environment, phases, verdict, the lines for each upstream PR
    OUT/report.json      everything, for `pr N --npu-report OUT` and for comparing runs
    OUT/copy_paths.png   the copy-path benchmark's plot
    OUT/json/*.json      the benchmarks' and stress runs' own records
    OUT/logs/*           every run's output (and the op tests' junit XML)

Both report files are rewritten after every phase, so an interrupted run keeps what finished.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.fork.core.errors import BadInput
from tools.fork.npu import phases as ph
from tools.fork.npu.phases import FAILED, NO_CONTROL, OK, PhaseResult
from tools.fork.npu.plan import Plan

BACKEND_VARIABLE = "VLLM_ASCEND_MAMBA_COPY_BACKEND"
VERDICT_REQUESTS = ("1", "8", "64")

# Run with the phases' Python: what the device is, and the versions that matter there. Prints JSON;
# "error" when the device asked for is not usable.
PROBE = r"""
import glob, json, os, platform, subprocess, sys
device = sys.argv[1]
out = {"python": platform.python_version(), "executable": sys.executable}
def version(dist):
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
def first_version(paths):
    for pattern in paths:
        for path in sorted(glob.glob(pattern)):
            for line in open(path, errors="replace"):
                key, _, value = line.partition("=")
                if key.strip().lower() in ("version", "version_dir") and value.strip():
                    return value.strip()
    return None
try:
    import torch
    out["torch"] = torch.__version__
except Exception as exc:
    print(json.dumps({**out, "error": f"torch is not importable by {sys.executable}: {exc}"})); sys.exit()
if device == "npu":
    try:
        import torch_npu
        out["torch_npu"] = torch_npu.__version__
    except Exception as exc:
        why = f"no NPU: torch_npu is not importable by {sys.executable} ({str(exc)[:120]})"
        print(json.dumps({**out, "error": why}))
        sys.exit()
    if not torch.npu.is_available():
        print(json.dumps({**out, "error": "no NPU: torch_npu sees no device (torch.npu.is_available() is False)"}))
        sys.exit()
    out["device"] = torch.npu.get_device_name(0)
    out["triton-ascend"] = version("triton-ascend") or version("triton_ascend")
    home = (os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
            or "/usr/local/Ascend/ascend-toolkit/latest")
    out["CANN"] = first_version([f"{home}/version.cfg", f"{home}/*/ascend_toolkit_install.info",
                                 f"{home}/compiler/version.info"])
    out["driver"] = first_version(["/usr/local/Ascend/driver/version.info"])
elif device == "cuda":
    if not torch.cuda.is_available():
        print(json.dumps({**out, "error": "no CUDA GPU: torch.cuda.is_available() is False"})); sys.exit()
    out["device"] = torch.cuda.get_device_name(0)
    out["CUDA"] = torch.version.cuda
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except Exception:
        out["driver"] = None
else:
    out["device"] = f"CPU ({platform.machine()}), Triton interpreter"
try:
    import triton
    out["triton"] = triton.__version__
except Exception as exc:
    print(json.dumps({**out, "error": f"triton is not importable by {sys.executable}: {str(exc)[:120]}"})); sys.exit()
for name in ("numpy", "pytest", "hypothesis"):
    out[name] = version(name)
print(json.dumps(out))
"""

DEVICE_WORDS = {"npu": "NPU", "cuda": "the NPU mapped to the GPU", "cpu": "small mode under the Triton interpreter"}
# How each patch's lines begin.
ON_DEVICE = {
    "npu": "On an NPU",
    "cuda": "On a CUDA GPU, the op tests' NPU mapped to it",
    "cpu": "On the CPU, in the small mode under the Triton interpreter (no concurrency, no device speed)",
}


def probe(python: str, device: str, env: dict[str, str], cwd: Path) -> dict:
    """The environment of the phases' Python; "error" set when the device is not usable."""
    try:
        proc = subprocess.run([python, "-c", PROBE, device], capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python} could not run: {exc}"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"{python} could not report its environment ({tail[:160]})"}


def environment_line(env: dict) -> str:
    """One line naming the device and the versions that matter on it."""
    keys = ("driver", "CANN", "torch", "torch_npu", "triton-ascend", "CUDA", "triton")
    return f"{env.get('device', '?')} (" + ", ".join(f"{k} {env[k]}" for k in keys if env.get(k)) + ")"


@dataclass
class Verdict:
    memmove: bool
    reasons: list[str] = field(default_factory=list)  # why not (empty when memmove may become the default)
    criteria: list[tuple[str, bool, str]] = field(default_factory=list)  # (criterion, met, evidence)

    @property
    def line(self) -> str:
        if self.memmove:
            return f"`memmove` may become the default on this device: set `{BACKEND_VARIABLE}=memmove`."
        return "keep `torch` (the default): " + "; ".join(self.reasons) + "."


def verdict(device: str, results: dict[str, PhaseResult]) -> Verdict:
    """`memmove` may become the default when, on an NPU, it was exact under stress, the unguarded control
    went wrong in the same run, and it was faster than `torch` at 1, 8 and 64 requests on every layout."""
    v = Verdict(memmove=False)
    stress = results.get("stress-memmove")
    judged = stress is not None and bool(stress.details)  # ran to the end and was judged
    if not judged:
        why = f"stress-memmove {stress.status if stress else 'not run'}"
        v.criteria += [("memmove exact under stress", False, why), ("the unguarded control went wrong", False, why)]
    else:
        exact = stress.details["memmove_errors"] == 0 and stress.status != FAILED
        ug = stress.details["rows"]["unguarded"]
        v.criteria.append(("memmove exact under stress", exact, stress.summary))
        v.criteria.append(("the unguarded control went wrong", ug[0] > 0, f"{ug[0]} of {ug[1]} rows corrupted"))
    bench = results.get("copy-paths")
    table = bench.details.get("median_ms", {}) if bench is not None and bench.status == OK else {}
    slower = []
    for layout, by_requests in table.items():
        for n in VERDICT_REQUESTS:
            ms = by_requests.get(n, {})
            if "memmove" not in ms or "torch" not in ms:
                slower.append(f"{layout} at {n}: not timed")
            elif ms["memmove"] >= ms["torch"]:
                slower.append(f"{layout} at {n}: {ms['memmove']:.3f} ms against {ms['torch']:.3f}")
    if not table:
        why = bench.status + (f" ({bench.summary})" if bench.summary else "") if bench else "not run"
        v.criteria.append(("memmove faster than torch at 1, 8 and 64 requests", False, f"copy-paths {why}"))
    else:
        evidence = "; ".join(slower) if slower else "every layout timed: " + ", ".join(table)
        v.criteria.append(("memmove faster than torch at 1, 8 and 64 requests", not slower, evidence))
    for name, met, evidence in v.criteria:
        if not met:
            v.reasons.append(f"{name}: no ({evidence})")
    if device != "npu":
        v.reasons.append(f"this run is not on an NPU ({DEVICE_WORDS[device]}): the default on Ascend needs an NPU run")
    v.memmove = not v.reasons
    return v


# --- the lines for each upstream PR -----------------------------------------------------------------


def _ms(table: dict, layout: str, backend: str) -> str:
    return " / ".join(f"{table[layout][n][backend]:.3f}" if backend in table[layout].get(n, {}) else "-"
                      for n in VERDICT_REQUESTS)  # fmt: skip


def phase_lines(result: PhaseResult, plan: Plan, patch_files: set[str]) -> list[str]:
    """What a phase shows for one patch, as PR text lines (Markdown bullets)."""
    spec = next(p for p in ph.PHASES if p.name == result.name)
    script = f" (`{spec.script}`)" if spec.script else ""
    if result.status not in (OK, NO_CONTROL, FAILED):
        return [f"- {spec.what}{script}: {result.status} ({result.summary})"]
    if result.name == "op-tests":
        lines = []
        for file in sorted(plan.op_tests):
            related = {file, *plan.imports.get(file, [])}
            if not related & patch_files:
                continue
            fork = result.details["fork"].get(file, {})
            base = result.details["base"].get(file, {})
            caught = sum(1 for t in result.details["caught_on_base"] if t.split("::", 1)[0] == file)
            both = sum(1 for t in result.details["broken_on_both"] if t.split("::", 1)[0] == file)
            line = f"- `{file.rsplit('/', 1)[-1]}`: {_counts(fork)}; on the unpatched kernels {_counts(base)}"
            line += f", {caught} of them failing where this passes" if caught else ""
            line += f" ({both} fail on both: not judged)" if both else ""
            lines.append(line)
        return lines
    if result.name == "copy-paths":
        table = result.details.get("median_ms", {})
        layout = "backing" if "backing" in table else next(iter(table), None)
        if layout is None:
            return []
        return [
            f"- copy paths{script}, one align-mode step, `{layout}` layout, median ms at 1 / 8 / 64 requests: "
            f"`memmove` {_ms(table, layout, 'memmove')}, `torch` (grouped) {_ms(table, layout, 'torch')}, "
            f"per-pair `torch_clone` {_ms(table, layout, 'torch_clone')}"
        ]
    return [f"- {spec.what}{script}: {result.summary}" + ("" if result.status == OK else f" ({result.status})")]


def _counts(c: dict) -> str:
    parts = [f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped") if c.get(k)]
    return ", ".join(parts) or "no test run"


def patch_lines(plan: Plan, results: dict[str, PhaseResult], env: dict, device: str, date: str) -> dict:
    """{patch name: {"number", "title", "lines"}} for every upstream patch: the evidence under its
    "How was this patch tested?", from the phases whose files the patch touches."""
    out = {}
    for patch in plan.patches:
        if not patch.upstream:
            continue
        files = set(patch.files)
        lines = []
        for spec in ph.PHASES:
            result = results.get(spec.name)
            if result is None:
                continue
            relevant = spec.name == "op-tests" or set(spec.evidence_for) & files
            if relevant:
                lines += phase_lines(result, plan, files)
        head = f"{ON_DEVICE[device]}: {environment_line(env)}, {date[:10]}, `python3 -m tools.fork npu-report`:"
        out[patch.name] = {"number": patch.number, "title": patch.title, "lines": [head, "", *lines] if lines else []}
    return out


# --- writing ------------------------------------------------------------------------------------------


def write(out: Path, record: dict) -> None:
    """report.json and report.md, each replaced whole (a reader never sees half a file)."""
    for name, text in (("report.json", json.dumps(record, indent=1) + "\n"), ("report.md", markdown(record))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def markdown(r: dict) -> str:
    env, v = r["environment"], r["verdict"]
    lines = [
        f"# NPU report: {r['status']}",
        "",
        f"{r['date']}, device `{r['device']}` ({DEVICE_WORDS[r['device']]}), vllm-ascend {r['plan']['version']} "
        f"and its fork series.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v_} |" for k, v_ in env.items() if v_ and k != "executable"),
        f"| fork kernels | `{r['plan']['fork_tree']}` |",
        f"| base kernels | `{r['plan']['base_tree']}` |",
        "",
        f"    {r['command']}",
        "",
        "## Verdict",
        "",
        v["line"],
        "",
        "| criterion | met | evidence |",
        "|---|---|---|",
        *(f"| {c} | {'yes' if met else 'no'} | {ev} |" for c, met, ev in v["criteria"]),
        "",
        "## Phases",
        "",
        "| phase | status | seconds | result |",
        "|---|---|---|---|",
        *(f"| {p['name']} | {p['status']} | {p['seconds']:.0f} | {p['summary']} |" for p in r["phases"]),
        "",
    ]
    bench = next((p for p in r["phases"] if p["name"] == "copy-paths" and p["details"].get("median_ms")), None)
    if bench:
        lines += ["## Copy paths (median ms per align-mode step)", "",
                  "| layout | requests | " + " | ".join(f"`{b}`" for b in ("torch", "torch_clone", "memmove")) + " |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for layout, by_n in bench["details"]["median_ms"].items():
            for n, ms in by_n.items():
                cells = " | ".join(f"{ms[b]:.3f}" if b in ms else "-" for b in ("torch", "torch_clone", "memmove"))
                lines.append(f"| {layout} | {n} | {cells} |")
        lines += ["", "![copy paths](copy_paths.png)", ""]
    lines += ['## For each upstream PR (paste under "How was this patch tested?")', ""]
    for name, p in r["patches"].items():
        lines += [f"### {p['number']}. {p['title']}", ""]
        lines += p["lines"] or ["(no phase of this report runs what this patch changes)"]
        lines.append("")
    what = "Test files (from the series: the op tests it adds or changes, upstream's that import a module it changes; "
    lines += ["## What ran", "", what + "the grouped copy's tests):", ""]
    lines += [f"- `{f}`" for f in (*r["plan"]["op_tests"], *r["plan"]["grouped_copy_tests"])]
    lines += ["", "`report.json` holds everything above, `json/` the runs' records, `logs/` their output."]
    return "\n".join(lines) + "\n"


def record(*, date, device, command, env, plan: Plan, results: dict[str, PhaseResult], status: str) -> dict:
    v = verdict(device, results)
    return {
        "date": date,
        "device": device,
        "status": status,
        "command": command,
        "environment": env,
        "plan": {
            k: getattr(plan, k)
            for k in ("version", "tests_tree", "fork_tree", "base_tree", "op_tests", "grouped_copy_tests")
        },  # fmt: skip
        "phases": [asdict(res) for res in results.values()],
        "verdict": {"memmove": v.memmove, "line": v.line, "reasons": v.reasons, "criteria": v.criteria},
        "patches": patch_lines(plan, results, env, device, date),
        "variable": BACKEND_VARIABLE,
    }


# --- the PR text ----------------------------------------------------------------------------------

# How the PR texts say that a patch was not run on an NPU ("**No NPU run.**", "no NPU run of this change",
# "There has been no run on an NPU: ...", "None of this was run on an NPU: ...").
NO_NPU_RE = re.compile(
    r"\bno\s+(?:\*\*)?NPU\s+run\b|\b(?:no|not|never|none of this)\b[^.]{0,40}?\b(?:run|ran|tested)\s+on\s+an?\s+NPU\b",
    re.IGNORECASE,
)
TESTED = "### How was this patch tested?"


def load_record(folder: Path) -> dict:
    """report.json of a report folder."""
    try:
        rec = json.loads((folder / "report.json").read_text())
        rec["patches"], rec["device"], rec["date"]  # noqa: B018 - the keys `pr` reads
        return rec
    except FileNotFoundError:
        raise BadInput(f"{folder}: no report.json (`python3 -m tools.fork npu-report --out DIR` writes one)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{folder}/report.json: not an npu-report record ({exc})") from None


def _sentence(text: str, m: re.Match) -> tuple[int, int]:
    """The span of the sentence holding `m`: from a paragraph's, a bullet's or the last sentence's start
    to the full stop after it (with a bold sentence's closing `**`)."""
    start = m.start()
    while start > 0:
        before = text[max(0, start - 3) : start]
        if before.endswith("\n\n") or before[-2:] in (". ", ".\n") or before in ("\n- ", "\n* "):
            break
        start -= 1
    end = m.end()
    while end < len(text) and not (text[end] == "." and text[end + 1 : end + 2] in ("", " ", "\n", "*")):
        end += 1
    end = min(end + 1, len(text))
    if text[start : start + 2] == "**" and text[end : end + 2] == "**":
        end += 2
    return start, end


def with_npu_run(body: str, entry: dict, date: str) -> str:
    """The PR body with the report's lines at the end of "How was this patch tested?", and each
    sentence saying there was no NPU run pointing at them instead."""
    pointer = f'The NPU run ({date[:10]}) is at the end of "How was this patch tested?".'
    while (m := NO_NPU_RE.search(body)) is not None:
        start, end = _sentence(body, m)
        body = body[:start] + pointer + body[end:]
    block = "\n".join(entry["lines"]).rstrip() + "\n"
    at = body.find(TESTED)
    after = body.find("\n### ", at + len(TESTED)) if at >= 0 else -1
    if at < 0:  # no such section: the block is one
        return body.rstrip() + f"\n\n{TESTED}\n\n{block}"
    if after < 0:
        return body.rstrip() + "\n\n" + block
    return body[:after].rstrip() + "\n\n" + block + body[after:]


def npu_entry(rec: dict, folder: Path, name: str, title: str) -> dict:
    """The report's entry for a patch (by name, else by title); BadInput when the run was not on an NPU."""
    if rec["device"] != "npu":
        raise BadInput(
            f"{folder} is a --device {rec['device']} run ({rec.get('environment', {}).get('device', '?')}), not "
            "an NPU run: the PR text keeps its statement that there was none"
        )
    entry = rec["patches"].get(name) or next((e for e in rec["patches"].values() if e.get("title") == title), None)
    if entry is None:
        raise BadInput(f"{folder} has no entry for {name}: run npu-report again on this series")
    return entry
