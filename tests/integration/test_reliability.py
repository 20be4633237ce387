"""Faults inside stepsync, engines and Trainers that differ, bad input: real Trainer, real DeepSpeed, CPU.

Faults are injected into stepsync's view of the real engine (through its adapter), never into DeepSpeed:
the run itself stays real. In every case the run either finishes with every micro-batch trained, or stops
with the error that was asked for.
"""
import logging

import pytest

from harness.faults import FaultyEngine, stepsync_errors
from harness.stack import DRIFTS, needs_stack
from harness.runs import run

pytestmark = [needs_stack, pytest.mark.integration]

N, G, EPOCHS = 3, 2, 2  # 6 micro-batches, Trainer 4 updates, engine 3 on a drifting stack


def inject(monkeypatch, fail, from_epoch=1):
    """Let stepsync find a FaultyEngine; break it at the start of epoch ``from_epoch`` (0-based)."""
    from transformers import TrainerCallback

    import stepsync.trainer.trainer as adapter

    holder = {}
    real_find = adapter.find_engine

    def find(trainer):
        holder["engine"] = FaultyEngine(real_find(trainer), fail)
        holder["engine"].broken = from_epoch == 0
        return holder["engine"]

    monkeypatch.setattr(adapter, "find_engine", find)

    class Breaker(TrainerCallback):
        epochs_begun = 0

        def on_epoch_begin(self, args, state, control, **kwargs):
            if self.epochs_begun >= from_epoch and "engine" in holder:
                holder["engine"].broken = True
            self.epochs_begun += 1

    return Breaker()


def assert_finished_intact(result, trainer_steps=4):
    assert result.error is None
    assert result.trainer.state.global_step == trainer_steps
    assert len(result.recording.engine_steps) == N * EPOCHS  # every micro-batch was trained


@pytest.mark.reliability("fault")
@pytest.mark.parametrize("policy", ["warn", "sync", "realign", "drop_last"])
def test_counters_that_raise_switch_stepsync_off_once(tmp_path, monkeypatch, caplog, policy):
    breaker = inject(monkeypatch, {"global_steps": "raise"})
    with caplog.at_level(logging.INFO, logger="stepsync"):
        result = run(tmp_path, N, G, EPOCHS, policy=policy, extra_callbacks=[breaker])
    # drop_last ended epoch 1 early (2 micro-batches); epoch 2 runs whole once stepsync is off.
    expected_micro = N * EPOCHS - (1 if policy == "drop_last" else 0)
    assert result.error is None and len(result.recording.engine_steps) == expected_micro
    report = result.callback.report
    assert not report.active and "internal error" in report.inactive_reason
    errors = stepsync_errors(caplog)
    assert len(errors) == 1 and errors[0].exc_info is not None  # once, with its traceback
    assert "injected failure reading global_steps" in errors[0].getMessage()
    if DRIFTS:
        assert result.engine._is_gradient_accumulation_boundary is None  # sync's override was given back


@pytest.mark.reliability("fault")
def test_a_failing_boundary_call_under_sync_switches_off_and_gives_the_engine_back(tmp_path, monkeypatch, caplog):
    breaker = inject(monkeypatch, {"set_gradient_accumulation_boundary": "raise"})
    with caplog.at_level(logging.INFO, logger="stepsync"):
        result = run(tmp_path, N, G, EPOCHS, policy="sync", extra_callbacks=[breaker])
    assert_finished_intact(result)
    if DRIFTS:
        assert len(stepsync_errors(caplog)) == 1 and not result.callback.report.active
    else:  # accelerate >= 1.8 sets the boundary itself; sync never calls it
        assert result.callback.report.active and stepsync_errors(caplog) == []


@pytest.mark.reliability("fault")
def test_under_raise_an_internal_failure_stops_the_run(tmp_path, monkeypatch, caplog):
    breaker = inject(monkeypatch, {"global_steps": "raise"}, from_epoch=0)
    with caplog.at_level(logging.INFO, logger="stepsync"):
        result = run(tmp_path, N, G, EPOCHS, policy="raise", extra_callbacks=[breaker])
    assert isinstance(result.error, RuntimeError) and "injected failure" in str(result.error)
    assert "policy 'raise' stops the run" in stepsync_errors(caplog)[0].getMessage()
    assert result.recording.engine_steps == []  # stopped in on_train_begin, before any micro-batch


@pytest.mark.reliability("fault")
def test_a_failing_record_write_keeps_the_checkpoint_and_the_steering(tmp_path, monkeypatch, caplog):
    import stepsync.trainer.trainer

    def broken(*args, **kwargs):
        raise OSError("injected: disk full")

    monkeypatch.setattr(stepsync.trainer.trainer, "save_record", broken)
    with caplog.at_level(logging.INFO, logger="stepsync"):
        result = run(tmp_path, N, G, EPOCHS, policy="sync", save_strategy="steps", save_steps=2)
    assert_finished_intact(result)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert (tmp_path / "checkpoint-4" / "latest").read_text().strip() == "global_step4"  # sync kept acting
    errors = [r.getMessage() for r in stepsync_errors(caplog)]
    assert len(errors) == 2 and all("disk full" in e and "training goes on" in e for e in errors)
    assert "checkpoint-2" in errors[0] and "checkpoint-4" in errors[1]
    report = result.callback.report
    assert report.active and not report.inactive_reason and (report.trainer_steps, report.engine_steps) == (4, 4)


@pytest.mark.reliability("fault")
@pytest.mark.parametrize("policy", ["realign", "drop_last", "sync"])
def test_a_fault_in_the_observing_never_changes_the_steering(tmp_path, monkeypatch, caplog, policy):
    """A check that fails ends the checks, messages and metrics; the run trains exactly as without the fault."""
    from stepsync.engine.run import Run

    unbroken = run(tmp_path / "unbroken", N * 2 + 1, G, EPOCHS, policy=policy)
    real_check, calls = Run.check, []

    def check_that_breaks(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 2:  # after the start, at the first epoch's end: the second epoch runs without observing
            raise OSError("injected: the console's terminal went away")
        return real_check(self, *args, **kwargs)

    monkeypatch.setattr(Run, "check", check_that_breaks)
    with caplog.at_level(logging.INFO, logger="stepsync"):
        broken = run(tmp_path / "broken", N * 2 + 1, G, EPOCHS, policy=policy)
    assert broken.error is None and unbroken.error is None
    assert broken.recording.trainer_steps == unbroken.recording.trainer_steps
    assert broken.recording.engine_updates_at == unbroken.recording.engine_updates_at
    assert broken.trainer.state.max_steps == unbroken.trainer.state.max_steps
    assert len(calls) == 2  # no check after the fault
    errors = [r.getMessage() for r in stepsync_errors(caplog)]
    assert len(errors) == 1 and "stopped observing" in errors[0] and f"policy '{policy}' goes on acting" in errors[0]
    assert not broken.callback.report.active and "still acts" in broken.callback.report.inactive_reason


@pytest.mark.reliability("fault")
def test_a_failing_metrics_read_keeps_the_log_records(tmp_path, monkeypatch, caplog):
    import stepsync.trainer.trainer

    def broken(*args):
        raise KeyError("injected")

    monkeypatch.setattr(stepsync.trainer.trainer, "add_metrics", broken)
    with caplog.at_level(logging.INFO, logger="stepsync"):
        result = run(tmp_path, N, G, EPOCHS)
    assert_finished_intact(result)
    assert len([r for r in result.trainer.state.log_history if "loss" in r]) == 4
    assert len(stepsync_errors(caplog)) == 1


@pytest.mark.reliability("differs")
def test_no_engine_with_counters_is_stated_once(tmp_path, monkeypatch, caplog):
    import stepsync.trainer.trainer as adapter

    monkeypatch.setattr(adapter, "find_engine", lambda trainer: None)
    with caplog.at_level(logging.INFO, logger="stepsync"):
        result = run(tmp_path, N, G, EPOCHS, policy="sync")
    assert_finished_intact(result)
    report = result.callback.report
    assert not report.active and "no engine with global_steps was found" in report.inactive_reason
    assert [r.levelname for r in caplog.records if r.name == "stepsync"] == ["WARNING"]


@pytest.mark.reliability("differs")
def test_an_engine_without_the_boundary_call_makes_sync_fall_back(tmp_path, monkeypatch, caplog):
    inject(monkeypatch, {"set_gradient_accumulation_boundary": "missing"}, from_epoch=99)
    with caplog.at_level(logging.INFO, logger="stepsync"):
        result = run(tmp_path, N, G, EPOCHS, policy="sync")
    report = result.callback.report
    assert result.error is None and report.drift == 0
    if DRIFTS:
        assert report.policy.value == "realign" and result.trainer.state.global_step == 3
        assert any("has no set_gradient_accumulation_boundary" in n and "falling back to policy 'realign'" in n
                   for n in report.notes)
        assert [r.levelname for r in stepsync_errors(caplog)] == ["ERROR"]
    else:
        assert report.policy.value == "sync" and result.trainer.state.global_step == 4


@pytest.mark.reliability("differs")
@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_unmanaged_accumulation_is_stated_and_detected(tmp_path, monkeypatch, policy):
    from stepsync.tools import tiny_run as testing

    plain = testing.deepspeed_config
    monkeypatch.setattr(testing, "deepspeed_config", lambda stage=0: dict(plain(stage), managed_gradient_accumulation=False))
    result = run(tmp_path, N, G, EPOCHS, policy=policy)
    report = result.callback.report
    if not DRIFTS:  # accelerate >= 1.8 calls set_gradient_accumulation_boundary, which DeepSpeed then refuses
        assert isinstance(result.error, AssertionError) and "managed_gradient_accumulation=False" in str(result.error)
        assert result.recording.engine_steps == []
        return
    assert result.error is None
    assert any("managed_gradient_accumulation is false" in note for note in report.notes)
    # What stepsync reports is what the engine's counter shows, whatever the engine did.
    assert (report.trainer_steps, report.engine_steps) == (result.trainer.state.global_step, result.engine.global_steps)
    if policy == "sync":
        assert report.policy.value == "realign" and report.drift == 0
    elif DRIFTS:  # accelerate 1.7 calls step() on every micro-batch: the engine runs ahead
        assert report.drift < 0 and report.events[0].cause.name == "ENGINE_AHEAD"


@pytest.mark.reliability("differs")
@pytest.mark.parametrize("policy", ["warn", "sync", "drop_last"])
def test_a_dataloader_without_length(tmp_path, monkeypatch, policy):
    import torch

    from stepsync.tools import tiny_run as testing

    rows = testing.TinyDataset(6)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (rows[i] for i in range(len(rows)))

    monkeypatch.setattr(testing, "TinyDataset", lambda samples, seed=1: Stream())
    result = run(tmp_path, 6, 4, 1, policy=policy, max_steps=4)
    report = result.callback.report
    assert result.error is None and result.trainer.state.global_step == 4
    assert report.forecast is None and any("has no length" in note for note in report.notes)
    assert (report.trainer_steps, report.engine_steps) == (4, result.engine.global_steps)
    if policy == "sync":  # on an aligned stack sync has nothing to do and stays itself
        assert report.policy.value == ("realign" if DRIFTS else "sync") and report.drift == 0
    elif DRIFTS:
        assert report.drift == 4 - result.engine.global_steps == -1 and report.events[0].cause.name == "ENGINE_AHEAD"


@pytest.mark.reliability("differs")
@pytest.mark.parametrize("policy", ["warn", "sync", "realign"])
def test_evaluation_and_step_saves_during_training(tmp_path, policy):
    result = run(tmp_path, N, G, EPOCHS, policy=policy, eval_samples=2, eval_strategy="steps", eval_steps=1,
                 save_strategy="steps", save_steps=2)
    report = result.callback.report
    assert result.error is None and report.forecast_mismatches == []
    steps = [r["step"] for r in result.trainer.state.log_history if "eval_loss" in r]
    assert steps == sorted(set(steps)) == list(range(1, result.trainer.state.global_step + 1))  # one eval per step
    expected = {"warn": (4, 3 if DRIFTS else 4), "sync": (4, 4), "realign": (3, 3) if DRIFTS else (4, 4)}[policy]
    assert (result.trainer.state.global_step, result.engine.global_steps) == expected
    from stepsync.core.record import load_record

    for folder in tmp_path.glob("checkpoint-*"):
        record = load_record(str(folder))
        assert record.trainer_steps == int(folder.name.split("-")[1])


@pytest.mark.reliability("differs")
def test_a_max_steps_run_matches_its_forecast(tmp_path):
    result = run(tmp_path, N, G, 1, max_steps=3)
    report = result.callback.report
    assert result.error is None and result.trainer.state.global_step == 3
    assert report.forecast.planned_steps == 3 and report.forecast_mismatches == []
    assert (report.forecast.trainer_steps, report.forecast.engine_steps) == (3, result.engine.global_steps)


@pytest.mark.reliability("differs")
@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_bf16(tmp_path, monkeypatch, policy):
    from stepsync.tools import tiny_run as testing

    plain = testing.deepspeed_config
    monkeypatch.setattr(testing, "deepspeed_config", lambda stage=0: dict(plain(stage), bf16={"enabled": "auto"}))
    result = run(tmp_path, N, G, EPOCHS, policy=policy, bf16=True)
    report = result.callback.report
    assert result.error is None and result.engine.bfloat16_enabled()
    assert (report.trainer_steps, report.engine_steps) == (4, 3 if DRIFTS and policy == "warn" else 4)
    assert report.forecast_mismatches == []


@pytest.mark.reliability("resume")
@pytest.mark.parametrize("policy", ["sync", "realign"])
def test_resuming_a_drifted_checkpoint_adds_no_new_drift(tmp_path, policy):
    run(tmp_path / "first", N, G, EPOCHS, policy=None, save_strategy="steps", save_steps=4)
    resumed = run(tmp_path / "second", N, G, 4, policy=policy,
                  resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-4"))
    report = resumed.callback.report
    assert resumed.error is None
    inherited = 1 if DRIFTS else 0
    assert report.inherited_drift == inherited
    assert [e.cause.name for e in report.events[:1]] == (["INHERITED"] if DRIFTS else [])
    # sync keeps the inherited difference, adding none; realign adopts the engine's count at the first step.
    assert report.drift == (inherited if policy == "sync" else 0)
    assert report.forecast_mismatches == []


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "nope"}, "Possible choices are: 'warn', 'raise', 'sync', 'realign', 'drop_last'"),
    ({"policy": 3}, "Unsupported policy 3"),
    ({"policy": None}, "Unsupported policy None"),
    ({"console": 3}, "console must be a rich.console.Console, None or False"),
    ({"console": "stderr"}, "console must be a rich.console.Console, None or False"),
])
def test_constructor_arguments_are_validated(kwargs, message):
    from stepsync import StepSyncCallback

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        StepSyncCallback(**kwargs)


def test_every_hook_keeps_its_base_class_signature():
    """A reader who knows transformers' TrainerCallback finds each hook as the base class declares it: stepsync's guard
    looks its run up on the callback and never adds a parameter (tests/integration/test_lightning.py: Lightning's)."""
    from transformers import TrainerCallback

    from harness.runs import hooks_as_declared
    from stepsync import StepSyncCallback

    assert hooks_as_declared(StepSyncCallback, TrainerCallback)
