"""One test run on one base: upstream's CPU suite on base and fork, then the fork's own checks.

`run_tests(cfg, RunOptions(...))` is what the `test` verb runs, and what `check --test` and
`rebase --test` call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.fork.core import git, series, upstream
from tools.fork.core.errors import EXIT_FAILED, BadInput, LocalEdits
from tools.fork.core.materialize import ApplyFailed, require_tree
from tools.fork.core.series import base_tag
from tools.fork.testing import testenv
from tools.fork.testing.bisect import bisect, materialize_tree
from tools.fork.testing.exclusions import (
    EXCLUSIONS_FILE,
    ignored_paths,
    is_excluded,
    load_exclusions,
    resolve_exclusions,
)
from tools.fork.testing.junit import counts, fmt_counts
from tools.fork.testing.results import (
    compare,
    files_the_base_must_run,
    fork_added_test_files,
    print_comparison,
    print_side_by_side,
    verdict,
)
from tools.fork.testing.steps import KERNEL_TEST_DIR, copy_audit_step, deploy_step, kernel_steps, tooling_step
from tools.fork.testing.suite import (
    UT_DIR,
    SuiteRun,
    base_cache_path,
    collect_ids,
    load_cached,
    load_collected,
    results_dir,
    run_suite,
    store_cached,
    store_collected,
    ut_pytest_args,
    with_targets,
)
from tools.fork.testing.upstream_e2e import upstream_e2e_step


@dataclass
class RunOptions:
    """What to run; the defaults are a plain `python3 -m tools.fork test` on the pin."""

    base: str | None = None  # a release version; None: the pin
    sdist: Path | None = None
    checkout: Path | None = None
    version_unchecked: bool = False
    fork_only: bool = False
    as_is: bool = False
    env_only: bool = False
    bisect: bool = False
    kernels_only: bool = False
    rebuild_env: bool = False
    no_tooling_tests: bool = False
    keyword: str | None = None
    pytest_args: list[str] = field(default_factory=list)


def base_source(cfg, version: str, args=None):
    """(source, Base) of any release: a fork.toml base verified by sha256, another trusted on first use."""
    release = upstream.obtain(
        cfg,
        version,
        sdist=getattr(args, "sdist", None),
        checkout=getattr(args, "checkout", None),
        version_unchecked=getattr(args, "version_unchecked", False),
        listed_only=False,
    )
    print(f"fork test: vllm-ascend {version}: {release.source.verified}", flush=True)
    return release.source, release.base


def base_where_needed(tenv, base_tree: Path, version: str, sha256: str, pytest_args: list[str], fork_run, out: Path):
    """(the base's results in the files the comparison needs, every test id the base collects).

    Both are cached like a whole run (per base, environment and selection): a warm run collects nothing.
    """
    ids_cache = base_cache_path(tenv, version, sha256, ["--collect-only", *pytest_args]).with_suffix(".ids")
    collected = load_collected(ids_cache)
    if collected is None:
        collected = collect_ids(tenv, base_tree, version, pytest_args, out)
        store_collected(collected, ids_cache)
    files = [f for f in files_the_base_must_run(collected, fork_run.results) if (base_tree / f).is_file()]
    if not files:
        print("fork test: [base] nothing to run: the fork has every test the base collects, and passes each")
        return SuiteRun("base", {}, 0.0, files=0), collected
    subset = with_targets(pytest_args, files)
    cache = base_cache_path(tenv, version, sha256, subset)
    run = load_cached(cache)
    if run is not None:
        print(f"fork test: [base] results of {len(files)} file(s) cached ({cache.name})")
    else:
        print(
            f"fork test: [base] {len(files)} file(s) where the fork lacks or does not pass a test: "
            + ", ".join(files[:5])
            + (" ..." if len(files) > 5 else "")
        )
        run = run_suite(tenv, base_tree, version, "base", subset, out)
        run.files = len(files)
        store_cached(run, cache)
    return run, collected


def run_tests(cfg, opts: RunOptions | None = None) -> int:
    """The whole test run on one base (the `test` verb's work); its exit code: 0 ok, 1 failed."""
    args = opts or RunOptions()
    t_start = time.monotonic()
    version = upstream.require_version(args.base, "--base") if args.base else cfg.pin.version
    source, base = base_source(cfg, version, args)
    fork_tree = cfg.default_fork_dir(version)
    base_tree = cfg.default_base_dir(version)

    # a. the environment, derived from the base itself (its compatibility matrix and requirements)
    materialize_tree(version, base_tree, [], source)
    tenv = testenv.ensure(base_tree, version, rebuild=args.rebuild_env, link_dir=cfg.build_dir / "testenv")
    if args.env_only:
        return 0

    # b. the fork tree
    apply_error = None
    if args.as_is:
        if require_tree(fork_tree) != version:
            raise BadInput(f"{fork_tree} is not materialized on {version}")
        print(f"fork test: {fork_tree}: tested as it is (--as-is)")
    else:
        try:
            materialize_tree(version, fork_tree, series.read(cfg, version), source)
        except LocalEdits as exc:
            hint = "Or test the edited tree as it is: `python3 -m tools.fork test --as-is`."
            raise LocalEdits(f"{exc}\n{hint}") from None
        except ApplyFailed as exc:
            if args.kernels_only or args.bisect or args.fork_only:
                raise
            apply_error = exc  # the base's suite still runs (and is cached); the fork's cannot

    def e2e_step(added):  # upstream's e2e tests of the modules the series changes, base vs fork
        return upstream_e2e_step(
            cfg, tenv, version=version, base_sha256=base.sha256, base_tree=base_tree, fork_tree=fork_tree,
            patches=series.read(cfg, version), added=added, fork_only=args.fork_only,
        )  # fmt: skip

    if args.kernels_only:
        added = fork_added_test_files(fork_tree, version)
        steps = kernel_steps(cfg, tenv, fork_tree, added, base_tree, version=version) + [e2e_step(added)]
        for st in steps:
            extra = f" [{fmt_counts(st.counts)}]" if st.counts else ""
            print(f"  {st.name}: {st.status}{extra} {st.detail}")
        failed = [st.name for st in steps if st.failed]
        print("fork test: FAILED: " + ", ".join(failed) if failed else "fork test: OK")
        return EXIT_FAILED if failed else 0

    exclusions = load_exclusions(cfg.root)
    resolved = resolve_exclusions(exclusions, fork_tree if apply_error is None else base_tree)
    ignores = ignored_paths(resolved)
    for ex, paths in resolved:
        if not paths:
            print(f"fork test: note: {EXCLUSIONS_FILE}:{ex.lineno} {ex.pattern} matches nothing in {fork_tree}")
    if args.bisect:
        return bisect(cfg, tenv, base, ignores, source)
    pytest_args = ut_pytest_args(ignores, args.keyword, args.pytest_args or [])
    print(f"fork test: excluding {len(ignores)} path(s) or test(s) ({EXCLUSIONS_FILE})")

    # c. the fork, and the base: its whole run if cached, else where the comparison needs it
    cache = base_cache_path(tenv, version, base.sha256, pytest_args)
    base_run, base_collected = load_cached(cache), None
    if base_run is not None:
        print(f"fork test: [base] results cached ({cache.name}; base, environment and selection unchanged)")
    elif apply_error is not None and not args.fork_only:
        base_run = run_suite(tenv, base_tree, version, "base", pytest_args, results_dir(cfg, version))
        store_cached(base_run, cache)
    if apply_error is not None:
        c = counts(base_run.results)
        print(f"\nfork test: upstream CPU suite on the base {version}: {fmt_counts(c)} ({base_run.seconds:.0f} s)")
        print(
            f"fork test: FAILED: the series does not apply on {version}: {apply_error}\n"
            f"Move it there with `python3 -m tools.fork rebase --onto {version}`."
        )
        print(f"total: {c['passed']} passed, {c['failed'] + c['error']} failed, {c['skipped'] + c['xfailed']} skipped")
        return EXIT_FAILED
    narrowed = pytest_args != ut_pytest_args(ignores, None, [])
    full_cache = base_cache_path(tenv, version, base.sha256, ut_pytest_args(ignores, None, []))
    if base_run is None and args.fork_only and not (narrowed and full_cache.exists()):
        print("fork test: [base] skipped (--fork-only, no cached base results): no base comparison")
    fork_run = run_suite(tenv, fork_tree, version, "fork", pytest_args, results_dir(cfg, version))
    if base_run is None and args.fork_only and narrowed:
        full = load_cached(full_cache)
        if full is not None:
            # The cached full base run, restricted to the tests this narrowed selection ran.
            full.results = {tid: r for tid, r in full.results.items() if tid in fork_run.results}
            base_run = full
            print(f"fork test: [base] cached full base run ({full_cache.name}), restricted to this selection")
    elif base_run is None and not args.fork_only:
        base_run, base_collected = base_where_needed(
            tenv, base_tree, version, base.sha256, pytest_args, fork_run, results_dir(cfg, version)
        )

    # d. compare
    added = fork_added_test_files(fork_tree, version)
    excluded_files = {f for f in added if is_excluded(f, ignores)}
    ut_added = [f for f in added if f.startswith(UT_DIR + "/")]
    if narrowed:
        # a narrowed selection need not include every added file
        ut_added = [f for f in ut_added if any(r.file == f for r in fork_run.results.values())]
    removed = set(git.deleted_paths(fork_tree, base_tag(version), UT_DIR))
    cmp = compare(
        base_run.results if base_run else None, fork_run.results, ut_added, excluded_files, removed, base_collected
    )
    print_side_by_side(base_run, fork_run, version)
    print_comparison(cmp, base_run is not None)

    steps = kernel_steps(cfg, tenv, fork_tree, added, base_tree, version=version)
    steps.append(e2e_step(added))
    steps.append(copy_audit_step(cfg, tenv, base_tree, version))
    # g. the tooling's own tests (they do not depend on the base: `make test` runs them once)
    steps.append(tooling_step(cfg, tenv, args.no_tooling_tests))
    # h. deploy into a pip-installed (non-editable) vllm-ascend, test it there, verify, revert
    if not args.fork_only:
        steps.append(deploy_step(cfg, tenv, version))

    # summary
    cf = counts(fork_run.results)
    problems = verdict(cmp, steps)
    print("\nfork test: summary")
    line = f"fork {fmt_counts(cf)}"
    if base_run:
        where = f" (the {base_run.files} files the comparison needs)" if base_run.files is not None else ""
        line = f"base{where} {fmt_counts(counts(base_run.results))} | " + line
    print(f"  upstream CPU suite: {line}")
    n_kernel = sum(f.startswith(KERNEL_TEST_DIR + "/") for f in added)
    print(f"  fork-added test files: {len(added)} ({len(ut_added)} in {UT_DIR}, {n_kernel} kernel op)")
    for s in steps:
        extra = f" [{fmt_counts(s.counts)}]" if sum(s.counts.values()) else ""  # no junit: no made-up zeros
        print(f"  {s.name}: {s.status}{extra} {s.detail}")
    print(f"  wall time: {time.monotonic() - t_start:.0f} s")
    total = cf.copy()
    for s in steps:
        if s.of_the_fork:
            total.update(s.counts)
    if problems:
        print("fork test: FAILED: " + "; ".join(problems))
    else:
        print("fork test: OK")
    # One closing line in the form CI reads: 'N passed, N failed' (failed counts errors too). Upstream
    # tests that are broken on the base as well are the release's own: named apart, not as the fork's.
    broken_on_base = len(cmp.broken_both)
    failed_total = total["failed"] + total["error"] - broken_on_base
    upstream_own = f" ({broken_on_base} broken on the base {version} too)" if broken_on_base else ""
    print(
        f"total: {total['passed']} passed, {failed_total} failed, {total['skipped'] + total['xfailed']} skipped"
        + upstream_own
    )
    return EXIT_FAILED if problems else 0
