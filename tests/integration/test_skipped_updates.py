"""Updates the engine counts but does not apply: real Trainer, real DeepSpeed, bf16 on CPU, one micro-batch whose
loss is made non-finite.

The truth comes from a recorder of its own (never stepsync's view): after every micro-batch the engine's
``global_steps`` and ``skipped_steps``, the LR its scheduler is at, and a fingerprint of the weights. DeepSpeed
0.19.3 and later check bf16 gradients for overflow and skip that window's whole update: ``global_steps`` still
rises, the weights do not move and the LR schedule holds. stepsync must count, place and say exactly that.
"""
import math

import pytest

from harness.nonfinite import deepspeed_skips, skipping_run
from harness.runs import run
from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]


def skips_in(rows):
    """(epoch, position, global_steps) of every micro-batch where the engine's skipped_steps rose."""
    found, before = [], 0
    for epoch, position, steps, skipped, _, _ in rows:
        if skipped != before:
            found.append((epoch, position, steps))
        before = skipped
    return found


@pytest.mark.parametrize("stage, g, nan_at", [(0, 2, 3), (1, 2, 3), (2, 2, 3), (3, 2, 3), (2, 3, 2), (2, 4, 5)])
def test_a_skipped_update_is_counted_apart_where_the_engine_skipped_it(tmp_path, monkeypatch, stage, g, nan_at):
    result, rows = skipping_run(tmp_path, monkeypatch, stage, g, nan_at, samples=2 * g)
    assert result.error is None
    truth = skips_in(rows)
    report = result.callback.report
    assert [(s.epoch, s.micro_batch, s.engine_steps, s.by_design) for s in report.skipped_updates] == [
        (*where, False) for where in truth]
    if not deepspeed_skips(stage):  # this release applies it: nothing skipped, nothing said of a skip
        assert truth == [] and report.engine_skipped == 0 and not math.isfinite(rows[-1][5])
        return
    assert truth == [(1, g * math.ceil(nan_at / g), math.ceil(nan_at / g))]  # the window of the non-finite loss
    engine = result.engine
    assert (report.engine_steps, report.engine_skipped, report.applied_steps) == (
        engine.global_steps, engine.skipped_steps, engine.global_steps - engine.skipped_steps) == (2, 1, 1)
    skipped_at = truth[0][1] - 1
    if stage != 3:  # ZeRO-3 partitions the weights outside its steps; the engine's own counter is the truth there
        assert rows[skipped_at][5] == rows[skipped_at - 1][5]  # the weights did not move at that update
    assert rows[skipped_at][4] == rows[skipped_at - 1][4]  # nor did the LR schedule
    assert not report.schedule_finished and report.missed_updates == 1
    assert "made 2 (1 skipped, 1 applied)" in str(report)
    assert sum("the engine skipped update" in note for note in report.notes) == 1
    logged = [log for log in result.trainer.state.log_history if "stepsync/updates_skipped" in log]
    assert logged and all(log["stepsync/updates_skipped"] == 1 for log in logged)


def zero0_bf16_is_divided():
    """This release divides ZeRO-0's bf16 gradients by 65536 (stepsync/core/weights.py): raise and sync stop at
    the start there, before any skip can happen."""
    from importlib.metadata import version

    from stepsync.core.weights import weight_faults

    return bool(weight_faults(version("deepspeed"), 0, False, "bf16", 2))


def test_raise_stops_at_the_skipped_update_before_another_is_made(tmp_path, monkeypatch):
    from stepsync import StepSyncConfigError, UpdateSkippedError

    result, rows = skipping_run(tmp_path, monkeypatch, 0, 2, 1, policy="raise", samples=6)
    if zero0_bf16_is_divided():
        assert isinstance(result.error, StepSyncConfigError) and "divides every gradient by 65536" in str(result.error)
        assert rows == []
        return
    assert isinstance(result.error, UpdateSkippedError)
    assert result.error.skip.engine_steps == 1 and "policy 'raise' stops" in str(result.error)
    # It stopped in the hook of the micro-batch that closed the skipped window: no update after it.
    assert (result.engine.global_steps, result.engine.skipped_steps, len(rows)) == (1, 1, 1)


def test_without_a_skip_nothing_is_said_and_no_metric_is_added(tmp_path, monkeypatch):
    result, rows = skipping_run(tmp_path, monkeypatch, 2, 2, nan_at=10 ** 6)
    report = result.callback.report
    assert result.error is None and rows[-1][3] == 0
    assert report.skipped_updates == [] and report.engine_skipped == 0 and report.schedule_finished
    assert not any("stepsync/updates_skipped" in log for log in result.trainer.state.log_history)


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_the_clip_norm_in_force_against_max_grad_norm(tmp_path, policy):
    from stepsync.tools.tiny_run import deepspeed_config

    config = {k: v for k, v in deepspeed_config(0).items() if k != "gradient_clipping"}
    result = run(tmp_path, 4, 2, 1, policy=policy, deepspeed=config, max_grad_norm=0.5)
    in_force = result.engine.gradient_clipping()  # DeepSpeed's own default where the config has none
    said = [n for n in result.callback.report.notes if "asks to clip gradients at 0.5" in n]
    if policy == "raise":
        assert "policy 'raise' stops before the first micro-batch" in str(result.error)
        assert result.recording.engine_steps == []
        return
    assert result.error is None and len(said) == 1 and '"gradient_clipping": "auto"' in said[0]
    assert (f"clips at {in_force:g}" if in_force else "does not clip at all") in said[0]


@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_an_accelerate_loop_sees_the_skip_through_the_same_run(policy):
    from harness.loops import run_loop

    if policy == "sync" and zero0_bf16_is_divided():
        from stepsync import StepSyncConfigError

        with pytest.raises(StepSyncConfigError, match="divides every gradient by 65536"):
            run_loop(4, 2, 1, policy, bf16=True, nan_at=3)
        return
    result = run_loop(4, 2, 1, policy, bf16=True, nan_at=3)  # the loop's second window holds the non-finite loss
    assert result.error is None
    engine, report = result.engine, result.watch.report
    assert (engine.global_steps, engine.skipped_steps) == (2, 1)  # DeepSpeed's own counters: the truth
    assert [(s.epoch, s.micro_batch, s.engine_steps) for s in report.skipped_updates] == [(1, 4, 2)]
    assert report.applied_steps == 1 and "applied: 1 of the engine's 2 updates (1 skipped)" in str(report)


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_a_loops_max_norm_that_deepspeed_ignores_is_named_at_its_first_clip(policy):
    from stepsync.core.errors import StepSyncConfigError

    from harness.loops import run_loop

    result = run_loop(4, 2, 1, policy, max_norm=0.5)  # the config has no gradient_clipping
    in_force = result.engine.gradient_clipping()  # DeepSpeed's own default
    if policy == "raise":
        assert isinstance(result.error, StepSyncConfigError) and "max_norm under DeepSpeed" in str(result.error)
        assert len(result.loop_steps) == 1  # stopped at the first clip, in the first window
        return
    said = [n for n in result.watch.report.notes if "asks to clip gradients at 0.5" in n]
    assert result.error is None and len(said) == 1 and '"gradient_clipping": 0.5 in the DeepSpeed config' in said[0]
    assert (f"clips at {in_force:g}" if in_force else "does not clip at all") in said[0]
    quiet = run_loop(4, 2, 1, "warn", max_norm=in_force or 0.0)  # asked what is in force: nothing to say
    assert not any("clip" in note for note in quiet.watch.report.notes)
