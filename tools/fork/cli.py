"""Command line: `python -m tools.fork VERB [options]`, one module per verb.

Runs with a plain `python3` (3.10-3.12) and git: no verb module imports a package outside the
standard library at module level. What needs the tools environment (setuptools-scm, wheel,
pytest: build/tools-venv, made by `make`) says so in one line and exits with EXIT_TOOLS_ENV.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path

from tools.fork.core import journal, lock
from tools.fork.core.errors import EXIT_BAD_INPUT, EXIT_CODES_HELP, EXIT_FAILED, EXIT_TOOLS_ENV, ForkError

# verb -> (module under tools.fork, one-sentence summary for `--help`);
# each module has HELP, add_arguments(parser), run(args, cfg) -> int
VERBS = {
    "apply": ("queue.cmd_apply", "Materialize the fork in build/fork: the base release, then the series with git am."),
    "check": (
        "queue.cmd_check",
        "Check that the series applies exactly, matches the overlay and follows the conventions.",
    ),
    "export": ("queue.cmd_export", "Write patches/, patches/series and the overlay from build/fork."),
    "build": ("queue.cmd_build", "Build the fork's vllm-ascend wheel into dist/."),
    "test": (
        "testing.cmd_test",
        "Run upstream's CPU suite on base and fork, the kernel checks and the tooling's tests.",
    ),
    "rebase": ("rebase.cmd_rebase", "Move the series onto another vllm-ascend release."),
    "follow": (
        "follow.cmd_follow",
        "Move the series onto the newest vllm-ascend release, tested, as branch follow/VERSION.",
    ),
    "deploy": (
        "deploy.cmd_deploy",
        "Deploy the fork into an installed vllm-ascend or a checkout, verify it, revert it.",
    ),
    "pr": ("queue.cmd_pr", "Print a patch of the series as an upstream pull request."),
    "npu-report": (
        "npu.cmd_npu_report",
        "Run the NPU evidence (op tests, race stress with controls, copy-path speed) into one report folder.",
    ),
    "status": ("queue.cmd_status", "Summarize the pin, the series, build/fork and the wheel."),
}

# Verbs that write the repository's protected files or build/fork: one at a time per repository
# (`deploy` locks its target instead: tools/fork/deploy/cmd_deploy.py).
REPO_WRITERS = {"apply", "export", "rebase"}
REPO_LOCK = ".fork.lock"  # in build/, the tool's own output folder

# Importable only in the tools environment (tools/requirements.txt); tomli: Python 3.10's TOML reader.
TOOLS_ENV_MODULES = {"setuptools", "setuptools_scm", "wheel", "pytest", "tomli", "_pytest", "filelock", "uv"}
TOOLS_ENV_HINT = (
    "run `make build/tools-venv/.stamp` and use build/tools-venv/bin/python -m tools.fork "
    "(or pip install -r tools/requirements.txt into this Python)"
)


class _Parser(argparse.ArgumentParser):
    def exit(self, status=0, message=None):  # argparse's usage errors: our documented code for bad input
        if message:
            self._print_message(message, sys.stderr)
        sys.exit(EXIT_BAD_INPUT if status == 2 else status)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = _Parser(
        prog="python3 -m tools.fork",
        description="Materialize, check, export, build, test, rebase, deploy and upstream the fork's patch series.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-C",
        dest="root",
        type=Path,
        default=None,
        help="the fork repository (default: the one holding this tooling); from outside it, run the tooling "
        "by path: `python3 DIR/tools/fork VERB`",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True, parser_class=_Parser)
    subparsers = {}
    for verb, (name, summary) in VERBS.items():
        module = importlib.import_module(f"tools.fork.{name}")
        p = sub.add_parser(
            verb,
            help=summary,
            description=module.HELP,
            epilog=EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        subparsers[verb] = p
    return parser, subparsers


def tools_env_missing(exc: ModuleNotFoundError) -> str | None:
    """The one-line message for a module only the tools environment has, else None."""
    top = (exc.name or "").split(".")[0]
    if top not in TOOLS_ENV_MODULES:
        return None
    return f"this needs the Python package {top!r}, which {sys.executable} lacks: {TOOLS_ENV_HINT}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if a in VERBS), "?")  # for messages raised while parsing
    try:
        parser, subparsers = _parser()
        args, extra = parser.parse_known_args(argv)
        verb = args.verb
        if extra:  # unknown options on a verb: that verb's usage, not the top level's
            subparsers[verb].error(f"unrecognized arguments: {' '.join(extra)}")
        from tools.fork.core import config

        root = args.root if args.root is not None else config.REPO_ROOT
        cfg = config.load(root.resolve())
        module = importlib.import_module(f"tools.fork.{VERBS[verb][0]}")
        if verb not in REPO_WRITERS:
            return module.run(args, cfg)
        with lock.exclusive(cfg.build_dir / REPO_LOCK, f"the repository {cfg.root}"):
            if verb != "export":  # export finishes what a killed export left; the others refuse
                journal.require_no_export_cut_short(cfg.build_dir)
            return module.run(args, cfg)
    except ForkError as exc:
        print(f"fork {verb}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        message = tools_env_missing(exc)
        if message is None:
            raise
        print(f"fork {verb}: error: {message}", file=sys.stderr)
        return EXIT_TOOLS_ENV
    except OSError as exc:  # e.g. a read-only site-packages: the cause in one line, not a traceback
        where = f": {shlex.quote(str(exc.filename))}" if exc.filename else ""
        print(f"fork {verb}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"fork {verb}: interrupted", file=sys.stderr)
        return EXIT_FAILED
