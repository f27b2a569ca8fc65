"""Errors and exit codes of the fork tooling.

Every verb exits with one of these codes; `--help` and CONTRIBUTING.md list them.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # a check or a test run found problems; an operation failed or was interrupted
EXIT_BAD_INPUT = 2  # bad arguments, unknown version, missing or malformed file
EXIT_CONFLICT = 3  # a rebase stopped at a conflict; resolve, then --continue or --abort
EXIT_IN_PROGRESS = 4  # a rebase in progress or an export cut short, or another run holds the lock
EXIT_UPSTREAM = 5  # the base could not be obtained or verified (registry, hash)
EXIT_LOCAL_EDITS = 6  # the operation would overwrite local edits
EXIT_TOOLS_ENV = 7  # this Python lacks a package of the tools environment (tools/requirements.txt)

EXIT_CODES_HELP = """\
exit codes:
  0  done
  1  a check or test run found problems (each is listed), or the operation failed or was
     interrupted (the message names the cause and what was left as it was)
  2  bad input: arguments, unknown version, missing or malformed file
  3  rebase stopped at a conflict: resolve it, then `rebase --continue` or `--abort`
  4  a rebase is already in progress: `rebase --continue` or `rebase --abort` first; or another
     run of the tool is changing the same repository or deploy target (the lock and its pid named);
     or an export was cut short: `export` finishes it before `apply` or `rebase` run
  5  the upstream base could not be obtained or verified (registry, sha256)
  6  refused: the operation would overwrite local edits
  7  this Python lacks a package the verb needs (setuptools-scm, wheel, pytest, uv): use
     build/tools-venv/bin/python (made by `make`), or pip install -r tools/requirements.txt
"""


class ForkError(Exception):
    """An error the CLI reports as one clear message and an exit code."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class BadInput(ForkError):
    exit_code = EXIT_BAD_INPUT


class UpstreamUnavailable(ForkError):
    exit_code = EXIT_UPSTREAM


class LocalEdits(ForkError):
    exit_code = EXIT_LOCAL_EDITS

    @classmethod
    def revert_refused(cls, what: str, problems: list[str], forced: str) -> LocalEdits:
        """A revert that would discard later work: each problem on its own line, and what --force does."""
        listed = "\n  - ".join(problems)
        return cls(f"{what}:\n  - {listed}\nNothing was changed. Pass --force to {forced} anyway.")


class InProgress(ForkError):
    exit_code = EXIT_IN_PROGRESS
