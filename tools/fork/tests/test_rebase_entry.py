"""`rebase_tested`, the rebase family's entry point for other families: a structured outcome."""

from __future__ import annotations

import sys

from tools.fork.core import config
from tools.fork.core.errors import EXIT_CONFLICT
from tools.fork.rebase.engine import rebase_tested
from tools.fork.tests.synthetic import COPY, SERIES, UPSTREAM, B, const, edited, make, replace


def test_a_written_rebase_reports_each_patch_and_the_tests(tmp_path, monkeypatch):
    fork = make(tmp_path, monkeypatch, edited(UPSTREAM, SERIES[1][1]))  # 1.1 has patch 2 already
    out = rebase_tested(fork.root, B, test_python=sys.executable)
    assert out.written and out.exit_code == 0 and out.onto == B
    by_name = {p.name: p for p in out.patches}
    assert list(by_name) == fork.names
    assert by_name[fork.names[0]].outcome == "applied cleanly" and by_name[fork.names[0]].applied
    assert by_name[fork.names[1]].outcome == "already upstream (dropped)" and not by_name[fork.names[1]].applied
    assert by_name[fork.names[0]].variant == f"patches/{fork.names[0]}"
    assert any("the series' own tests" in line for line in out.tests)
    assert out.test_counts["series"]["passed"] > 0 and out.test_counts["series"]["failed"] == 0
    assert out.sha256 == fork.sha[B] and not out.first_use  # B is a base in fork.toml: its hash is known
    assert out.conflict is None and config.load(fork.root).pin.version == B


def test_a_conflict_names_the_patch_its_files_and_every_version_tried(tmp_path, monkeypatch):
    b = edited(
        UPSTREAM, {COPY: replace("        data = load(src[i], size)\n", "        data = load(src[i], size, x=1)\n")}
    )
    b = edited(b, {"README.md": const("1.1\n")})
    fork = make(tmp_path, monkeypatch, b)
    variant = fork.root / "patches" / "bases" / "1.0" / fork.names[0]
    variant.parent.mkdir(parents=True)
    variant.write_bytes(fork.patch(fork.names[0]).replace(b"# all loads before any store", b"# loads first"))
    before = fork.snapshot()
    out = rebase_tested(fork.root, B, test_python=sys.executable)
    assert out.exit_code == EXIT_CONFLICT and not out.written
    assert out.conflict == fork.names[0] and out.conflict_files == [COPY]
    assert out.variants_tried[fork.names[0]] == [f"patches/{fork.names[0]}", f"patches/bases/1.0/{fork.names[0]}"]
    assert fork.snapshot() == before  # nothing written; build/rebase is left for --continue / --abort
    assert fork.cli("rebase", "--abort").rc == 0
