"""The support table: docs/releases.md equals the stored measurements, and this stack's real runs equal its stored file.

Runs on every stack; on the older ones it is part of the focused set (scripts/test.sh).
"""
import os

import pytest

from harness.stack import STACK, needs_stack
from harness import matrix as support
from harness.paths import REPO, TESTS

STORE = os.path.join(TESTS, "support")
RELEASES = os.path.join(REPO, "docs", "releases.md")

# Per stack, the drift of the first (measured) case without stepsync: sign and causes.
EXPECTED_DRIFT = {
    "aligned": (0, []),
    "drifting": (1, ["PARTIAL_WINDOW"]),
    "t447": (1, ["PARTIAL_WINDOW"]),
    "t445": (1, ["TINY_EPOCH"]),
    "t424": (-1, ["ENGINE_AHEAD"]),
    "t427": (1, ["TINY_EPOCH"]),
    "t439": (1, ["TINY_EPOCH"]),
    "t446": (0, []),
    "t451": (1, ["PARTIAL_WINDOW"]),
    "t452": (1, ["PARTIAL_WINDOW"]),
    "t457": (1, ["PARTIAL_WINDOW"]),
    "t457f": (0, []),
    "t500": (1, ["PARTIAL_WINDOW"]),
    "d183": (0, []),
    "d189": (0, []),
    "a18": (0, []),
}


def test_the_docs_table_equals_the_stored_runs():
    stored = support.load(STORE)
    assert sorted(stored) == sorted(s.name for s in support.STACKS), "run scripts/support_table.sh"
    with open(RELEASES) as handle:
        assert support.table_in(handle.read()) == support.render_table(stored), "run scripts/support_table.sh"


def test_stored_runs_keep_every_contract():
    for name, data in support.load(STORE).items():
        check_contract(name, data)


def check_contract(name, data):
    for number, entry in enumerate(data["cases"]):
        for policy, result in entry["results"].items():
            where = f"{name} {support.Case(**entry['case']).label()} {policy}"
            if result["error"]:
                # A policy that cannot work says so before any micro-batch runs.
                assert policy != "none" and result["epoch_ends"] == [] and result["trainer_steps"] == 0, where
                assert result["error"].startswith("StepSyncConfigError"), where
                continue
            assert result["forecast_epoch_ends"] == result["epoch_ends"], where
            drift = result["trainer_steps"] - result["engine_steps"]
            if policy != "none":
                assert drift == 0 and all(t == e for t, e in result["epoch_ends"]), where
            elif number == 0:
                sign, causes = EXPECTED_DRIFT[name]
                assert (drift > 0) - (drift < 0) == sign and list(dict.fromkeys(result["causes"])) == causes, where


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    if STACK not in EXPECTED_DRIFT:
        pytest.skip("STEPSYNC_STACK names no stack of the support table (scripts/test.sh sets it)")
    return support.measure(support.spec(STACK), str(tmp_path_factory.mktemp("support")))


@needs_stack
@pytest.mark.integration
def test_this_stack_reproduces_its_stored_runs(fresh):
    stored = support.load(STORE)[STACK]
    assert support.disagreements(stored, fresh) == []
    check_contract(STACK, fresh)
