"""`test --bisect`: each prefix of the series applies, keeps upstream's CPU suite and passes the tests it adds."""

from __future__ import annotations

from pathlib import Path

from tools.fork.core import git, series
from tools.fork.core.errors import EXIT_FAILED
from tools.fork.core.materialize import materialize
from tools.fork.core.series import base_tag
from tools.fork.testing import suite, testenv
from tools.fork.testing.junit import counts, fmt_counts, is_test_file
from tools.fork.testing.results import compare
from tools.fork.testing.steps import KERNEL_TEST_DIR, kernel_op_step


def materialize_tree(version: str, tree: Path, patches, source) -> None:
    """Materialize `tree` as `apply` does (the base + `patches`) and say so."""
    outcome = materialize(tree.resolve(), lambda: source, version, patches)
    print(f"fork test: {tree}: vllm-ascend {version} + {len(patches)} patch(es): {outcome}")


def bisect(cfg, tenv: testenv.TestEnv, base, ignores: list[str], source) -> int:
    """Bisectability: each prefix of the series applies, and upstream's CPU suite on it loses no
    test that passes on the base while every test file the prefix adds passes (~1 min a prefix)."""
    version = base.version
    patches = series.read(cfg, version)
    pytest_args = suite.ut_pytest_args(ignores, None, [])
    out = suite.results_dir(cfg, version)
    cache = suite.base_cache_path(tenv, version, base.sha256, pytest_args)
    base_run = suite.load_cached(cache)
    if base_run is None:
        materialize_tree(version, cfg.default_base_dir(version), [], source)
        base_run = suite.run_suite(tenv, cfg.default_base_dir(version), version, "base", pytest_args, out)
        suite.store_cached(base_run, cache)
    failed = []
    for k in range(1, len(patches) + 1):
        tree = (cfg.build_dir / "bisect" / f"prefix-{k}").resolve()
        print(f"\nfork test: --bisect prefix {k}/{len(patches)}: {patches[k - 1].name}")
        materialize(tree, lambda: source, version, patches[:k], force=True)
        added = [f for f in git.added_paths(tree, base_tag(version), "tests") if is_test_file(f)]
        run = suite.run_suite(tenv, tree, version, f"prefix-{k}", pytest_args, out)
        removed = set(git.deleted_paths(tree, base_tag(version), suite.UT_DIR))
        ut_added = [f for f in added if f.startswith(suite.UT_DIR + "/")]
        cmp = compare(base_run.results, run.results, ut_added, removed_files=removed)
        ok = cmp.ok
        print(
            f"fork test: prefix {k}: suite {fmt_counts(counts(run.results))}; {len(cmp.regressions)} regressed, "
            f"{len(cmp.lost)} lost, {len(cmp.fork_added_bad)} added test(s) not passing"
        )
        ops = [f for f in added if f.startswith(KERNEL_TEST_DIR + "/")]
        if ops:
            junit = out / f"prefix-{k}-kernel.xml"
            step = kernel_op_step(f"prefix {k} kernel op tests", tenv, cfg.root, tree, ops, junit)
            print(f"fork test: prefix {k}: kernel op tests {step.status} [{fmt_counts(step.counts)}]")
            ok = ok and not step.failed
        if not ok:
            failed.append(patches[k - 1].name)
    print("fork test: --bisect: " + ("every prefix passes" if not failed else f"FAILED at: {', '.join(failed)}"))
    return EXIT_FAILED if failed else 0
