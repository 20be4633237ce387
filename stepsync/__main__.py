"""``python -m stepsync``: the command line (a missing dependency is a message and exit 2, see cli.main)."""
import sys

from .tools.cli import main

sys.exit(main())
