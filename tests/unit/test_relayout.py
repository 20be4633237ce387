"""The arithmetic of a resume on another layout against a brute-force simulation of accelerate's sharding and the
Trainer's skip, on the plans that changed across releases (floor before 4.52, ceil after)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.relayout_simulation import simulate
from stepsync.core.relayout import Layout, landing, position, resume_shift
from stepsync.core.versions import PlannedSteps


@settings(max_examples=600, deadline=None)
@given(examples=st.integers(1, 40), saved=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5)),
       resumed=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5)), epochs=st.integers(1, 4),
       updates=st.integers(0, 30), planned=st.sampled_from([PlannedSteps.CEIL, PlannedSteps.FLOOR]))
def test_the_shift_equals_a_brute_force_resume(examples, saved, resumed, epochs, updates, planned):
    before, after = Layout(*saved, examples), Layout(*resumed, examples)
    # A checkpoint after `updates` updates of the saved run: where the Trainer's own arithmetic put it then.
    total = epochs * (-(-before.micro_batches_per_epoch // before.gradient_accumulation_steps)
                      if planned is PlannedSteps.CEIL else
                      max(before.micro_batches_per_epoch // before.gradient_accumulation_steps, 1))
    step = min(updates, total)
    epoch, at = landing(before, step, planned)
    micro = at // before.samples_per_micro_batch if at < examples else before.micro_batches_per_epoch
    stood = position(before, epoch, micro)
    if stood[0] >= epochs:
        return
    shift = resume_shift(before, after, step, stood, planned, epochs)
    assert (shift.skipped, shift.repeated) == simulate(examples, saved, resumed, epochs, epoch, micro, step,
                                                       planned.value)
    for fix in shift.fixes:  # every fix named lands exactly
        name, value = fix.split("=")
        fixed = Layout(after.world_size, int(value) if name == "per_device_train_batch_size" else after.per_device_batch,
                       int(value) if name == "gradient_accumulation_steps" else after.gradient_accumulation_steps,
                       examples)
        assert resume_shift(before, fixed, step, stood, planned, epochs).exact


def test_twelve_samples_from_one_rank_to_two_skip_the_third_epoch():
    """12 samples, G=4, saved on 1 rank at the end of epoch 2 (step 6): on 2 ranks an epoch is 2 updates."""
    saved, resumed = Layout(1, 1, 4, 12), Layout(2, 1, 4, 12)
    shift = resume_shift(saved, resumed, 6, (2, 0), PlannedSteps.CEIL)
    assert shift.lands == (3, 0) and shift.skipped == {3: 12} and shift.repeated == {}
    assert shift.fixes == ["gradient_accumulation_steps=2"]
    assert "skip 12 sample(s) (12 of epoch 3)" in shift.message()


def test_ten_samples_from_two_ranks_to_one_train_an_epoch_twice():
    saved, resumed = Layout(2, 1, 3, 10), Layout(1, 1, 3, 10)
    shift = resume_shift(saved, resumed, 4, (2, 0), PlannedSteps.CEIL)
    assert shift.lands == (1, 0) and shift.repeated == {2: 10} and shift.skipped == {}
    assert shift.fixes == ["gradient_accumulation_steps=6", "per_device_train_batch_size=2"]


def test_when_nothing_lands_exactly_it_is_said():
    shift = resume_shift(Layout(2, 1, 2, 12), Layout(3, 1, 2, 12), 3, (1, 0), PlannedSteps.CEIL)
    assert not shift.exact and shift.fixes == [] and "no layout on 3 rank(s) lands there" in shift.message()
