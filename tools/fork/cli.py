"""Command line: `python -m tools.fork VERB [options]`, one module per verb."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from tools.fork import config
from tools.fork.errors import EXIT_CODES_HELP, EXIT_FAILED, ForkError

# verb -> module under tools.fork; each has HELP, add_arguments(parser), run(args, cfg) -> int
VERBS = {
    "apply": "apply",
    "check": "check",
    "export": "export",
    "build": "build",
    "test": "test",
    "rebase": "rebase",
    "deploy": "deploy",
    "pr": "pr",
    "status": "status",
}


def _parser(modules: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fork",
        description="Materialize, check, export, build, test, rebase, deploy and upstream the fork's patch series.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-C", dest="root", type=Path, default=config.REPO_ROOT, help="the fork repository (default: this one)"
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb, module in modules.items():
        p = sub.add_parser(
            verb,
            help=module.HELP.splitlines()[0],
            description=module.HELP,
            epilog=EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    modules = {}
    for verb, name in VERBS.items():
        try:
            modules[verb] = importlib.import_module(f"tools.fork.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tools.fork.{name}":
                raise
    args = _parser(modules).parse_args(argv)
    try:
        cfg = config.load(args.root.resolve())
        return modules[args.verb].run(args, cfg)
    except ForkError as exc:
        print(f"fork {args.verb}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"fork {args.verb}: interrupted", file=sys.stderr)
        return EXIT_FAILED
