"""Shared by every test: folders say what a test is (unit/, integration/, multiprocess/), and the reliability
cases are counted at the end of every run."""
import importlib.util
import os
from collections import Counter

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Child processes (scripts, torchrun ranks, the command line) import the harness and this stepsync as the tests do,
# installed or not (the fast loop's environment has only rich, packaging, pytest and hypothesis).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, ROOT, os.environ.get("PYTHONPATH")) if p)

# Tests marked reliability("fault"), ("bad_input"), ("differs") or ("resume") are counted by outcome.
KINDS = ("fault", "bad_input", "differs", "resume")
_outcomes: Counter = Counter()
FOLDER_MARKS = {"integration": ("integration",), "multiprocess": ("integration", "twoproc")}


def _installed() -> bool:
    """pip installed stepsync into this environment: its console script sits beside this python."""
    import shutil
    import sys

    return shutil.which("stepsync", path=os.path.dirname(sys.executable)) is not None


def pytest_configure(config):
    config.addinivalue_line("markers", "reliability(kind): a fault-injection, bad-input, differing-engine or "
                                       "resume case, counted in the summary")
    config.addinivalue_line("markers", "torch: needs torch; skipped where it is not installed (the fast loop)")
    config.addinivalue_line("markers", "installed: needs stepsync installed in this environment (its console "
                                       "script, its metadata); skipped where it is not (the fast loop)")


def pytest_collection_modifyitems(config, items):
    missing = {"torch": importlib.util.find_spec("torch") is None, "installed": not _installed()}
    for item in items:
        folder = os.path.relpath(str(item.fspath), HERE).split(os.sep)[0]
        for mark in FOLDER_MARKS.get(folder, ()):
            item.add_marker(getattr(pytest.mark, mark))
        for mark, absent in missing.items():
            if absent and item.get_closest_marker(mark) is not None:
                item.add_marker(pytest.mark.skip(reason=f"{mark}: not in this environment"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    marker = item.get_closest_marker("reliability")
    report = outcome.get_result()
    # One count per test: its call, or its setup when that already failed or skipped.
    if marker is not None and (report.when == "call" or report.when == "setup" and report.outcome != "passed"):
        _outcomes[(marker.args[0], report.outcome)] += 1


def pytest_terminal_summary(terminalreporter):
    if not _outcomes:
        return
    parts = []
    for kind in KINDS:
        counts = {o: n for (k, o), n in _outcomes.items() if k == kind}
        if counts:
            detail = ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
            parts.append(f"{kind} {sum(counts.values())} ({detail})")
    total = sum(_outcomes.values())
    terminalreporter.write_line(f"stepsync reliability cases: {total} exercised: " + "; ".join(parts))
