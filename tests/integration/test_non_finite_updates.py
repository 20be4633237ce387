"""Updates the engine applies although a gradient was not finite: real Trainer, real DeepSpeed on CPU, one
micro-batch whose loss is made NaN.

DeepSpeed checks gradients in fp16 always, in bf16 where ``check_grad_overflow`` is on (its default from 0.19.3),
and in fp32 never: there it applies the NaN, every weight turns NaN, and ``global_steps`` and the LR schedule go
on as if nothing happened. The truth is a recorder of its own: the sum of every weight (ZeRO-3's partitions
gathered) after every micro-batch, with the engine's counters. stepsync must name the update the weights stopped
being finite at, once, and ``raise`` must stop there.
"""
import math

import pytest

from harness.nonfinite import deepspeed_skips, skipping_run
from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]


def first_non_finite(rows):
    """(epoch, position, global_steps) of the first micro-batch after which the weights were not finite."""
    return next(((e, p, steps) for e, p, steps, _, _, weights in rows if not math.isfinite(weights)), None)


@pytest.mark.parametrize("stage, bf16", [(0, False), (2, False), (3, False), (1, True), (2, True), (3, True)])
def test_the_update_that_left_weights_not_finite_is_named_once(tmp_path, monkeypatch, stage, bf16):
    result, rows = skipping_run(tmp_path, monkeypatch, stage, 2, nan_at=3, samples=8, bf16=bf16)
    assert result.error is None
    report, truth = result.callback.report, first_non_finite(rows)
    if deepspeed_skips(stage, bf16):  # this release skips it (tests/integration/test_skipped_updates.py)
        assert truth is None and report.non_finite is None
        return
    assert truth == (1, 4, 2)  # the NaN loss is the 3rd micro-batch; the engine applied it at its 2nd update
    found = report.non_finite
    assert found is not None and found.each_update == (stage != 0)  # ZeRO-0 in fp32 keeps no flat buffer
    if found.each_update:
        assert (found.epoch, found.micro_batch, found.engine_steps) == truth
    else:  # read at the epoch's end: the update is at or before it
        assert (found.epoch, found.micro_batch, found.engine_steps) == (1, 8, 4)
    assert report.engine_skipped == 0 and rows[-1][3] == 0  # the engine counts nothing as skipped
    said = [note for note in report.notes if "left weights that are not finite" in note]
    assert len(said) == 1 and "find the micro-batch whose loss is not finite" in said[0]
    assert ("check_grad_overflow" in said[0]) == bf16
    assert f"weights not finite {'from' if found.each_update else 'by'} update {found.engine_steps}" in str(report)
    logged = [log["stepsync/non_finite_at_update"] for log in result.trainer.state.log_history
              if "stepsync/non_finite_at_update" in log]
    assert logged and set(logged) == {found.engine_steps}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_raise_stops_where_the_weights_are_found_not_finite(tmp_path, monkeypatch, stage):
    from stepsync import NonFiniteUpdateError, UpdateSkippedError

    result, rows = skipping_run(tmp_path, monkeypatch, stage, 2, nan_at=3, samples=8, bf16=False, policy="raise")
    if deepspeed_skips(stage, bf16=False):  # this release skips it: raise stops at the skip instead
        assert isinstance(result.error, UpdateSkippedError) and result.error.skip.engine_steps == 2
        return
    assert isinstance(result.error, NonFiniteUpdateError)
    assert "policy 'raise' stops before another update" in str(result.error)
    if stage == 0:  # fp32 ZeRO-0 keeps no flat buffer: its weights are read at the epoch's end
        assert result.error.update.engine_steps == 4 and not result.error.update.each_update
        return
    # Stopped in the hook of the micro-batch that made update 2: the truth recorder, after stepsync, never ran.
    assert result.error.update.engine_steps == 2 and result.engine.global_steps == 2 and len(rows) == 3


def test_finite_weights_say_nothing(tmp_path, monkeypatch):
    result, rows = skipping_run(tmp_path, monkeypatch, 2, 2, nan_at=10 ** 6, samples=8, bf16=False)
    report = result.callback.report
    assert result.error is None and first_non_finite(rows) is None and report.non_finite is None
    assert not any("stepsync/non_finite_at_update" in log for log in result.trainer.state.log_history)


@pytest.mark.parametrize("stage", [0, 2])
def test_an_accelerate_loop_names_it_through_the_same_run(stage):
    from harness.loops import run_loop
    from harness.nonfinite import whole_weights_sum

    result = run_loop(8, 2, 1, "warn", stage=stage, nan_at=3)  # fp32; the loop's second window holds the NaN
    assert result.error is None
    report, engine = result.watch.report, result.engine
    if deepspeed_skips(stage, bf16=False):
        assert report.non_finite is None and [s.engine_steps for s in report.skipped_updates] == [2]
        return
    assert engine.skipped_steps == 0 and not math.isfinite(whole_weights_sum(engine.module))  # the truth
    found = report.non_finite
    assert (found.epoch, found.micro_batch, found.engine_steps) == ((1, 8, 4) if stage == 0 else (1, 4, 2))
    assert f"not finite: {found}" in str(report)
