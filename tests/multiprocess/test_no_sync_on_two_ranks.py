"""Two ranks with torchrun, an accelerate loop through accumulate() on DeepSpeed ZeRO-1, G=3: accelerate 1.8.0 -
1.12.x enter the engine's no_sync(), and DeepSpeed 0.16.2 - 0.18.2 then leave the micro-batches before the last of
each window undivided (scripts/probe_no_sync.py). Each micro-batch's share is read from the parameters (the truth):
stepsync must name the fault on every rank before the first micro-batch exactly where the shares are wrong, and
stop every rank there under raise."""
import os
from importlib.metadata import version

import pytest

from harness.stack import needs_stack
from harness.paths import entry_script

pytestmark = [needs_stack, pytest.mark.integration, pytest.mark.twoproc]
G = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from harness.runs import two_ranks

    script = entry_script("no_sync_ranks.py")
    return two_ranks(script, tmp_path_factory.mktemp("no_sync"))[:2]


def faulty():
    from stepsync.core.weights import weight_faults

    return bool(weight_faults(version("deepspeed"), 1, False, "fp32", G, "accelerate", False, version("accelerate"),
                              2))


def test_the_truth_and_what_stepsync_says_on_every_rank(ranks):
    unwatched, warned = ranks[0]["None"], ranks[0]["warn"]
    assert ranks[0] == ranks[1]  # both ranks saw and said the same
    if unwatched["error"]:  # accelerate <= 1.7 steps the engine inside its no_sync(): DeepSpeed refuses, loudly
        assert not faulty() and warned["error"] == unwatched["error"] and warned["weight_faults"] == []
        return
    if not faulty():
        assert unwatched["shares"] == [1.0] * 2 * G and warned["weight_faults"] == [] and warned["error"] is None
        return
    assert unwatched["shares"] == [3.0, 3.0, 1.0] * 2  # the truth: micro-batches 1 and 2 of each window undivided
    assert warned["shares"] == unwatched["shares"] and warned["error"] is None
    assert len(warned["weight_faults"]) == 1 and "micro-batch(es) [1, 2] of every window of 3" in \
        warned["weight_faults"][0] and "accelerate to 1.13.0" in warned["weight_faults"][0]


def test_raise_stops_every_rank_before_the_first_micro_batch(ranks):
    stopped = ranks[0]["raise"]
    if not faulty():
        assert stopped["error"] == ranks[0]["None"]["error"]  # stepsync stops nothing more
        return
    assert stopped["error"] == "StepSyncConfigError" and stopped["shares"] == [0.0] * 2 * G
