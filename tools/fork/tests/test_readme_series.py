"""README's series table is the series: one row per patch of `patches/series`, in its order.

A patch the pin does not apply, which older bases carry, is listed by its subject there: a rebase
onto a release without the code a patch fixes keeps the table as it is.

The table sits under README's `## The series` heading, as `| # | title | upstream? |`: the title is
the patch's subject exactly (its upstream PR title, `[Module][Action] Title`), and `upstream?` is
`fork-only` for a patch fork.toml marks `fork_only = true`, else `yes`. Read with plain parsing (the
patch files are mails; fork.toml is TOML), so the check does not depend on the tooling's modules.
"""

from __future__ import annotations

import email
import email.policy
import re
import shutil
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's copy of tomli
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[3]
HEADING = "## The series"


def series_rows(repo: Path) -> list[tuple[str, str, str]]:
    """(#, title, upstream?) of each patch of patches/series, from the patches (a base's variant where the
    pin has none) and fork.toml."""
    fork_toml = tomllib.loads((repo / "fork.toml").read_text())
    fork_only = {name for name, entry in fork_toml.get("patches", {}).items() if entry.get("fork_only")}
    rows = []
    for line in (repo / "patches" / "series").read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        versions = [repo / "patches" / name, *sorted((repo / "patches" / "bases").glob(f"*/{name}"))]
        patch = next((v for v in versions if v.is_file() and v.read_bytes().strip()), None)
        if patch is None:
            continue
        subject = email.message_from_bytes(patch.read_bytes(), policy=email.policy.default)["Subject"]
        rows.append((str(len(rows) + 1), str(subject), "fork-only" if name in fork_only else "yes"))
    return rows


def readme_rows(readme: str) -> list[tuple[str, str, str]]:
    """The rows of the first table under README's series heading (header and separator left out)."""
    lines = readme.splitlines()
    assert HEADING in lines, f"README.md has no {HEADING!r} section"
    rows, started = [], False
    for line in lines[lines.index(HEADING) + 1 :]:
        if not line.startswith("|"):
            if started:
                break
            continue
        started = True
        cells = tuple(cell.strip() for cell in line.strip().strip("|").split("|"))
        if cells[0] == "#" or set("".join(cells)) <= set("-: "):
            continue
        rows.append(cells)
    return rows


def test_readme_series_table_is_the_series():
    expected = series_rows(REPO)
    assert expected, "patches/series names no patch"
    table = "\n".join(f"| {n} | {title} | {up} |" for n, title, up in expected)
    assert readme_rows((REPO / "README.md").read_text()) == expected, f"README's series table should be:\n{table}"


def _copy(tmp: Path) -> Path:
    repo = tmp / "repo"
    shutil.copytree(REPO / "patches", repo / "patches")
    for name in ("fork.toml", "README.md"):
        shutil.copy2(REPO / name, repo / name)
    return repo


def _set_subject(patch: Path, subject: str) -> None:
    """Replace the patch's Subject header (with its folded continuation lines)."""
    data, n = re.subn(
        rb"^Subject: .*\n(?: .*\n)*", f"Subject: {subject}\n".encode(), patch.read_bytes(), count=1, flags=re.M
    )
    assert n == 1, patch
    patch.write_bytes(data)


def test_a_patch_added_or_renamed_without_the_table_fails(tmp_path):
    repo = _copy(tmp_path)
    assert readme_rows((repo / "README.md").read_text()) == series_rows(repo)

    # renamed: a new PR title for the first patch
    names = [n for n in (repo / "patches" / "series").read_text().split() if (repo / "patches" / n).is_file()]
    _set_subject(repo / "patches" / names[0], "[Ops][BugFix] A new title for the first patch")
    assert series_rows(repo)[0][1] == "[Ops][BugFix] A new title for the first patch"
    assert readme_rows((repo / "README.md").read_text()) != series_rows(repo)

    # added: one more patch at the end of the series
    repo = _copy(tmp_path / "added")
    rows = len(series_rows(repo))
    extra = "0099-Ops-Feature-Something-new.patch"
    shutil.copy2(repo / "patches" / names[-1], repo / "patches" / extra)
    _set_subject(repo / "patches" / extra, "[Ops][Feature] Something new")
    with (repo / "patches" / "series").open("a") as series:
        series.write(extra + "\n")
    assert series_rows(repo)[-1] == (str(rows + 1), "[Ops][Feature] Something new", "yes")
    readme = (repo / "README.md").read_text()
    assert readme_rows(readme) != series_rows(repo)

    # the table brought up to date passes again: the check is about the rows, nothing else
    last = f"| {rows} | {series_rows(repo)[-2][1]} | {series_rows(repo)[-2][2]} |"
    assert last in readme, "the table's last row is written as `| # | title | upstream? |`"
    readme = readme.replace(last, last + f"\n| {rows + 1} | [Ops][Feature] Something new | yes |")
    assert readme_rows(readme) == series_rows(repo)
