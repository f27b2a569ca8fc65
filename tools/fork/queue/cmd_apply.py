"""Materialize the fork: the base release as a git repository, then the series with `git am`.

The base is one commit "upstream <version>", tagged v<version>; each patch is one
commit on branch `fork`. Running it again changes nothing when nothing changed;
it refuses to discard edits made in the tree (export them first, or --force).
"""

from __future__ import annotations

from pathlib import Path

from tools.fork.core import series, upstream
from tools.fork.core.materialize import materialize
from tools.fork.core.outputs import output_dir

HELP = __doc__


def add_arguments(p) -> None:
    p.add_argument("--base", metavar="VERSION", help="a base listed in fork.toml (default: the pin)")
    p.add_argument("--into", metavar="DIR", type=Path, help="where to materialize (default: build/fork[-VERSION])")
    p.add_argument(
        "--base-only", action="store_true", help="materialize the unpatched base (default DIR build/base-VERSION)"
    )
    upstream.add_source_arguments(p)
    p.add_argument("--force", action="store_true", help="discard local edits in DIR")


def run(args, cfg) -> int:
    upstream.check_named_sdist(args.sdist)
    if args.into is not None:
        output_dir(args.into, "--into")
    base = cfg.base(None if args.base is None else upstream.require_version(args.base, "--base"))
    if args.base_only:
        patches = []
        tree = args.into or cfg.default_base_dir(base.version)
    else:
        patches = series.read(cfg, base.version)
        tree = args.into or cfg.default_fork_dir(base.version)
    sources = []

    def source():
        if not sources:
            sources.append(
                upstream.obtain(
                    cfg,
                    base.version,
                    sdist=args.sdist,
                    checkout=args.checkout,
                    version_unchecked=args.version_unchecked,
                ).source
            )
        return sources[-1]

    if args.sdist is not None or args.checkout is not None:
        source()  # verify it now (sha256, or the checkout's version), used or not
    outcome = materialize(tree.resolve(), source, base.version, patches, force=args.force, repo=cfg.root)
    verified = f" ({sources[0].verified})" if sources else ""
    print(f"fork apply: {tree}: vllm-ascend {base.version}{verified} + {len(patches)} patch(es): {outcome}")
    return 0
