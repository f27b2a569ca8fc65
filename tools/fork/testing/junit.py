"""Read pytest's junit XML into one result per test id, and count the outcomes."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
NOT_PASSING = {"failed", "error", "skipped", "xfailed"}
BROKEN = {"failed", "error"}
# pytest's option that keeps the `file` attribute the test ids are read from.
JUNIT_FAMILY = "junit_family=xunit1"
ParseError = ET.ParseError


@dataclass(frozen=True)
class Result:
    id: str
    outcome: str  # one of OUTCOMES
    message: str = ""

    @property
    def file(self) -> str:
        return self.id.split("::", 1)[0]


_SEVERITY = {o: i for i, o in enumerate(("passed", "skipped", "xfailed", "error", "failed"))}


def _test_id(case: ET.Element) -> str:
    classname, name, file = case.get("classname", ""), case.get("name", ""), case.get("file")
    if file:
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file.replace("/", ".")
        if not classname:  # a collection error: name is the dotted module
            return file
        if classname == module:
            return f"{file}::{name}"
        if classname.startswith(module + "."):
            return f"{file}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
    return f"{classname}::{name}" if classname else name


def parse_junit(text: str) -> dict[str, Result]:
    """Results per test id from a pytest junit XML (junit_family=xunit1, which keeps `file`)."""
    results: dict[str, Result] = {}
    root = ET.fromstring(text)
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        kinds = {child.tag: child for child in case if child.tag in ("failure", "error", "skipped")}
        if "failure" in kinds:
            outcome, message = "failed", kinds["failure"].get("message", "")
        elif "error" in kinds:
            outcome, message = "error", kinds["error"].get("message", "")
        elif "skipped" in kinds:
            skip = kinds["skipped"]
            outcome = "xfailed" if skip.get("type") == "pytest.xfail" else "skipped"
            message = skip.get("message", "")
        tid = _test_id(case)
        old = results.get(tid)
        if old is None or _SEVERITY[outcome] > _SEVERITY[old.outcome]:
            results[tid] = Result(tid, outcome, message.splitlines()[0][:200] if message else "")
    return results


def counts(results: dict[str, Result]) -> Counter:
    c = Counter(r.outcome for r in results.values())
    return Counter({o: c.get(o, 0) for o in OUTCOMES})


def fmt_counts(c: Counter) -> str:
    parts = [f"{c['passed']} passed", f"{c['failed']} failed", f"{c['error']} errors", f"{c['skipped']} skipped"]
    if c["xfailed"]:
        parts.append(f"{c['xfailed']} xfailed")
    return ", ".join(parts)


def is_test_file(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))
