"""The G in force against the G asked, in a real accelerate loop on DeepSpeed: accelerate takes
``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` over the code's ``Accelerator(gradient_accumulation_steps=...)``, and
an explicit G in the DeepSpeed config over both (with one log line). The truth is the engine's own G and the
micro-batches at which its count rose."""
import pytest

from harness.loops import run_loop
from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]

VARIABLE = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"


def updates_at(result):
    """1-based micro-batches at which the engine's count rose."""
    before, found = 0, []
    for index, steps in enumerate(result.engine_steps, 1):
        if steps != before:
            found.append(index)
        before = steps
    return found


def said(result):
    return [note for note in result.watch.report.notes if "asks gradient_accumulation_steps" in note]


@pytest.mark.parametrize("variable, code_g, config_g, in_force, sources", [
    (None, 1, 2, 2, ["your code"]),  # the config's explicit G wins over the code's
    ("3", 4, "auto", 3, ["your code"]),  # the variable wins over the code's
    ("3", 3, 2, 2, ["your code", f"the environment's {VARIABLE}"]),  # the config wins over both
    (None, 2, "auto", 2, []),  # all agree: nothing to say
    ("2", 2, "auto", 2, []),
])
def test_each_place_g_was_set_is_held_against_the_g_in_force(monkeypatch, variable, code_g, config_g, in_force,
                                                              sources):
    if variable is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, variable)
    result = run_loop(6, 2, 1, "warn", code_g=code_g, config_g=config_g, told_g=code_g)
    assert result.error is None
    assert result.engine.gradient_accumulation_steps() == in_force  # the truth: DeepSpeed's own G
    assert updates_at(result) == list(range(in_force, 7, in_force))
    notes = said(result)
    assert [note.split(" asks ")[0] for note in notes] == sources
    for note in notes:
        assert f"the engine accumulates {in_force} micro-batches per update" in note
    if sources and variable is not None and config_g == "auto":
        assert "unset the variable" in notes[0]
    elif sources:
        assert '"gradient_accumulation_steps"' in notes[0] and '"auto"' in notes[0]


def test_raise_stops_before_the_first_micro_batch(monkeypatch):
    from stepsync import StepSyncConfigError

    monkeypatch.setenv(VARIABLE, "3")
    with pytest.raises(StepSyncConfigError, match="asks gradient_accumulation_steps=4 .* policy 'raise' stops before "
                                                  "the first micro-batch"):
        run_loop(6, 2, 1, "raise", code_g=4, config_g="auto", told_g=4)


def test_without_the_codes_g_only_the_variable_is_held(monkeypatch):
    monkeypatch.setenv(VARIABLE, "3")
    result = run_loop(6, 2, 1, "warn", code_g=3, config_g=2)  # the watch is not told the code's G
    assert [note.split(" asks ")[0] for note in said(result)] == [f"the environment's {VARIABLE}"]


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True])
def test_a_bad_g_is_refused_naming_the_fix(bad):
    import stepsync
    from stepsync import StepSyncConfigError

    with pytest.raises(StepSyncConfigError, match="pass the positive int your code gave Accelerator"):
        stepsync.watch(object(), gradient_accumulation_steps=bad)


@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_a_loop_whose_g_is_only_the_engines_is_held_to_the_windows_it_means(monkeypatch, policy):
    """accelerate's examples/by_feature/checkpointing.py with G only in the DeepSpeed side (13 micro-batches per
    epoch, G=3): before 1.8 the accelerator's own G stays 1, so the loop counts every micro-batch while the engine
    updates every third. No forecast made with one G, every drift's cause named, the fix naming the accelerator;
    sync never turns the engine's windows into one update per micro-batch (the engine's own record)."""
    monkeypatch.delenv(VARIABLE, raising=False)
    from stepsync.core.events import Cause

    result = run_loop(13, 3, 2, policy, code_g=1, config_g=3, told_g=1)
    assert result.error is None
    if result.accelerator.gradient_accumulation_steps == result.engine.gradient_accumulation_steps():
        pytest.skip("this accelerate takes the DeepSpeed config's G into the accelerator: one G (accelerate >= 1.8)")
    report = result.watch.report
    assert updates_at(result) == list(range(3, 27, 3))  # the truth: the engine's own windows, across epochs
    assert (report.trainer_steps, report.engine_steps) == (result.loop_steps[-1], result.engine_steps[-1]) == (26, 8)
    assert report.forecast is None and report.forecast_mismatches == []
    assert report.events and {event.cause for event in report.events} <= {Cause.TWO_GS}
    assert all("Accelerator(gradient_accumulation_steps=...)" in event.remedy for event in report.events)
    assert not any("fix the DeepSpeed config" in note or "please report" in note for note in report.notes)
    if policy == "sync":
        assert any(note.startswith("policy 'sync' does not steer this run") for note in report.notes)
