import sys

from tools.fork.cli import main

sys.exit(main())
