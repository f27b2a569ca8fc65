"""Move the series onto another vllm-ascend release: `rebase --onto VERSION`.

VERSION is a release on the package registry (downloaded with pip, sha256-checked against
fork.toml; a version fork.toml does not list yet is trusted on first use and its sha256 recorded
on success), or comes from a local sdist (--sdist PATH) or an upstream checkout (--checkout DIR,
for bases fork.toml already lists).

Each patch is applied with `git am`; if that fails, with `git am -3`. Per patch it reports:
  applied cleanly            plain `git am` (line offsets are named)
  applied with 3-way merge   `git am -3` (an upstream rename it followed is named)
  partially upstream         `git am -3` left out some of the patch's changes: the files named
                             already have them (with patch-id evidence where upstream's own diff
                             over that file is the same change)
  already upstream (dropped) nothing was left to apply; evidence: upstream's own diff between the
                             two releases over the patch's files has the same `git patch-id`, or
                             "applying it changes nothing"
  CONFLICT                   the rebase stops (exit 3) with the patch, files and hunks named and
                             the tree left ready to resolve: edit, `git add`, then
                             `python -m tools.fork rebase --continue` (or `--abort`)
The work lives in build/rebase/ (tree + state.json). patches/, patches/series, fork.toml and the
overlay are rewritten only when the rebase completes, all at once; `--abort`, a failure or an
interruption leave them byte-identical. On success the new pin is VERSION; the old pin stays in
the support matrix (unless --drop-old-base) and every patch whose old-pin version differs from its
new version (`git patch-id --stable`) is kept as the old pin's variant
(patches/bases/<old>/<name>); VERSION's own variants become the main series. Finally it prints
`git range-diff` of the old series against the new one and a per-patch table.
"""

from __future__ import annotations

import os

from tools.fork.core import upstream
from tools.fork.core.config import ForkConfig
from tools.fork.rebase import engine

HELP = __doc__


def add_arguments(p) -> None:
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--onto", metavar="VERSION", help="the release to move the series onto")
    mode.add_argument("--continue", dest="cont", action="store_true", help="resume after resolving a conflict")
    mode.add_argument("--abort", action="store_true", help="discard the rebase in progress (build/rebase)")
    upstream.add_source_arguments(p)
    p.add_argument(
        "--older",
        action="store_true",
        help="allow moving the pin to an older release than the current one (refused without it)",
    )
    p.add_argument(
        "--drop-old-base",
        action="store_true",
        help="remove the old pin from the support matrix (default: keep it, with variants where needed)",
    )
    p.add_argument("--test", action="store_true", help="after success, run the fork's tests on the new pin")
    p.add_argument(
        "--no-test",
        action="store_true",
        default=os.environ.get("FORK_REBASE_NO_TEST") == "1",
        help="do not run the tests before writing (the report then says the rebase is UNTESTED; "
        "default on when FORK_REBASE_NO_TEST=1)",
    )
    p.add_argument(
        "--series-tests-only",
        action="store_true",
        help="before writing, run only the series' own tests, not upstream's CPU suite (the report says so)",
    )
    p.add_argument(
        "--test-python",
        metavar="PY",
        default=os.environ.get("FORK_TEST_PYTHON") or None,
        help="run the tests with this Python (tree on PYTHONPATH, nothing installed) instead of the "
        "release's own test environment (default: $FORK_TEST_PYTHON)",
    )


def run(args, cfg: ForkConfig) -> int:
    with engine.sigterm_as_interrupt():
        if args.abort:
            return engine.abort(cfg)
        if args.cont:
            return engine.resume(cfg, test=args.test, no_test=args.no_test)
        return engine.start(cfg, args)
