"""The rebase family: move the series onto another vllm-ascend release, tested before anything is written.

The verb is cmd_rebase (`python -m tools.fork rebase --onto VERSION`). Other families call the engine:

    from tools.fork.rebase.engine import rebase_tested, Outcome, PatchOutcome

    rebase_tested(root: Path, version: str, *, sdist: Path | None = None, checkout: Path | None = None,
                  older: bool = False, drop_old_base: bool = False, series_tests_only: bool = False,
                  test_python: str | None = None) -> Outcome

Outcome: exit_code (0 written; 3 stopped at a conflict or failing tests, build/rebase left for
`rebase --continue` / `--abort`), onto, patches (per patch: name, outcome such as "applied cleanly" /
"already upstream (dropped)" / "conflict resolved", variant used, evidence, applied), sha256 and
first_use (the release's hash, trusted on first use when fork.toml did not have it), conflict (the
patch it stopped at), conflict_files, variants_tried (patch -> every version tried), tests (summary
lines with the counts), test_counts (the same as numbers: "series", "base", "fork" -> outcome -> tests),
test_failures. Any other failure raises ForkError; patches/, fork.toml and the
overlay change only when the rebase is written.

Modules: engine (start, drive, continue, abort), prepare (the rebase tree), apply (one patch and its
outcome), gate (the tests before the write), write (the all-or-nothing write), report, state.
"""
