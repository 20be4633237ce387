"""Lightning resumed on another number of ranks, and inside an epoch (torchrun on 127.0.0.1, gloo, DeepSpeed ZeRO-0,
Lightning's own DistributedSampler, a checkpoint after every update): with a dataloader that keeps no place,
Lightning restarts the resumed epoch from the start of its order and runs only the batches its count says are left,
so a resume inside an epoch trains that epoch's first samples twice and never trains its last ones, on any number of
ranks, and a change of ranks shifts even an epoch's end. What stepsync says equals, epoch by epoch, what the samples
every rank trained show; raise stops every rank before the first batch."""
import os

import pytest
from harness.runs import torchrun_phase
from harness.samples import said, skipped_and_repeated
from harness.stack import STACK
from harness.paths import entry_script

pytestmark = pytest.mark.skipif(STACK not in ("", "lightning"), reason="run on the newest Lightning stack")
SCRIPT = entry_script("lightning_resume_runs.py")
SAMPLES, G, EPOCHS = 12, 2, 3


def launch(out, name, world, policy="warn", checkpoint=None):
    pytest.importorskip("lightning")
    return torchrun_phase(SCRIPT, out, name, world, [SAMPLES, G, EPOCHS, policy] + ([checkpoint] if checkpoint else []),
                          timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning-resume")
    return out, {"two": launch(out, "two", 2), "one": launch(out, "one", 1)}  # 3 and 6 updates an epoch


@pytest.mark.parametrize("base, step, world, expected", [
    ("two", 3, 1, ({2: 6}, {})),  # saved at epoch 1's last batch; on 1 rank the count says 6 of 12 batches are done
    ("two", 4, 1, ({2: 2}, {2: 4})),  # inside epoch 2: its first 4 samples again, its last 2 never
    ("two", 4, 2, ({2: 4}, {2: 4})),  # the same ranks, inside an epoch: its first 4 again, its last 4 never
    ("two", 3, 2, ({}, {})),  # the control: the same ranks, at an epoch's end
    ("one", 4, 2, ({}, {1: 8})),  # 8 batches done, more than the 6 an epoch now has: epoch 1 again, whole
    ("one", 8, 2, ({2: 8}, {2: 4})),
])
def test_what_stepsync_says_a_lightning_resume_does_is_what_it_trains(saved, base, step, world, expected):
    out, runs = saved
    resumed = launch(out, f"{base}-{step}-on-{world}", world, checkpoint=str(out / base / f"step={step}.ckpt"))
    assert all(rank["error"] is None for rank in resumed)
    assert skipped_and_repeated(runs[base], resumed, step, SAMPLES, EPOCHS) == expected
    assert all(said(rank) == expected for rank in resumed)  # every rank says the same, counted over all ranks


def test_raise_stops_every_rank_before_the_first_batch(saved):
    out, _ = saved
    stopped = launch(out, "raise", 1, policy="raise", checkpoint=str(out / "two" / "step=4.ckpt"))
    (rank,) = stopped
    assert rank["error"] == "StepSyncConfigError" and rank["trained"] == []
    assert "Lightning restarts epoch 2" in rank["error_message"] and "StatefulDataLoader" in rank["error_message"]
