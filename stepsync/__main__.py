"""``python -m stepsync``: the command line; a missing dependency is a message and exit 2, never a traceback."""
import sys

from .core.install import install_hint

try:
    from .tools.cli import main
except ImportError as exc:  # run without installing stepsync's own requirements
    print(f"stepsync: error: a package stepsync needs is missing ({exc}): {install_hint()}", file=sys.stderr)
    sys.exit(2)

sys.exit(main())
