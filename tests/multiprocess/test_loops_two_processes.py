"""Custom accelerate loops on two ranks (torchrun): every rank counts, decides and reports the same.

accelerate <= 1.7 runs accumulate() under the engine's no_sync() on several ranks, and DeepSpeed >= 0.16
refuses engine.step() there: such a loop fails upstream, with or without stepsync (the drifting stack shows
it). So two ranks are proven on t446 (accelerate 1.1.1, DeepSpeed 0.15.4: it drifts) and t457f (accelerate
1.8.0: aligned). accelerate 1.16 on a CPU-only machine counts one process under torchrun unless told cpu=True,
which drops DeepSpeed: the aligned stack cannot show two ranks here.
"""
import os

import pytest

from harness.stack import STACK, needs_stack
from harness.paths import entry_script

pytestmark = [needs_stack, pytest.mark.integration, pytest.mark.twoproc]

TWO_RANK_LOOPS = {"t446": (4, 3), "t457f": (4, 4)}  # loop / engine updates: 6 micro-batches per rank, G=4, 2 epochs


def torchrun(tmp_path, *policies):
    from harness.runs import two_ranks

    script = entry_script("twoproc_loops.py")
    return two_ranks(script, tmp_path, *policies, what="two-process loop")[:2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if STACK not in TWO_RANK_LOOPS:
        pytest.skip("two-rank custom loops run on t446 and t457f (see the module's docstring)")
    return torchrun(tmp_path_factory.mktemp("loops"))


def test_both_ranks_take_part_and_agree(ranks):
    for policy in ("warn", "sync", "raise"):
        a, b = ranks[0][policy], ranks[1][policy]
        assert a["world_size"] == b["world_size"] == 2
        for key in ("epoch_ends", "error", "events", "report_counts", "loop_updates_at", "engine_updates_at"):
            assert a[key] == b[key], (policy, key)


def test_every_rank_reports_what_its_loop_saw(ranks):
    loop, engine = TWO_RANK_LOOPS[STACK]
    for rank in ranks:
        warn = rank["warn"]
        assert warn["epoch_ends"] == warn["report_epochs"] == warn["forecast"]
        assert tuple(warn["report_counts"]) == (loop, engine)
        sync = rank["sync"]
        assert sync["error"] is None and sync["engine_updates_at"] == sync["loop_updates_at"]
        assert tuple(sync["report_counts"]) == (loop, loop) and sync["epoch_ends"] == sync["forecast"]


def test_a_loop_resumed_with_load_state_on_two_ranks_continues_its_report(tmp_path):
    """Saved as run_clm_no_trainer.py saves (epoch_0 after the first epoch), resumed with load_state on both ranks:
    every rank's report continues from the record rank 0 wrote, and equals what its loop counted."""
    if STACK not in TWO_RANK_LOOPS:
        pytest.skip("two-rank custom loops run on t446 and t457f (see the module's docstring)")
    ranks = torchrun(tmp_path, "resume-warn", "resume-sync")
    loop, engine = TWO_RANK_LOOPS[STACK]
    for rank in ranks:
        warn, sync = rank["resume-warn"], rank["resume-sync"]
        assert warn["error"] is None and sync["error"] is None
        assert warn["full"] == [loop, engine] and sync["full"] == [loop, loop]
        for run in (warn, sync):
            assert run["report_counts"] == run["truth"] and run["report_epochs"] == [list(e) for e in run["epoch_ends"]]
            assert run["resumed_from"] == list(run["saved"]) and run["forecast_mismatches"] == []
        assert sync["truth"] == [loop, loop] and sync["events"] == []
    assert ranks[0]["resume-warn"] == ranks[1]["resume-warn"] and ranks[0]["resume-sync"] == ranks[1]["resume-sync"]


def test_raise_stops_every_rank_at_the_same_step(ranks):
    drifts = TWO_RANK_LOOPS[STACK][0] != TWO_RANK_LOOPS[STACK][1]
    for rank in ranks:
        assert rank["raise"]["error"] == ("StepDriftError" if drifts else None)


def test_accelerate_17_with_deepspeed_019_cannot_run_a_two_rank_loop_even_without_stepsync(tmp_path):
    if STACK != "drifting":
        pytest.skip("the drifting stack's upstream limit")
    for rank in torchrun(tmp_path, "none"):
        assert rank["none"]["world_size"] == 2
        assert "It is illegal to call Engine.step() inside no_sync context manager" in rank["none"]["error"]
