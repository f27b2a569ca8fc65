"""`python -m tools.fork` in the repository, or `python3 DIR/tools/fork` from anywhere: runs tools/fork/cli.py."""

import os
import sys

if not __package__:
    # Run as a path (`python3 DIR/tools/fork VERB`): Python put DIR/tools/fork first on sys.path, where
    # the family packages would shadow top-level modules; import the tooling from DIR instead.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.fork.cli import main  # noqa: E402 - after the path fix above

sys.exit(main())
