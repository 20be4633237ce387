"""A custom accelerate loop saved with ``accelerator.save_state`` and resumed with ``accelerator.load_state``, as
transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py`` does (``step_N`` after every update,
``epoch_E`` after every epoch, and on resume its own arithmetic: ``N * G`` micro-batches skipped, whole epochs first).

The watch sits where the docs place it (right after ``prepare``), with no new argument. The truth is the loop's own
record (its ``completed_steps`` and the engine's ``global_steps`` after every micro-batch, harness.loops.run_loop):
the report of every resume must equal it. Real accelerate 1.7 and DeepSpeed 0.19.8 (ZeRO-2), one process, CPU.
"""
import os

import pytest

from harness.stack import STACK, needs_stack

pytestmark = [needs_stack, pytest.mark.integration,
              pytest.mark.skipif(STACK not in ("", "drifting"), reason="run on the drifting stack")]

N, G, EPOCHS = 10, 3, 3  # windows of 3, 3, 3 and 1 in every epoch: the engine's run across epoch ends


def loop(policy, **kwargs):
    from harness.loops import run_loop

    return run_loop(N, G, EPOCHS, policy, stage=2, **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One full run per policy, saving as the example does; and one that saves without stepsync."""
    out = tmp_path_factory.mktemp("loop-resume")
    runs = {policy: loop(policy, save_to=str(out / policy)) for policy in ("warn", "sync")}
    runs["plain"] = loop(None, save_to=str(out / "plain"))
    runs["every"] = loop("sync", save_to=str(out / "every"), save_every_micro_batch=True)
    return out, runs


def check_equals_the_truth(result):
    report = result.watch.report
    assert result.error is None, repr(result.error)
    assert (report.trainer_steps, report.engine_steps) == (result.loop_steps[-1], result.engine_steps[-1])
    assert [(row.trainer_steps, row.engine_steps) for row in report.epochs] == result.epoch_ends
    assert "UNEXPLAINED" not in [event.cause.name for event in report.events]
    assert report.forecast_mismatches == []
    return report


def test_the_saves_say_what_they_hold(saved):
    from stepsync.tools.audit import audit_output_dir

    out, runs = saved
    # The loop counts 4 updates per epoch, the engine 10 in 3 epochs (accelerate 1.7): step_8 holds engine step 6.
    assert runs["warn"].saved["step_8"] == (8, 6) and runs["warn"].saved["step_12"] == (12, 10)
    # The first save a resume cannot continue from exactly is said in full; those like it after are counted in one
    # note that names the last (the report stays the same size however often the loop saves).
    unsafe = [item.name for item in audit_output_dir(str(out / "warn")).checkpoints if not item.ok]
    notes = runs["warn"].watch.report.notes
    first = [note for note in notes if note.startswith("checkpoint ")]
    (later,) = [note for note in notes if "later save(s) like it" in note]
    count, last = int(later.split()[0]), later.split("the last checkpoint ")[1].split(":")[0]
    assert len(first) == 1 and first[0].split(":")[0][len("checkpoint "):] in unsafe and last in unsafe
    assert 1 <= count < len(unsafe) and last == "step_12" and "holds DeepSpeed's step 10 (drift +2)" in later
    assert not [note for note in runs["sync"].watch.report.notes if note.startswith("checkpoint ")]
    # An older copy of the example saves step_N at every micro-batch until the count changes: mid-window.
    # Said for the first such save, counted for the rest; each folder's record keeps its own (inspect reads it).
    every = [note.split(":")[0] for note in runs["every"].watch.report.notes if "DeepSpeed's open window" in note]
    assert len(every) == 2 and every[0] == "checkpoint step_1" and "later save(s) like it" in every[1]
    assert every[1].split("the last checkpoint ")[1] in runs["every"].saved


@pytest.mark.parametrize("policy, folder, truth, events", [
    # +1 and +2 at the saved run's epoch ends, carried on, +3 at the last epoch's short window: one cause, one entry
    ("warn", "epoch_1", (12, 9), [(1, 3, 3)]),
    ("sync", "epoch_1", (12, 12), []),
])
def test_a_resume_at_an_epoch_end_continues_the_report(saved, policy, folder, truth, events):
    out, _ = saved
    result = loop(policy, resume_from=str(out / policy / folder))
    report = check_equals_the_truth(result)
    assert (result.loop_steps[-1], result.engine.global_steps) == truth
    assert report.resumed_from is not None and report.resumed_from.trainer_steps == 8
    assert [(event.drift, event.last_drift, event.changes) for event in report.events] == events
    assert [(row.trainer_steps, row.engine_steps) for row in report.forecast.epochs] == result.epoch_ends
    assert not [note for note in report.notes if "your loop resumes at" in note]


@pytest.mark.parametrize("policy, truth", [("warn", (10, 8)), ("sync", (10, 10))])
def test_the_examples_arithmetic_skips_data_and_the_watch_says_how_much(saved, policy, truth):
    out, _ = saved
    # step_8 was saved at epoch 2's end; 8 * G = 24 micro-batches puts the loop at epoch 3's fifth.
    result = loop(policy, resume_from=str(out / policy / "step_8"))
    report = check_equals_the_truth(result)
    assert (result.loop_steps[-1], result.engine.global_steps) == truth
    assert len(result.trained) == N - 4  # the truth: 4 micro-batches of epoch 3 never trained
    said = [note for note in report.notes if "your loop resumes at" in note]
    assert said == ["step_8 was saved at epoch 3, after micro-batch 0, but your loop resumes at epoch 3, after "
                    "micro-batch 4 (as transformers' run_*_no_trainer.py arithmetic (N * G micro-batches) places "
                    "step_8): it skips 4 micro-batch(es) that were never trained; place the resume with the position "
                    "stepsync saved (stepsync_state.json: next_epoch, next_skip), not with the folder's name"]


def test_raise_stops_before_a_resume_that_skips_data(saved):
    from stepsync.core.errors import UnsafeCheckpointError

    out, _ = saved
    result = loop("raise", resume_from=str(out / "sync" / "step_8"))
    assert isinstance(result.error, UnsafeCheckpointError) and result.trained == [(2, result.trained[0][1])]
    assert result.loop_steps == [] and result.engine.global_steps == 8  # nothing trained past the forward


def test_a_checkpoint_saved_mid_window_says_what_the_resume_lost(saved):
    out, runs = saved
    # step_4's last save: epoch 2, micro-batch 2, both in the open window; the example resumes at 4 * G = 12.
    result = loop("sync", resume_from=str(out / "every" / "step_4"))
    report = check_equals_the_truth(result)
    assert report.resumed_from.unapplied_at_save == 2 and report.resumed_from.next_skip == 2
    assert any("saved with 2 micro-batch(es) in DeepSpeed's open window" in note for note in report.notes)


def test_raise_stops_at_a_save_inside_a_window(tmp_path):
    from stepsync.core.errors import UnsafeCheckpointError

    from harness.loops import run_loop

    # epochs of whole windows: a forecast without drift, so that raise reaches the save
    result = run_loop(3 * G, G, EPOCHS, "raise", stage=2, save_to=str(tmp_path), save_every_micro_batch=True)
    assert isinstance(result.error, UnsafeCheckpointError)
    assert str(result.error).startswith("checkpoint step_1: 1 micro-batch(es) are in DeepSpeed's open window")
    assert result.loop_steps == [0, 0, 1, 1]  # the update at micro-batch 3; the save after micro-batch 4 stops


def test_a_checkpoint_saved_without_stepsync_is_not_misread(saved):
    out, _ = saved
    result = loop("warn", resume_from=str(out / "plain" / "epoch_1"))
    report = result.watch.report
    assert result.error is None and report.resumed_from is None and report.forecast is None
    # The loop's count before the resume is not in the checkpoint: the engine's (6) stands for it, and says so.
    assert (report.trainer_steps, report.engine_steps) == (6 + 4, result.engine.global_steps) == (10, 9)
    assert any("saved without stepsync: your loop's count before it is not kept there" in note
               for note in report.notes)
    assert [event.cause.name for event in report.events] == ["PARTIAL_WINDOW"]
    assert os.path.isfile(out / "warn" / "epoch_1" / "stepsync_state.json")


def test_inspect_reads_a_loops_folders_for_what_they_hold(saved):
    """``stepsync inspect`` on the example's output folder: each ``save_state`` folder's DeepSpeed step from its
    files, against the loop's count in stepsync's record (the folder's name is not read)."""
    from stepsync.tools.audit import audit_output_dir

    out, runs = saved
    warn = {item.name: item for item in audit_output_dir(str(out / "warn")).checkpoints}
    assert {name: (item.counted, item.deepspeed_step) for name, item in warn.items()} == runs["warn"].saved
    assert [name for name, item in warn.items() if item.ok] == ["step_1", "step_2", "step_3"]
    assert warn["step_8"].drift == 2 and len(warn["step_8"].mismatches) == 2  # drift, and 2 micro-batches unapplied
    assert audit_output_dir(str(out / "warn")).safe.name == "step_3"
    synced = audit_output_dir(str(out / "sync"))
    assert synced.ok and {item.name: (item.counted, item.deepspeed_step) for item in synced.checkpoints} == \
        runs["sync"].saved
    mid_window = {item.name: item for item in audit_output_dir(str(out / "every")).checkpoints}["step_4"]
    assert mid_window.drift == 0 and mid_window.mismatches == [
        "step_4 was saved with 2 micro-batch(es) in DeepSpeed's open window: DeepSpeed saves neither their gradients "
        "nor its micro-step counter, so a resume loses them: resume from a checkpoint saved with none in its open "
        "window, and save only where windows close from the start: policy='sync' (StepSyncCallback, or "
        "stepsync.watch(accelerator, policy='sync')), or accelerate >= 1.8.0"]
    plain = audit_output_dir(str(out / "plain"))
    assert [item.drift for item in plain.checkpoints] == [None] * len(runs["plain"].saved)
    assert plain.verdict().endswith("(saved without stepsync: the loop's count is not kept there)")


def test_inspect_shows_a_loops_folders_in_the_loops_columns(saved):
    """A loop's save_state folders have no trainer_state.json: the view shows the loop's count, DeepSpeed's step and
    the open window, never the Trainer's columns; each finding's explanation once."""
    from harness.cli import stepsync

    out, runs = saved
    proc = stepsync("inspect", str(out / "warn"), columns=80)
    header = proc.stdout.split("─")[0].split()
    assert header[-10:] == ["your", "loop's", "DeepSpeed", "open", "checkpoint", "updates", "step", "window", "drift",
                            "status"]
    assert "trainer_state" not in proc.stdout and "Trainer/engine" not in proc.stdout
    flat = " ".join(proc.stdout.split())
    assert flat.count("a resume inherits the drift") == 1 and flat.count("saves neither their gradients") == 1


def test_resume_settings_place_a_mid_window_save_where_the_run_stood(saved):
    """An older copy of the example saved step_8 at every micro-batch until the count changed: its last save is two
    micro-batches into epoch 3. The example resumes after 8 * G = 24 micro-batches; stepsync's record says 22."""
    import stepsync

    out, runs = saved
    folder = out / "every" / "step_8"
    settings = stepsync.resume_settings(str(folder), 1, 1, G, examples=N, loop="accelerate")
    resumed = loop("sync", resume_from=str(folder))
    # The truth: the samples of epoch 3 trained before the save (the first 22 micro-batches of the run) and after.
    before = {sample for epoch, sample in runs["every"].trained[:22] if epoch == 2}
    after = {sample for epoch, sample in resumed.trained if epoch == 2}
    every = {sample for epoch, sample in runs["every"].trained if epoch == 2}
    assert len(before) == 2 and len(every - before - after) == 2 == sum(settings.shift.skipped.values())
    assert settings.shift.skipped == {3: 2} and settings.shift.repeated == {}
    assert "the last 2 micro-batch(es) before the save were trained but were in DeepSpeed's open window" in \
        " ".join(settings.notes)


def test_a_loop_that_names_its_checkpoints_by_micro_batches(tmp_path):
    """accelerate's examples/by_feature/checkpointing.py names step_N by micro-batches and saves every K of them,
    wherever a window stands; on resume it skips N micro-batches. The watch's report continues from the record, and
    resume_settings reads the arithmetic from it: the name is the micro-batches done, not the updates."""
    import stepsync

    full = loop("sync", save_to=str(tmp_path), names_count_micro_batches=True)
    assert full.error is None and full.saved["step_12"] == (4, 4)  # epoch 2, two micro-batches into a window
    folder = str(tmp_path / "step_12")
    settings = stepsync.resume_settings(folder, 1, 1, G, examples=N, loop="accelerate")
    resumed = loop("sync", resume_from=folder, names_count_micro_batches=True)
    report = resumed.watch.report
    assert resumed.error is None and report.forecast_mismatches == [] and report.events == []
    # The truth: the loop resumes two micro-batches into epoch 2, where the record says the run stood; its updates
    # are those of the saved run up to micro-batch 12 and those after (this example keeps no count of its own).
    assert resumed.trained[0][0] == 1 and len(resumed.trained) == 2 * N - 2
    truth = (full.loop_steps[11] + resumed.loop_steps[-1], resumed.engine.global_steps)
    assert settings.shift is None and settings.lands_exactly
    assert "the last 2 micro-batch(es) before the save were trained but were in DeepSpeed's open window" in \
        settings.message()
    assert report.resumed_from.unapplied_at_save == 2 and (report.trainer_steps, report.engine_steps) == truth
    assert truth == (12, 12)
    assert not [note for note in report.notes if "your loop resumes at" in note]


def test_a_loop_that_resumes_in_another_epoch_than_its_checkpoint_is_said(tmp_path):
    """accelerate's examples/by_feature/checkpointing.py restarts its step counter at the in-epoch offset after a
    resume, so a resumed run names its folders too small: G=1, 13 micro-batches an epoch, 3 epochs; resumed from
    step_20 (epoch 2, micro-batch 7), that run's step_10 holds epoch 2, micro-batch 10, and the script, reading the
    name, resumes at epoch 1, micro-batch 10: it trains 13 micro-batches twice. The watch says so before the first
    backward, numbers the epochs as the loop runs them, and raise stops there."""
    from harness.loops import run_loop
    from stepsync.core.errors import UnsafeCheckpointError

    def resumed(policy, folder, save_to=None):
        return run_loop(13, 1, 3, policy, resume_from=str(folder), save_to=save_to, names_count_micro_batches=True)

    run_loop(13, 1, 3, "warn", save_to=str(tmp_path / "full"), names_count_micro_batches=True)
    first = resumed("warn", tmp_path / "full" / "step_20", str(tmp_path / "first"))
    assert first.saved["step_10"][1] == 23  # the truth of what the folder holds: 23 updates, 20 + 3 micro-batches
    second = resumed("warn", tmp_path / "first" / "step_10")
    # The truth, counted from the loops: 23 micro-batches were trained before that save, 39 planned.
    twice = 23 + len(second.trained) - 39
    assert twice == 13 and second.trained[0][0] == 0  # the script resumed in epoch 1 (0-based 0)
    report = second.watch.report
    said = [note for note in report.notes if note.startswith("step_10 was saved at epoch 2, after micro-batch 10")]
    assert said and "your loop resumes at epoch 1, after micro-batch 10" in said[0]
    assert f"it trains {twice} micro-batch(es) a second time" in said[0]
    assert [row.epoch for row in report.epochs] == [1, 2, 3]  # numbered as the loop ran them
    # inspect says it of the folder, once for all that are named so (the first run's folders hold epoch 2 and 3)
    from harness.cli import stepsync
    from stepsync.tools.audit import audit_output_dir

    items = {item.name: item for item in audit_output_dir(str(tmp_path / "first")).checkpoints}
    assert items["step_10"].name_places.startswith("step_10's name places a resume at epoch 1, after micro-batch 10")
    assert items["step_10"].name_places.endswith("it holds the run at epoch 2, after micro-batch 10")
    flat = " ".join(stepsync("inspect", str(tmp_path / "first")).stdout.split())
    assert flat.count("a script that places its resume by the folder's name lands there") == 1
    stopped = resumed("raise", tmp_path / "first" / "step_10")
    assert isinstance(stopped.error, UnsafeCheckpointError) and len(stopped.trained) == 1
    assert stopped.engine.global_steps == 23  # nothing applied


def test_a_resume_whose_lr_schedule_comes_back_with_it_says_nothing(saved):
    """The example prepares its scheduler before load_state, which restores it with the loop's count (scheduler.bin):
    its position is held against the count the record kept, and nothing is said."""
    out, runs = saved
    result = loop("sync", resume_from=str(out / "sync" / "epoch_1"))
    assert result.error is None and not [n for n in result.watch.report.notes if "LR schedule" in n]
    scheduler = result.accelerator._schedulers[-1].scheduler
    assert scheduler.last_epoch == result.loop_steps[-1]  # the truth: it went on from the saved count
