import os
import sys
from collections import Counter

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Reliability cases: tests marked reliability("fault"), ("bad_input"), ("differs") or ("resume")
# are counted by outcome, and the count is printed at the end of every run.
KINDS = ("fault", "bad_input", "differs", "resume")
_outcomes: Counter = Counter()


def pytest_configure(config):
    config.addinivalue_line("markers", "reliability(kind): a fault-injection, bad-input, differing-engine or "
                                       "resume case, counted in the summary")


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
