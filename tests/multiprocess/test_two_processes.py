"""Two ranks with torchrun: same decisions on every rank at the same step, output once, no hang."""
import os

import pytest

from harness.stack import DRIFTS, needs_stack
from harness.paths import entry_script

pytestmark = [
    needs_stack, pytest.mark.integration, pytest.mark.twoproc,
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from harness.runs import two_ranks

    script = entry_script("twoproc_runs.py")
    *ranks, output = two_ranks(script, tmp_path_factory.mktemp("ranks"))
    return ranks, output


def test_every_rank_sees_and_decides_the_same(two_ranks):
    ranks, _ = two_ranks
    for case in ranks[0]:
        a, b = ranks[0][case], ranks[1][case]
        assert (a["trainer_steps"], a["engine_steps"], a["error"]) == (b["trainer_steps"], b["engine_steps"], b["error"])
        assert a["report"]["events"] == b["report"]["events"]
        assert a["engine_updates_at"] == b["engine_updates_at"]


@pytest.mark.parametrize("case", ["warn-0", "warn-2"])
def test_warn_counts(two_ranks, case):
    result = two_ranks[0][0][case]
    # 6 micro-batches per rank, G=4, 2 epochs: the Trainer counts 2 per epoch, the engine 12 // 4.
    assert (result["trainer_steps"], result["engine_steps"]) == ((4, 3) if DRIFTS else (4, 4))
    assert [(r["trainer_steps"], r["engine_steps"]) for r in result["forecast"]["epochs"]] == \
        [tuple(x) for x in result["epoch_ends"]]


@pytest.mark.parametrize("case", ["sync-0", "sync-2", "realign-0", "drop_last-0"])
def test_remedies_agree(two_ranks, case):
    result = two_ranks[0][0][case]
    expected = {"sync": 4, "realign": 3 if DRIFTS else 4, "drop_last": 2}[case.split("-")[0]]
    assert result["error"] is None
    assert (result["trainer_steps"], result["engine_steps"]) == (expected, expected)
    if case.startswith("sync"):
        assert result["engine_updates_at"] == result["trainer_updates_at"]


def test_raise_stops_every_rank(two_ranks):
    ranks, _ = two_ranks
    for rank in ranks:
        result = rank["raise-0"]
        assert result["error"] == ("StepDriftError" if DRIFTS else None)
        assert result["trainer_steps"] == (0 if DRIFTS else 4)  # stopped before the first micro-batch, as forecast


def test_output_appears_once(two_ranks):
    _, output = two_ranks
    assert output.count("stepsync summary") == (6 if DRIFTS else 7)  # a raised run ends before its summary
    # the two warn runs' drift (raise stops at the forecast, before any micro-batch drifts)
    assert output.count("step drift +1 at epoch 1, micro-batch 6") == (2 if DRIFTS else 0)


def test_realign_train_loss_is_the_mean_over_the_updates_the_engine_applied_on_two_ranks(two_ranks):
    """Each rank's losses as the recorder saw them: those up to the engine's last update were applied; the
    train_loss is their sum, the mean over ranks (as the Trainer gathers it), over the engine's updates."""
    ranks, _ = two_ranks
    sums, updates = [], None
    for rank in ranks:
        run = rank["realign-0"]
        counts = [0] + [engine for _, engine in run["losses"]]
        last = max(i for i in range(1, len(counts)) if counts[i] != counts[i - 1])
        sums.append(sum(loss for loss, _ in run["losses"][:last]))
        updates = counts[-1]
    truth = sum(sums) / len(sums) / updates
    for rank in ranks:
        assert rank["realign-0"]["train_loss"] == pytest.approx(truth, rel=1e-6, abs=1e-6)
