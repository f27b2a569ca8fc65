"""Run the tests: upstream's CPU unit-test suite on base and fork side by side, then the fork's own checks.

The fork's own checks: its kernel op tests (Triton interpreter), upstream's e2e tests of the
modules the series changes (import-checked and run on base and fork, compared per test id), the
triton-ascend compile check, and the tooling's own tests.

Steps: build/check the test environment (build/testenv, cached); materialize the fork
(build/fork) and the unpatched base (build/base-VERSION) as `apply` does; run `tests/ut` in
each with vllm_ascend installed editable from that tree, leaving out what upstream routes to
NPU runners (.ci/ut-exclusions.txt); compare per test id.

Fails (exit 1) when a test that passes on the base fails, errors, is skipped or is missing
on the fork; when a test the fork adds (a test file under the repository's tests/) fails,
errors or is skipped; when an upstream e2e test of a changed module that passes on the base does
not pass on the fork, or one collected on the base is not collected there; or when the kernel,
compile or tooling tests fail. The base's results
are cached per base sha256 + environment + selection, so a warm run runs the fork only.
"""

from __future__ import annotations

import argparse
import dataclasses

from tools.fork.core import upstream
from tools.fork.testing.session import RunOptions, run_tests

HELP = __doc__


def add_arguments(p) -> None:
    p.add_argument(
        "--base",
        metavar="VERSION",
        help="a base listed in fork.toml or any release on the package registry, pre-releases included "
        "(default: the pin)",
    )
    upstream.add_source_arguments(p)
    p.add_argument(
        "--fork-only", action="store_true", help="skip the base run (compare with cached base results if any)"
    )
    p.add_argument(
        "--as-is",
        action="store_true",
        help="test the materialized fork tree as it is (e.g. with local edits) instead of re-applying the series",
    )
    p.add_argument("--env-only", action="store_true", help="build/check the test environment and stop")
    p.add_argument(
        "--bisect",
        action="store_true",
        help="for each prefix of the series: apply it, run upstream's CPU suite and the kernel op tests it adds",
    )
    p.add_argument(
        "--kernels-only",
        action="store_true",
        help="only the Triton kernel checks: op tests under the interpreter, harness tests, triton-ascend compile, "
        "upstream's e2e tests of the modules the series changes (base vs fork)",
    )
    p.add_argument("--rebuild-env", action="store_true", help="rebuild the test environment from scratch")
    p.add_argument(
        "--no-tooling-tests",
        action="store_true",
        help="leave out the tooling's own tests (they do not depend on the base)",
    )
    p.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k selection for the unit-test suite runs")
    p.add_argument(
        "pytest_args",
        nargs=argparse.REMAINDER,
        metavar="-- PYTEST_ARGS",
        help="extra pytest arguments for the unit-test suite runs (paths under tests/ut replace tests/ut)",
    )


def run(args, cfg) -> int:
    names = {f.name for f in dataclasses.fields(RunOptions)}
    return run_tests(cfg, RunOptions(**{k: v for k, v in vars(args).items() if k in names}))
