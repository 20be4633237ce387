"""Loops that drive DeepSpeed's engine themselves (tests/harness/raw_loops.py, after DeepSpeed-Chat's step-1 SFT
loop): `stepsync check --framework deepspeed`, before any training, against what the loop and the engine did."""
import pytest

from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]


@pytest.mark.parametrize("samples, gas, epochs", [(7, 3, 2), (5, 2, 3), (6, 3, 2)])
def test_check_forecasts_a_deepspeed_chat_loop(samples, gas, epochs):
    import json

    from harness.cli import stepsync
    from harness.raw_loops import run_chat_loop

    run = run_chat_loop(samples, gas, epochs)
    proc = stepsync("check", "--framework", "deepspeed", "--micro-batches-per-epoch", str(samples), "--gas", str(gas),
                    "--epochs", str(epochs), "--json")
    forecast = json.loads(proc.stdout)
    # The engine's updates at each epoch's end, the loop's plan and the micro-batches never applied, as they were.
    assert [epoch["engine_steps"] for epoch in forecast["epochs"]] == run.epoch_ends
    assert forecast["trainer_steps"] == forecast["planned_steps"] == run.planned
    assert forecast["engine_steps"] == run.scheduler_steps == len(run.updates)
    assert forecast["unapplied_micro_batches"] == run.unapplied
    assert proc.returncode == (0 if samples % gas == 0 else 1)
    # The engine's windows run across the epoch's end: G micro-batches each, whatever epoch they come from.
    assert all(len(update) == gas for update in run.updates)
    if samples % gas:
        assert forecast["drift"] == run.planned - run.epoch_ends[-1] > 0


def test_watch_given_the_engine_says_it_checks_nothing_and_changes_nothing():
    """Until stepsync watches raw DeepSpeed loops, stepsync.watch(engine) says so (not "the accelerator does not use
    DeepSpeed"), touches nothing, and the run is the same as without it."""
    from harness.raw_loops import run_chat_loop
    from stepsync.core.frameworks import DEEPSPEED_LOOP

    watched, plain = run_chat_loop(7, 3, 2, watched=True), run_chat_loop(7, 3, 2)
    report = watched.watch.report
    assert not report.active and report.framework is DEEPSPEED_LOOP
    assert "does not watch a loop that drives the engine itself yet" in report.inactive_reason
    assert "check --framework deepspeed" in report.inactive_reason
    assert (watched.engine_steps, watched.updates) == (plain.engine_steps, plain.updates)
