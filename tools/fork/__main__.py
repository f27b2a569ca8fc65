"""`python -m tools.fork`: runs the command line (tools/fork/cli.py)."""

import sys

from tools.fork.cli import main

sys.exit(main())
