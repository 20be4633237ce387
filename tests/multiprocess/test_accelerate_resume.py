"""An accelerate loop that resumes as transformers' run_*_no_trainer.py examples do (``step_N`` * G micro-batches
skipped, whole epochs first), on another number of ranks (torchrun on 127.0.0.1, gloo): what
``stepsync.resume_settings(..., loop="accelerate")`` says before the resume equals what the samples every rank
trained show; the G it gives lands; and on one unchanged rank the examples' own arithmetic skips data wherever an
epoch ends in a short window, which it says too."""
import os

import pytest

import stepsync
from harness.runs import torchrun_phase
from harness.samples import skipped_and_repeated
from harness.stack import STACK, needs_stack
from harness.paths import entry_script

pytestmark = [needs_stack, pytest.mark.skipif(STACK not in ("", "drifting"), reason="run on the drifting stack")]
SCRIPT = entry_script("accelerate_resume_runs.py")
EPOCHS = 3


def launch(out, name, world, samples, gas, checkpoint=None):
    return torchrun_phase(SCRIPT, out, name, world, [samples, gas, EPOCHS] + ([checkpoint] if checkpoint else []),
                          timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate-resume")
    return out, {"one": launch(out, "one", 1, 12, 4), "two": launch(out, "two", 2, 12, 2),
                 "ten": launch(out, "ten", 1, 10, 4)}


@pytest.mark.parametrize("base, step, samples, gas, world, expected, fixed_gas", [
    ("one", 4, 12, 4, 2, ({2: 8, 3: 8}, {}), 2),  # 1 -> 2 ranks: 16 samples never trained; G=2 lands
    ("two", 4, 12, 2, 1, ({}, {1: 4, 2: 4}), 4),  # 2 -> 1 rank: 8 trained twice; G=4 lands
    ("ten", 3, 10, 4, 1, ({2: 2}, {}), None),  # one rank, unchanged: epoch 1 ended in a window of 2, counted as 4
])
def test_what_resume_settings_say_is_what_the_examples_resume_trains(saved, base, step, samples, gas, world, expected,
                                                                      fixed_gas):
    out, runs = saved
    checkpoint = str(out / base / f"step_{step}")
    settings = stepsync.resume_settings(checkpoint, world, 1, gas, examples=samples, loop="accelerate")
    plain = launch(out, f"{base}-{step}-on-{world}", world, samples, gas, checkpoint)
    assert skipped_and_repeated(runs[base], plain, step, samples, EPOCHS) == expected
    assert (settings.shift.skipped, settings.shift.repeated) == expected
    if fixed_gas is None:
        assert settings.lands_exactly is False and "short last update" in settings.message()
        return
    assert settings.lands_exactly and settings.gradient_accumulation_steps == fixed_gas
    fixed = launch(out, f"{base}-{step}-on-{world}-fixed", world, samples, fixed_gas, checkpoint)
    assert skipped_and_repeated(runs[base], fixed, step, samples, EPOCHS) == ({}, {})
