"""Where the repository's files are, for tests in any folder."""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
ENTRY = os.path.join(TESTS, "entry")  # the scripts tests run as child processes (python, torchrun, Ray workers)


def entry_script(name: str) -> str:
    """The path of one of the scripts in tests/entry/."""
    return os.path.join(ENTRY, name)
