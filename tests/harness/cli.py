"""The command line as a user runs it: a child process."""
import subprocess
import sys


def stepsync(*args, **options):
    """``python -m stepsync ARGS`` in a child process (stdout and stderr captured as text)."""
    options.setdefault("timeout", 120)
    return subprocess.run([sys.executable, "-m", "stepsync", *args], capture_output=True, text=True, **options)
