"""Faults inside stepsync.watch on real accelerate + DeepSpeed loops (CPU), under every policy a loop can have.

The fault is injected into stepsync's view of the real engine (harness.faults), never into DeepSpeed, at a chosen
micro-batch of the loop. Whatever fails, the loop trains every micro-batch, the failure is logged once, and a
failure of the steering gives DeepSpeed its own boundary back; only policy 'raise' lets it reach the loop.
"""
import logging

import pytest

from harness.faults import breaking_at, stepsync_errors
from harness.loops import run_loop
from harness.stack import DRIFTS, needs_stack

pytestmark = [needs_stack, pytest.mark.integration]

N, G, EPOCHS = 5, 2, 2  # 10 micro-batches; the engine's own counter updates at 2, 4, 6, 8 and 10
BREAKS_AT = 4  # the micro-batch whose step the fault meets: mid-epoch, where sync has already steered


def faulty_loop(monkeypatch, caplog, policy, fail, breaks_at=BREAKS_AT, samples=N, **kwargs):
    """Run the loop of ``samples`` micro-batches per epoch with stepsync seeing a FaultyEngine that breaks before
    micro-batch ``breaks_at``."""
    import stepsync.accelerate.watch as adapter

    before_micro_batch = breaking_at(monkeypatch, adapter, "find_engine", fail, breaks_at)
    with caplog.at_level(logging.INFO, logger="stepsync"):
        return run_loop(samples, G, EPOCHS, policy, before_micro_batch=before_micro_batch, **kwargs)


def assert_trained_on_as_deepspeed_would(result, plain, caplog, failure):
    """Every micro-batch trained; the failure said once, with its traceback; the engine decides again."""
    assert result.error is None, repr(result.error)
    assert len(result.loop_steps) == N * EPOCHS and result.loop_steps == plain.loop_steps
    report = result.watch.report
    assert report.finished and not report.active and "internal error" in report.inactive_reason
    errors = stepsync_errors(caplog)
    assert len(errors) == 1 and errors[0].exc_info is not None and failure in errors[0].getMessage()
    assert "training goes on" in errors[0].getMessage()
    if DRIFTS:  # where stepsync may steer it, DeepSpeed's own boundary is back (accelerate >= 1.8 sets it itself)
        assert result.engine._is_gradient_accumulation_boundary is None


@pytest.mark.reliability("fault")
@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_counters_that_fail_mid_loop_switch_stepsync_off_and_the_loop_trains_on(monkeypatch, caplog, policy):
    result = faulty_loop(monkeypatch, caplog, policy, {"global_steps": "raise"})
    plain = run_loop(N, G, EPOCHS, None)
    assert_trained_on_as_deepspeed_would(result, plain, caplog, "injected failure reading global_steps")
    # From the fault on the engine counts on its own: the run is the one without stepsync, update for update
    # (sync had steered it to the same updates until then).
    assert result.engine_steps == plain.engine_steps
    assert result.engine_updates_at == ([2, 4, 6, 8, 10] if DRIFTS else [2, 4, 5, 7, 9, 10])
    assert result.watch.report.trainer_steps <= 3  # the counts stay those of the last check before the fault


@pytest.mark.reliability("fault")
@pytest.mark.parametrize("breaks_at", [3, 7])
def test_a_failing_boundary_call_under_sync_never_ends_the_loop(monkeypatch, caplog, breaks_at):
    """sync sets the boundary only from the first micro-batch where the engine's own counter would decide otherwise
    (micro-batch 5, epoch 1's partial window), then at every change. The setter failing from micro-batch 3 on fails
    that first call: nothing was set, DeepSpeed keeps its own boundary, and nothing is said to be left behind; failing
    from micro-batch 7 on, after two calls took, it also fails giving the boundary back, said in the same message."""
    result = faulty_loop(monkeypatch, caplog, "sync", {"set_gradient_accumulation_boundary": "raise"},
                         breaks_at=breaks_at)
    assert result.error is None and len(result.loop_steps) == N * EPOCHS
    report = result.watch.report
    if not DRIFTS:  # accelerate >= 1.8 sets the boundary itself; sync never calls it
        assert report.active and stepsync_errors(caplog) == []
        return
    errors = stepsync_errors(caplog)
    assert len(errors) == 1 and "injected failure reading set_gradient_accumulation_boundary" in errors[0].getMessage()
    set_before = breaks_at > 5
    assert ("could not be given back" in errors[0].getMessage()) is set_before
    assert (result.engine._is_gradient_accumulation_boundary is None) is not set_before
    assert not report.active and report.finished
    assert result.watch.close() is report  # a second close changes nothing and raises nothing


@pytest.mark.reliability("fault")
def test_a_failing_tracker_ends_only_the_observing_and_sync_steers_on(monkeypatch, caplog):
    class BrokenTracker:
        name = "broken"

        def log(self, values, step=None, **kwargs):
            raise OSError("injected: the tracker's disk is full")

    with caplog.at_level(logging.INFO, logger="stepsync"):
        result = run_loop(N, G, EPOCHS, "sync", trackers=[BrokenTracker()])
    steered = run_loop(N, G, EPOCHS, "sync")
    assert result.error is None and result.engine_steps == steered.engine_steps  # the steering went on
    report = result.watch.report
    assert not report.active and "stopped observing" in report.inactive_reason and report.finished
    errors = stepsync_errors(caplog)
    assert len(errors) == 1 and "accelerator.log" in errors[0].getMessage()
    if DRIFTS:
        assert result.engine_updates_at == [2, 4, 5, 7, 9, 10]  # sync: the engine follows the loop's windows


@pytest.mark.reliability("fault")
def test_under_raise_an_internal_failure_stops_the_loop_once(monkeypatch, caplog):
    # epochs of whole windows: a forecast without drift, so that raise reaches the failure
    result = faulty_loop(monkeypatch, caplog, "raise", {"global_steps": "raise"}, samples=2 * G)
    assert isinstance(result.error, RuntimeError) and "injected failure reading global_steps" in str(result.error)
    assert len(result.loop_steps) == BREAKS_AT - 1  # the loop stopped inside micro-batch 4's backward
    errors = stepsync_errors(caplog)
    assert len(errors) == 1 and "policy 'raise' stops the run" in errors[0].getMessage()
    assert result.watch.report.finished  # close() in the loop's finally raised nothing more
