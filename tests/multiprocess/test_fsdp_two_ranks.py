"""FSDP2 (fully_shard) loops on two ranks (torchrun, gloo): where the gradient sync is on decides which micro-batches
each update holds. The truth is read from the weights by the loop itself (tests/harness/fsdp_loops.py: one weight per
sample, each update's samples and shares), the loop's meaning is its windows of G (every G-th micro-batch of an epoch
and its last); stepsync's report must equal what the weights show, the same on both ranks."""
import pytest

from harness.paths import entry_script
from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration, pytest.mark.twoproc]

PER_RANK, G, EPOCHS, WORLD = 5, 2, 2, 2
WINDOWS = [[0, 1], [2, 3], [4]] * EPOCHS  # each update's micro-batches, as the loop means them


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from harness.runs import two_ranks

    return two_ranks(entry_script("fsdp_ranks.py"), tmp_path_factory.mktemp("fsdp"), what="two-rank FSDP2 loop")[:2]


def held_by_the_weights(updates):
    """(the window's micro-batches each update holds, micro-batches of other windows it holds), from its samples."""
    found = []
    for window, update in zip(WINDOWS, updates):
        micro_batches = {sample // WORLD for sample, _ in update}
        found.append((len(micro_batches & set(window)), len(micro_batches - set(window))))
    return found


def test_both_ranks_see_the_same_and_every_sample_moves_whole(ranks):
    first, second = ranks
    assert first.keys() == second.keys() and all(first[run]["world_size"] == 2 for run in first)
    for run in first:
        for key in ("updates", "error", "counts", "unsynced", "unsynced_total", "epochs", "forecast"):
            assert first[run][key] == second[run][key], (run, key)
        assert all(share == 1.0 for update in first[run]["updates"] for _, share in update)


def test_a_right_loop_is_left_alone_and_said_right(ranks):
    plain = ranks[0]["last-none"]["updates"]
    assert held_by_the_weights(plain) == [(len(window), 0) for window in WINDOWS]
    for policy in ("warn", "raise", "sync"):
        run = ranks[0][f"last-{policy}"]
        assert run["updates"] == plain and run["error"] is None
        assert run["unsynced"] == [] and run["counts"] == [6, 6] and run["epochs"] == run["forecast"] == [[3, 3],
                                                                                                         [6, 6]]


@pytest.mark.parametrize("sync_at", ["never", "first"])
def test_warn_names_every_update_that_does_not_hold_its_window_as_the_weights_show(ranks, sync_at):
    plain, warned = ranks[0][f"{sync_at}-none"], ranks[0][f"{sync_at}-warn"]
    assert warned["updates"] == plain["updates"]  # warn changes nothing
    truth = held_by_the_weights(plain["updates"])
    if sync_at == "never":
        assert truth == [(0, 0)] * 6  # every update applied nothing
    else:
        assert truth == [(1, 0), (1, 1), (1, 1), (1, 0), (1, 1), (1, 1)]
    said = [(update, window, held, earlier) for update, window, held, earlier in warned["unsynced"]]
    assert said == [(k + 1, len(window), held, earlier) for k, (window, (held, earlier)) in
                    enumerate(zip(WINDOWS, truth))]
    assert warned["unsynced_total"] == 6 and sum("later updates like it are counted" in n for n in warned["notes"]) == 1
    assert "gradient sync: 6 update(s) did not hold their window; first update 1 at epoch 1, micro-batch 2" in \
        warned["summary"]


@pytest.mark.parametrize("sync_at", ["never", "first"])
def test_raise_stops_before_the_first_such_update_applies_anything(ranks, sync_at):
    stopped = ranks[0][f"{sync_at}-raise"]
    assert stopped["error"].startswith("GradientSyncError: update 1 at epoch 1, micro-batch 2")
    assert stopped["updates"] == [] and stopped["counts"] == [0, 0]  # the optimizer never stepped


@pytest.mark.parametrize("sync_at", ["never", "first"])
def test_sync_makes_every_update_hold_its_window_exactly(ranks, sync_at):
    synced = ranks[0][f"{sync_at}-sync"]
    assert synced["updates"] == ranks[0]["last-none"]["updates"]  # the loop as meant, weight for weight
    assert synced["unsynced"] == [] and synced["error"] is None and synced["counts"] == [6, 6]
