"""The arithmetic of a resume on another layout against a brute-force simulation of accelerate's sharding and the
Trainer's skip, on the plans that changed across releases (floor before 4.52, ceil after)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.relayout_simulation import simulate
from stepsync.core.relayout import Layout, landing, position, resume_shift
from stepsync.core.versions import PlannedSteps


@settings(max_examples=600, deadline=None)
@given(examples=st.integers(1, 40), saved=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5)),
       resumed=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5)), epochs=st.integers(1, 4),
       updates=st.integers(0, 30), planned=st.sampled_from([PlannedSteps.CEIL, PlannedSteps.FLOOR]),
       drop_last=st.booleans())
def test_the_shift_equals_a_brute_force_resume(examples, saved, resumed, epochs, updates, planned, drop_last):
    before, after = Layout(*saved, examples, drop_last=drop_last), Layout(*resumed, examples, drop_last=drop_last)
    if not before.micro_batches_per_epoch or not after.micro_batches_per_epoch:
        return  # drop_last leaves a layout no micro-batch at all
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
                                                       planned.value, drop_last)
    for fix in shift.fixes:  # every fix named lands exactly
        name, value = fix.split("=")
        fixed = Layout(after.world_size, int(value) if name == "per_device_train_batch_size" else after.per_device_batch,
                       int(value) if name == "gradient_accumulation_steps" else after.gradient_accumulation_steps,
                       examples, drop_last=drop_last)
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


def saved_checkpoint(folder, world=1, gas=4, examples=12, step=6, next_epoch=2, next_skip=0, epochs=3):
    """A checkpoint-N folder as the Trainer writes it, with stepsync's record (and its layout) in trainer_state."""
    import json

    from stepsync.core.record import ResumeRecord

    record = ResumeRecord("warn", step, step, step, next_epoch, next_skip, world_size=world, per_device_batch=1,
                          gradient_accumulation_steps=gas, examples=examples, zero_stage=0)
    folder.mkdir()
    state = {"global_step": step, "num_train_epochs": epochs,
             "stateful_callbacks": {"StepSyncCallback": {"args": {}, "attributes": {"saved_record": record.to_dict()}}}}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def test_check_forecasts_a_resume_on_another_layout(tmp_path):
    import json

    from harness.cli import stepsync

    folder = saved_checkpoint(tmp_path / "checkpoint-6")
    args = ["check", "--samples", "12", "--epochs", "3", "--world-size", "2", "--transformers", "5.24.0",
            "--accelerate", "1.16.0", "--resume-from", str(folder), "--json"]
    shifted = stepsync(*args, "--gas", "4")
    data = json.loads(shifted.stdout)
    assert shifted.returncode == 1 and data["resume_shift"]["skipped"] == {"3": 12}
    assert data["verdict"].startswith("affected") and "skips 12" in data["verdict"]
    fixed = stepsync(*args, "--gas", "2")
    assert fixed.returncode == 0 and json.loads(fixed.stdout)["resume_shift"]["skipped"] == {}


def test_check_names_a_folder_without_the_layout(tmp_path):
    from harness.cli import stepsync

    (tmp_path / "checkpoint-1").mkdir()
    proc = stepsync("check", "--samples", "12", "--gas", "4", "--resume-from", str(tmp_path / "checkpoint-1"))
    assert proc.returncode == 2 and "holds no stepsync record with the layout" in proc.stderr


def test_an_older_record_without_the_layout_still_reads():
    from stepsync.core.record import ResumeRecord

    old = {"format": 1, "policy": "warn", "trainer_steps": 4, "engine_steps": 3, "resume_steps": 4, "next_epoch": 1,
           "next_skip": 0, "unapplied_at_save": 0, "events": [], "corrections": 0, "dropped_micro_batches": {}}
    record = ResumeRecord.from_dict(old)
    assert record.layout is None and record.trainer_steps == 4


def test_the_report_carries_the_shift_and_never_calls_it_aligned():
    import io

    from rich.console import Console

    from stepsync import Policy, SyncReport
    from stepsync.display.render import summary_view

    shift = resume_shift(Layout(1, 1, 4, 12), Layout(2, 1, 4, 12), 6, (2, 0), PlannedSteps.CEIL, 3)
    report = SyncReport(Policy.WARN, active=True, trainer_steps=6, engine_steps=6, resume_shift=shift, finished=True)
    assert "resumed on another layout" in str(report) and report.to_dict()["resume_shift"]["skipped"] == {"3": 12}
    screen = io.StringIO()
    Console(file=screen, width=80).print(summary_view(report))
    assert "skip 12 sample(s)" in " ".join(screen.getvalue().split()) and "aligned" not in screen.getvalue()


def _checkpoint(tmp_path, ranks, state):
    import json

    for name in ranks:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    return str(tmp_path)


def test_a_checkpoint_without_a_record_gives_its_layout_from_its_files(tmp_path):
    """Saved on 2 ranks, batch 1, G=3, 10 samples (5 micro-batches a rank, 2 updates an epoch), at step 3."""
    from stepsync.core.record import record_from_files
    from stepsync.core.relayout import Layout
    from stepsync.core.versions import PlannedSteps

    folder = _checkpoint(tmp_path, ["rng_state_0.pth", "rng_state_1.pth"],
                         {"global_step": 3, "epoch": 1.6, "max_steps": 6, "num_train_epochs": 3,
                          "train_batch_size": 1, "log_history": [{"step": 1, "epoch": 0.6, "loss": 1.0}]})
    record, how = record_from_files(folder, 3, Layout(1, 1, 6, 10), PlannedSteps.CEIL)
    assert (record.world_size, record.per_device_batch, record.gradient_accumulation_steps) == (2, 1, 3)
    assert (record.next_epoch, record.next_skip) == (1, 3) and "G from its max_steps and epoch" in how
    # The same layout as the resuming run's: nothing to compare.
    assert record_from_files(folder, 3, Layout(2, 1, 3, 10), PlannedSteps.CEIL) == (None, "")


def test_g_is_the_runs_where_the_files_fit_several_and_said_so(tmp_path):
    from stepsync.core.record import record_from_files
    from stepsync.core.relayout import Layout
    from stepsync.core.versions import PlannedSteps

    # 12 micro-batches, 3 updates an epoch, saved at an epoch end: G=4 and G=5 both fit.
    folder = _checkpoint(tmp_path, ["rng_state.pth"], {"global_step": 6, "epoch": 2.0, "max_steps": 9,
                                                       "num_train_epochs": 3, "train_batch_size": 1})
    record, how = record_from_files(folder, 6, Layout(2, 1, 4, 12), PlannedSteps.CEIL)
    assert record.world_size == 1 and record.gradient_accumulation_steps == 4 and "G taken as this run's" in how


def test_no_rng_state_file_no_layout(tmp_path):
    from stepsync.core.record import record_from_files
    from stepsync.core.relayout import Layout
    from stepsync.core.versions import PlannedSteps

    folder = _checkpoint(tmp_path, [], {"global_step": 6})
    record, why = record_from_files(folder, 6, Layout(2, 1, 4, 12), PlannedSteps.CEIL)
    assert record is None and "no rng_state file" in why


def test_a_truncated_json_file_is_never_said_to_be_deleted(tmp_path):
    """A checkpoint's trainer_state.json cut short: deleting it would make the checkpoint unresumable."""
    from stepsync.core.record import read_json

    path = tmp_path / "trainer_state.json"
    path.write_text('{"global_step": 4, "log_hist')
    with pytest.raises(ValueError) as raised:
        read_json(str(path), "trainer_state.json")
    assert "restore it from a copy" in str(raised.value) and "delete" not in str(raised.value)


@pytest.mark.parametrize("saved, resumed, stood, epoch, done, batches, expected", [
    # The real Lightning runs of tests/multiprocess/test_lightning_resume.py: 12 samples, batch 1, G=2, 3 epochs.
    (Layout(2, 1, 2, 12), Layout(1, 1, 2, 12), (1, 0), 1, 6, 12, ({2: 6}, {})),
    (Layout(2, 1, 2, 12), Layout(1, 1, 2, 12), (1, 4), 1, 2, 12, ({2: 2}, {2: 4})),
    (Layout(2, 1, 2, 12), Layout(2, 1, 2, 12), (1, 4), 1, 2, 6, ({2: 4}, {2: 4})),
    (Layout(2, 1, 2, 12), Layout(2, 1, 2, 12), (1, 0), 1, 0, 6, ({}, {})),
    (Layout(1, 1, 2, 12), Layout(2, 1, 2, 12), (0, 8), 0, 0, 6, ({}, {1: 8})),
    (Layout(1, 1, 2, 12), Layout(2, 1, 2, 12), (1, 4), 1, 4, 6, ({2: 8}, {2: 4})),
])
def test_a_replayed_epoch_is_said_as_lightning_trains_it(saved, resumed, stood, epoch, done, batches, expected):
    from stepsync.core.relayout import replayed_epoch_shift

    shift = replayed_epoch_shift(saved, resumed, stood, epoch, done, batches, 3)
    assert (shift.skipped, shift.repeated) == expected
    if not shift.exact:
        assert "Lightning restarts epoch" in shift.message() and "StatefulDataLoader" in shift.message()
