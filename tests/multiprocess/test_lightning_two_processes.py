"""Lightning + DeepSpeed on two ranks (torchrun, gloo): every rank decides the same at the same batch; raise stops
both; sync keeps both counts and the scheduler equal on both, at 1/G per micro-batch. A rank left waiting fails
the test instead of hanging CI."""
import os

import pytest

pytest.importorskip("lightning")

from harness.runs import two_ranks  # noqa: E402
from harness.paths import entry_script


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    script = entry_script("lightning_ranks.py")
    return two_ranks(script, tmp_path_factory.mktemp("lightning-ranks"), what="two-process Lightning run")[:2]


def test_every_rank_sees_and_decides_the_same(ranks):
    first, second = ranks
    assert first == second


def test_raise_stops_both_ranks_at_the_same_batch(ranks):
    for rank in ranks:
        case = rank["raise-0"]
        assert case["error"] == "StepDriftError"
        # the forecast's first drift (the engine ahead at epoch 2's end), before the first batch
        assert (case["event"]["epoch"], case["event"]["micro_batch"], case["event"]["where"]) == (2, 3, "forecast")
        assert case["batches"] == []


@pytest.mark.parametrize("case", ["sync-0", "sync-2"])
def test_sync_keeps_both_counts_and_the_scheduler_equal_on_both_ranks(ranks, case):
    for rank in ranks:
        run = rank[case]
        assert run["error"] is None and run["counts"] == [2, 2] and run["epochs"] == run["recorded"] == [[1, 1], [2, 2]]
        assert all(batch[3] == batch[4] == batch[5] for batch in run["batches"])
        # Both ranks trained the same samples: the all-reduce averages them, each micro-batch at 1/G.
        assert [w for update in run["updates"] for w in update.values()] == [0.5] * 4
        assert run["dropped"] == {"1": 1, "2": 1}


def test_warn_reports_the_engine_ahead_on_both_ranks(ranks):
    for rank in ranks:
        run = rank["warn-0"]
        assert run["error"] is None and run["counts"] == [2, 3] and run["epochs"] == run["recorded"]
