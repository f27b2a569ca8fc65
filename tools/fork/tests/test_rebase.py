"""`rebase` on synthetic upstreams (tools/fork/tests/synthetic.py): every per-patch outcome and the conflict flow.

Oracles: the rebased tree must hold exactly the files computed in Python (the new release's files
with the patches' edits applied); "nothing changed" is a byte snapshot of patches/, fork.toml and
the overlay; outcomes and evidence are read from the tool's report.
"""

from __future__ import annotations

from tools.fork.core import config, git, series
from tools.fork.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_CONFLICT,
    EXIT_IN_PROGRESS,
)
from tools.fork.tests.synthetic import (
    COPY,
    P2_CODE,
    SERIES,
    SNAPSHOT_TEST,
    UPSTREAM,
    UTILS,
    A,
    B,
    assert_tree,
    assert_unchanged,
    const,
    edited,
    expected_tree,
    make,
    outcomes,
    replace,
)

# --- outcomes -------------------------------------------------------------------------------------


def test_clean_apply_moves_the_pin_and_keeps_patches(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {"README.md": const("# vllm-ascend 1.1\n")})
    fork = make(tmp_path, monkeypatch, b)
    old = {n: fork.patch(n) for n in fork.names}
    r = fork.ok("rebase", "--onto", B)
    assert set(outcomes(fork, r.out).values()) == {"applied cleanly"}
    assert "git range-diff" in r.out and "1:  " in r.out
    cfg = config.load(fork.root)
    assert cfg.pin.version == B and cfg.pin.sha256 == fork.sha[B]
    assert [b.version for b in cfg.bases] == [A, B]
    assert {n: fork.patch(n) for n in fork.series()} == old  # same blobs touched: same bytes
    assert fork.variants() == {}
    assert not fork.work.exists()
    assert_tree(fork, expected_tree(b))
    assert "up to date" in fork.ok("apply").out
    fork.ok("check", "--all-bases")


def test_moved_code_applies_with_an_offset(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace('"""\n\n\n', '"""\n\nCHUNK = 1024\nALIGN = 32\nMAX = 8\n\n\n')})
    fork = make(tmp_path, monkeypatch, b)
    r = fork.ok("rebase", "--onto", B)
    got = outcomes(fork, r.out)
    assert got[fork.names[0]] == f"applied cleanly (offset {COPY} +4 lines)"
    assert fork.variants() == {}  # an offset is not a semantic difference
    assert_tree(fork, expected_tree(b))
    fork.ok("check", "--all-bases")  # the new patch still applies on 1.0 (at an offset)


def test_three_way_merge_keeps_the_old_version_as_a_variant_and_round_trips(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        size = sizes[i]\n", "        size = int(sizes[i])\n")})
    fork = make(tmp_path, monkeypatch, b)
    original = fork.snapshot()
    r = fork.ok("rebase", "--onto", B)
    assert outcomes(fork, r.out)[fork.names[0]] == "applied with 3-way merge"
    assert_tree(fork, expected_tree(b))
    # The old pin stays in the matrix: its version of patch 1 differs (context), so it is kept.
    assert fork.variants() == {f"{A}/{fork.names[0]}": original[fork.root / "patches" / fork.names[0]]}
    fork.ok("check", "--all-bases")
    after_first = fork.snapshot()
    r = fork.ok("rebase", "--onto", A, "--older")  # and back: the variant applies cleanly
    assert outcomes(fork, r.out)[fork.names[0]] == f"applied cleanly ({A} variant)"
    assert {n: fork.patch(n) for n in fork.series()} == {n: original[fork.root / "patches" / n] for n in fork.names}
    assert list(fork.variants()) == [f"{B}/{fork.names[0]}"]
    fork.ok("check", "--all-bases")
    fork.ok("rebase", "--onto", B)
    assert fork.snapshot() == after_first  # lossless both ways


def test_conflict_stops_then_continue_after_resolution(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        store(dst[i], data)\n", "        store(dst[i], data, cache=False)\n")})
    fork = make(tmp_path, monkeypatch, b)
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_CONFLICT
    assert f"CONFLICT in patch 1/3 {fork.names[0]}" in r.out
    tree = fork.work / "tree"
    text = (tree / COPY).read_text()
    first = text.splitlines().index(next(x for x in text.splitlines() if x.startswith("<<<<<<<"))) + 1
    last = text.splitlines().index(next(x for x in text.splitlines() if x.startswith(">>>>>>>"))) + 1
    assert f"{COPY}: both modified; conflict markers at lines {first}-{last}" in r.out
    assert f"cd {tree}" in r.out and f"git add {COPY}" in r.out and "rebase --continue" in r.out
    assert_unchanged(fork, before)
    assert "rebase   in progress" in fork.ok("status").out
    # A second rebase while this one is open is refused.
    again = fork.cli("rebase", "--onto", B)
    assert again.rc == EXIT_IN_PROGRESS and "already in progress" in again.err and fork.names[0] in again.err
    # --continue before resolving says what is still unresolved.
    early = fork.cli("rebase", "--continue")
    assert early.rc == EXIT_CONFLICT and COPY in early.err
    assert_unchanged(fork, before)
    # Resolve: upstream's new store call, guarded.
    resolved = b[COPY].replace(
        "        store(dst[i], data, cache=False)\n",
        "        barrier()  # all loads before any store\n        store(dst[i], data, cache=False)\n",
    )
    (tree / COPY).write_text(resolved)
    git.run(["add", COPY], tree)
    r = fork.ok("rebase", "--continue")
    got = outcomes(fork, r.out)
    assert got[fork.names[0]].startswith("conflict resolved")
    assert got[fork.names[1]] == "applied cleanly"
    want = expected_tree(b, SERIES[1:])
    want = edited(want, {k: v for k, v in SERIES[0][1].items() if k != COPY})
    want[COPY] = resolved
    assert_tree(fork, want)
    assert f"{A}/{fork.names[0]}" in fork.variants()
    fork.ok("check", "--all-bases")


def test_conflict_then_abort_leaves_everything_byte_identical(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        store(dst[i], data)\n", "        put(dst[i], data)\n")})
    fork = make(tmp_path, monkeypatch, b)
    before = fork.snapshot()
    fork_tree_head = git.out(["rev-parse", "HEAD"], fork.tree)
    assert fork.cli("rebase", "--onto", B).rc == EXIT_CONFLICT
    r = fork.ok("rebase", "--abort")
    assert "not changed" in r.out
    assert_unchanged(fork, before)
    assert not fork.work.exists()
    assert git.out(["rev-parse", "HEAD"], fork.tree) == fork_tree_head
    assert fork.cli("rebase", "--abort").rc == EXIT_BAD_INPUT  # nothing left to abort
    assert fork.cli("rebase", "--continue").rc == EXIT_BAD_INPUT


def test_conflict_resolved_to_nothing_drops_the_patch(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {COPY: replace("        store(dst[i], data)\n", "        put(dst[i], data)\n")})
    fork = make(tmp_path, monkeypatch, b)
    original = fork.snapshot()
    assert fork.cli("rebase", "--onto", B).rc == EXIT_CONFLICT
    tree = fork.work / "tree"
    git.run(["reset", "-q", "--hard", "HEAD"], tree)  # take upstream's side of everything
    git.run(["clean", "-q", "-fd"], tree)
    r = fork.ok("rebase", "--continue")
    assert outcomes(fork, r.out)[fork.names[0]].startswith("dropped: resolved to nothing")
    # The pin no longer applies patch 1; 1.0 (still in the matrix) keeps it as a variant, numbered
    # before the pin's renumbered first patch (0000a-) so that no two patches share a number.
    dropped = "0000a-" + fork.names[0].split("-", 1)[1]
    assert fork.series()[0] == dropped
    assert not (fork.root / "patches" / dropped).exists()
    assert fork.variants()[f"{A}/{dropped}"] == original[fork.root / "patches" / fork.names[0]]
    assert [p.name for p in series.read(config.load(fork.root))][0] != dropped
    assert [p.name for p in series.read(config.load(fork.root), A)][0] == dropped
    fork.ok("check", "--all-bases")


def test_already_upstream_is_dropped_with_patch_id_evidence_and_round_trips(tmp_path, monkeypatch):
    b = edited(UPSTREAM, SERIES[1][1])  # upstream took patch 2 exactly
    fork = make(tmp_path, monkeypatch, b)
    original = fork.snapshot()
    r = fork.ok("rebase", "--onto", B)
    line = next(x for x in r.out.splitlines() if fork.names[1] in x and "already upstream" in x)
    pid = series.patch_id(original[fork.root / "patches" / fork.names[1]])
    assert f"upstream's own diff {A}..{B} over {SNAPSHOT_TEST}, {UTILS} has the same patch-id {pid[:12]}" in line
    assert_tree(fork, expected_tree(b, [SERIES[0], SERIES[2]]))
    names = fork.series()
    # patch 2 stays listed for 1.0 (variant-only), numbered after patch 1 so that no two patches share
    # a number; patch 3 is renumbered, and fork.toml follows it.
    assert names[1] == "0001a-" + fork.names[1].split("-", 1)[1] and not (fork.root / "patches" / names[1]).exists()
    assert names[2].startswith("0002-Misc-Feature")
    assert list(config.load(fork.root).fork_only) == [names[2]]
    assert f"on {A}: {names[1]} (own variant)" in fork.ok("status").out
    fork.ok("check", "--all-bases")
    r = fork.ok("rebase", "--onto", A, "--older")
    assert outcomes(fork, r.out)[names[1]] == f"applied cleanly ({A} variant)"
    assert fork.series() == fork.names
    for n in fork.names:
        assert fork.patch(n) == original[fork.root / "patches" / n]
    assert (fork.root / "fork.toml").read_bytes() == original[fork.root / "fork.toml"]
    # 1.1 skips patch 2: an empty variant marks it already upstream there.
    assert fork.variants()[f"{B}/{fork.names[1]}"] == b""
    fork.ok("check", "--all-bases")


def test_already_upstream_with_other_changes_says_applying_changes_nothing(tmp_path, monkeypatch):
    b = edited(UPSTREAM, SERIES[1][1])
    b = edited(b, {UTILS: replace("    return None\n", "    return 0\n")})
    fork = make(tmp_path, monkeypatch, b)
    r = fork.ok("rebase", "--onto", B)
    line = next(x for x in r.out.splitlines() if fork.names[1] in x and "already upstream" in x)
    assert f"applying it changes nothing: {B} already has every change to {SNAPSHOT_TEST}, {UTILS}" in line


def test_partially_upstream_names_the_file_and_keeps_the_full_patch_for_the_old_base(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {UTILS: P2_CODE})  # upstream took the code change, not the test
    fork = make(tmp_path, monkeypatch, b)
    original = fork.snapshot()
    r = fork.ok("rebase", "--onto", B)
    got = outcomes(fork, r.out)[fork.names[1]]
    assert got.startswith("partially upstream")
    assert f"{UTILS}: change already in {B}; upstream's own diff {A}..{B} of it has the same patch-id" in got
    new = fork.patch(fork.names[1])
    assert set(series.file_sections(new)) == {SNAPSHOT_TEST}  # test-only on the new pin
    assert fork.variants()[f"{A}/{fork.names[1]}"] == original[fork.root / "patches" / fork.names[1]]
    fork.ok("check", "--all-bases")


def test_file_deleted_upstream_is_named_in_the_conflict(tmp_path, monkeypatch):
    b = edited(UPSTREAM, {UTILS: const(None)})
    fork = make(tmp_path, monkeypatch, b)
    before = fork.snapshot()
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_CONFLICT
    assert f"CONFLICT in patch 2/3 {fork.names[1]}" in r.out
    assert f"{UTILS}: deleted upstream, modified by the patch (modify/delete); not in {B}" in r.out
    assert "git rm FILE" in r.out
    assert_unchanged(fork, before)
    tree = fork.work / "tree"
    git.run(["rm", "-q", UTILS], tree)  # accept the deletion; keep the test
    r = fork.ok("rebase", "--continue")
    # only the file that conflicted (not the patch's other, cleanly applied files)
    assert outcomes(fork, r.out)[fork.names[1]] == f"conflict resolved (by hand: {UTILS})"
    assert set(series.file_sections(fork.patch(fork.names[1]))) == {SNAPSHOT_TEST}


def test_file_renamed_upstream_is_followed(tmp_path, monkeypatch):
    b = dict(UPSTREAM)
    b["vllm_ascend/ops/copy_ops.py"] = b.pop(COPY)
    fork = make(tmp_path, monkeypatch, b)
    r = fork.ok("rebase", "--onto", B)
    got = outcomes(fork, r.out)[fork.names[0]]
    assert got == f"applied with 3-way merge (followed upstream's rename {COPY} -> vllm_ascend/ops/copy_ops.py)"
    want = expected_tree(UPSTREAM)
    want["vllm_ascend/ops/copy_ops.py"] = want.pop(COPY)
    assert_tree(fork, want)
    assert "vllm_ascend/ops/copy_ops.py" in series.file_sections(fork.patch(fork.names[0]))


def test_file_renamed_and_changed_upstream_conflicts_at_the_new_path(tmp_path, monkeypatch):
    b = dict(UPSTREAM)
    b["vllm_ascend/ops/copy_ops.py"] = b.pop(COPY).replace(
        "        store(dst[i], data)\n", "        put(dst[i], data)\n"
    )
    fork = make(tmp_path, monkeypatch, b)
    r = fork.cli("rebase", "--onto", B)
    assert r.rc == EXIT_CONFLICT
    assert f"vllm_ascend/ops/copy_ops.py: both modified; renamed upstream from {COPY}" in r.out
