"""Shared by every test: folders say what a test is (unit/, integration/, multiprocess/), and the reliability
cases are counted at the end of every run."""
import os
from collections import Counter

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# Child processes (scripts, torchrun ranks) import the harness as the tests do.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)

# Tests marked reliability("fault"), ("bad_input"), ("differs") or ("resume") are counted by outcome.
KINDS = ("fault", "bad_input", "differs", "resume")
_outcomes: Counter = Counter()
FOLDER_MARKS = {"integration": ("integration",), "multiprocess": ("integration", "twoproc")}


def pytest_configure(config):
    config.addinivalue_line("markers", "reliability(kind): a fault-injection, bad-input, differing-engine or "
                                       "resume case, counted in the summary")


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = os.path.relpath(str(item.fspath), HERE).split(os.sep)[0]
        for mark in FOLDER_MARKS.get(folder, ()):
            item.add_marker(getattr(pytest.mark, mark))


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
