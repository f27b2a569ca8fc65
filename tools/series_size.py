"""The series' weight: lines added / removed outside tests/ per patch on the pin, against budgets;
and no two files under patches/ that carry the same change.

    python tools/series_size.py        # prints the table; exit 1 when over budget or on a duplicate

Counted with `git apply --numstat` on each file of `patches/series` (the pin's series). A patch's
budget is matched by a part of its file name (patch file names come from their subjects).
Two patch files are duplicates when they are equal without their mail headers and `index` lines:
a per-base variant stores only what differs on its base (skip markers, variants with no diff, are
left out).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"batched-memmove": 300, "Group-Mamba-state-tensor-copies": 430}  # added lines outside tests/
SERIES_BUDGET = 880


def numstat(patch: Path) -> tuple[int, int]:
    out = subprocess.run(["git", "apply", "--numstat", str(patch)], capture_output=True, text=True, check=True).stdout
    added = removed = 0
    for line in out.splitlines():
        plus, minus, path = line.split("\t", 2)
        if not path.startswith("tests/") and plus != "-":
            added, removed = added + int(plus), removed + int(minus)
    return added, removed


def duplicates() -> list[str]:
    seen: dict[bytes, Path] = {}
    out = []
    for path in sorted((ROOT / "patches").rglob("*.patch")):
        data = path.read_bytes()
        if b"\ndiff --git " not in data:
            continue  # a skip marker (patches/bases/<version>/): it carries no change
        body = data[data.find(b"\ndiff --git ") :].splitlines()
        key = b"\n".join(line for line in body if not line.startswith(b"index "))
        if key in seen and data.strip():
            out.append(f"{path.relative_to(ROOT)} carries the same change as {seen[key].relative_to(ROOT)}")
        seen.setdefault(key, path)
    return out


def main() -> int:
    names = [n.split("#")[0].strip() for n in (ROOT / "patches" / "series").read_text().splitlines()]
    over, total = [], 0
    print(f"{'added':>6} {'removed':>7} {'budget':>6}  patch (lines outside tests/, on the pin)")
    for name in filter(None, names):
        path = ROOT / "patches" / name
        if not path.is_file():  # variant-only: not applied on the pin
            continue
        added, removed = numstat(path)
        total += added
        budget = next((b for key, b in BUDGETS.items() if key in name), None)
        print(f"{added:>6} {removed:>7} {budget or '':>6}  {name}")
        if budget is not None and added > budget:
            over.append(f"{name}: {added} added lines > {budget}")
    print(f"{total:>6} {'':>7} {SERIES_BUDGET:>6}  the series")
    if total > SERIES_BUDGET:
        over.append(f"the series: {total} added lines > {SERIES_BUDGET}")
    problems = [f"over budget: {p}" for p in over] + duplicates()
    for problem in problems:
        print(f"series_size: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
