"""Two ranks with torchrun, the real Trainer and DeepSpeed (tests/entry/apart_ranks.py): rank 1's weights moved after
update 1 (a fault on one rank) against an independent recorder that gathers every rank's weights at the end. stepsync
must find the ranks apart exactly where it next compares them (the epoch's end, or the checkpoint saved after that
update), say that they agreed at train begin, stop both ranks together there under raise, and say nothing where no rank
was touched (ZeRO-0, and ZeRO-1 with a checkpoint after every update)."""
import pytest

from harness.paths import entry_script
from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration, pytest.mark.twoproc]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from harness.runs import two_ranks

    return two_ranks(entry_script("apart_ranks.py"), tmp_path_factory.mktemp("apart"))[:2]


def test_both_ranks_see_the_same(ranks):
    assert ranks[0] == ranks[1]


@pytest.mark.parametrize("case", ["untouched-z0", "untouched-z1"])
def test_nothing_is_said_where_every_rank_holds_the_same_weights(ranks, case):
    run = dict(ranks[0][case])
    del run["readers"]
    assert run == {"differ": False, "apart": None, "error": None, "engine_steps": 4}


def test_on_two_ranks_stepsync_reads_tensors_in_its_bounded_readers_only(ranks):
    """The weights' fingerprint is compared across ranks (it reads the weights and waits for the device): one of
    the readers docs/performance.md names; nothing else of stepsync touched a tensor (harness/touches.py)."""
    for run in ranks[0].values():
        assert [reader for reader in run["readers"] if reader.startswith("outside")] == []
        assert "engine/deepspeed.py:WeightFingerprint" in run["readers"]


@pytest.mark.parametrize("case, found", [
    # (epoch, micro-batch, update, agreed at, where, ranks): moved after update 1, compared at epoch 1's end
    ("moved-z0", [1, 4, 2, 0, "epoch end", 2]),
    # with a checkpoint after every update: found at the one saved right after update 1
    ("moved-z0-saved", [1, 2, 1, 0, "checkpoint", 2]),
])
def test_a_rank_moved_apart_is_found_at_the_next_comparison(ranks, case, found):
    run = ranks[0][case]
    assert run["differ"] is True  # the truth: the copies differ
    assert run["apart"] == found and run["error"] is None and run["engine_steps"] == 4


def test_raise_stops_every_rank_where_they_are_found_apart(ranks):
    run = ranks[0]["moved-z0-raise"]
    assert run["differ"] is True and run["apart"] == [1, 4, 2, 0, "epoch end", 2]
    assert run["error"] == "RanksApartError" and run["engine_steps"] == 2
