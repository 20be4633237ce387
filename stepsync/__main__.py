"""``python -m stepsync``: the command line, with a clear message when stepsync is not installed."""
import sys

try:
    from .cli import main
except ImportError as exc:  # run from a clone without `pip install .`: rich or packaging is missing
    print(f"stepsync: error: a package stepsync needs is missing ({exc}): install stepsync first, "
          "pip install . (the command line), or see README.md for the callback", file=sys.stderr)
    sys.exit(2)

sys.exit(main())
