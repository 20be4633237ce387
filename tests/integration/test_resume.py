"""Save mid-training, resume, and end where the uninterrupted run ends: real Trainer, real DeepSpeed, CPU."""
import json

import pytest

from harness.stack import DRIFTS, needs_stack
from harness.runs import run

pytestmark = [needs_stack, pytest.mark.integration, pytest.mark.reliability("resume")]

N, G, EPOCHS = 5, 2, 3  # 3 Trainer windows per epoch, the last one partial


def save_point(result, step):
    """1-based micro-batch index of the step end that saved ``checkpoint-step``."""
    rec = result.recording
    return next(i for i in rec.trainer_updates_at if rec.trainer_steps[i - 1] == step)


def after(indices, start):
    return [i - start for i in indices if i > start]


@pytest.mark.parametrize("policy, step", [("sync", 4), ("realign", 4), ("drop_last", 3)])
def test_a_resumed_remedy_ends_where_the_uninterrupted_run_ends(tmp_path, policy, step):
    full = run(tmp_path / "full", N, G, EPOCHS, policy=policy, save_strategy="steps", save_steps=step)
    folder = tmp_path / "full" / f"checkpoint-{step}"
    resumed = run(tmp_path / "resumed", N, G, EPOCHS, policy=policy, resume_from_checkpoint=str(folder))
    assert full.error is None and resumed.error is None
    final = (full.trainer.state.global_step, full.engine.global_steps)
    assert final[0] == final[1]
    assert (resumed.trainer.state.global_step, resumed.engine.global_steps) == final
    report = resumed.callback.report
    assert (report.trainer_steps, report.engine_steps, report.drift, report.events) == (*final, 0, [])
    assert report.resumed_from.trainer_steps == report.resumed_from.engine_steps == step
    assert report.forecast_mismatches == [] and report.forecast.drift == 0
    # Not one micro-batch is trained twice or skipped: the resume starts right after the save.
    saved_at = save_point(full, step)
    if policy == "realign":
        # realign ends the run at the engine's last update. DeepSpeed restarts its windows at a resume, so that
        # update may come a micro-batch later than in the uninterrupted run; never past the data's end.
        full_after = after(full.recording.trainer_updates_at, saved_at)
        assert resumed.recording.trainer_updates_at[:len(full_after)] == full_after
        assert len(full.recording.engine_steps) - saved_at <= len(resumed.recording.engine_steps) <= N * EPOCHS - saved_at
    else:
        assert len(resumed.recording.engine_steps) == len(full.recording.engine_steps) - saved_at
        assert resumed.recording.trainer_updates_at == after(full.recording.trainer_updates_at, saved_at)
    assert all(t == e for t, e in resumed.recording.epoch_ends)
    assert (folder / "latest").read_text().strip() == f"global_step{step}"
    if policy != "realign":  # realign's windows are DeepSpeed's own; they restart at a resume
        assert resumed.recording.engine_updates_at == after(full.recording.engine_updates_at, saved_at)
    if policy == "drop_last":
        assert report.dropped_micro_batches == full.callback.report.dropped_micro_batches == {1: 1, 2: 1, 3: 1}


def test_drop_last_saves_the_count_the_trainer_resumes_from(tmp_path):
    """drop_last makes 2 updates per epoch where the Trainer plans ceil(5/2) = 3: checkpoint-3 (epoch 2 after
    one window) keeps global_step 3 in stepsync's record and 3 * 1 + 1 = 4 in trainer_state.json."""
    run(tmp_path, N, G, EPOCHS, policy="drop_last", save_strategy="steps", save_steps=3)
    state = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    from stepsync.core.record import load_record

    record = load_record(str(tmp_path / "checkpoint-3"))
    assert (state["global_step"], record.trainer_steps, record.resume_steps) == (4, 3, 4)
    assert (record.next_epoch, record.next_skip, record.unapplied_at_save) == (1, 2, 0)


def test_warn_report_covers_the_whole_run_across_a_resume(tmp_path):
    full = run(tmp_path / "full", N, G, EPOCHS, save_strategy="steps", save_steps=4)
    resumed = run(tmp_path / "resumed", N, G, EPOCHS, resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
    report = resumed.callback.report
    assert resumed.error is None
    first = full.callback.report.events[:1]
    if not DRIFTS:
        assert report.events == [] and report.drift == 0 and report.resumed_from.unapplied_at_save == 0
        return
    # The saved run's first event opens the resumed report (where it started: the full run's entry later held more
    # changes with its cause); the inherited drift is not reported twice.
    start = ("epoch", "micro_batch", "trainer_steps", "engine_steps", "cause", "where")
    assert [[getattr(e, f) for f in start] for e in report.events[:1]] == [[getattr(e, f) for f in start]
                                                                            for e in first]
    assert "INHERITED" not in [e.cause.name for e in report.events]
    assert (report.resumed_from.trainer_steps, report.resumed_from.engine_steps) == (4, 3)
    # checkpoint-4 was saved with micro-batch 7 in DeepSpeed's open window: DeepSpeed saves neither its
    # gradient nor micro_steps, so the resumed engine opens fresh windows (updates at resumed micro-batches
    # 2, 4, 6, 8 instead of 1, 3, 5, 7) and micro-batch 7's gradient is never applied.
    assert report.resumed_from.unapplied_at_save == 1
    assert after(full.recording.engine_updates_at, 7) == [1, 3, 5, 7]
    assert resumed.recording.engine_updates_at == [2, 4, 6, 8]
    assert any("are lost and the engine's windows restart here" in note for note in report.notes)
    assert (resumed.trainer.state.global_step, resumed.engine.global_steps) == (9, 7)
    assert report.forecast_mismatches == []


def test_an_unreadable_record_is_reported_and_the_run_goes_on(tmp_path):
    run(tmp_path / "full", N, G, EPOCHS, policy="sync", save_strategy="steps", save_steps=4)
    folder = tmp_path / "full" / "checkpoint-4"
    state_path = folder / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["stateful_callbacks"]["StepSyncCallback"]["attributes"]["saved_record"] = {"format": 1, "policy": "sync"}
    state_path.write_text(json.dumps(state))
    resumed = run(tmp_path / "resumed", N, G, EPOCHS, policy="sync", resume_from_checkpoint=str(folder))
    report = resumed.callback.report
    assert resumed.error is None and report.active and report.resumed_from is None
    assert any("record in the checkpoint is unreadable" in note for note in report.notes)
    assert (resumed.trainer.state.global_step, resumed.engine.global_steps, report.drift) == (9, 9, 0)


def logged_losses(result):
    """The loss of every log record this run wrote (``logging_steps=1``)."""
    history = result.trainer.state.log_history[result.recording.history_at_start:]
    return [record["loss"] for record in history if "loss" in record]


def loss_recording_trainer(losses):
    """A Trainer that keeps what each micro-batch's ``training_step`` returned: what the Trainer sums into its loss."""
    from transformers import Trainer

    class LossRecording(Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    return LossRecording


@pytest.mark.parametrize("policy, step", [
    ("drop_last", 3),
    pytest.param("realign", 4, marks=pytest.mark.skipif(not DRIFTS, reason="realign acts where the counts drift")),
])
def test_train_loss_after_a_resume_is_the_mean_of_the_windows_trained(tmp_path, policy, step):
    """Where stepsync keeps the data position's count in trainer_state.json (drop_last's checkpoint-3 says 4,
    realign's checkpoint-4 says 5), the Trainer takes the divisor of its final train_loss from that count: stepsync
    moves it with the real one, so train_loss is the summed loss of the windows this run trained over their number
    (under realign: of those the engine applied, over its updates)."""
    n, g = 10, 3
    run(tmp_path / "full", n, g, EPOCHS, stage=2, policy=policy, save_strategy="steps", save_steps=1)
    folder = tmp_path / "full" / f"checkpoint-{step}"
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == step + 1
    losses = []
    resumed = run(tmp_path / policy, n, g, EPOCHS, stage=2, policy=policy, resume_from_checkpoint=str(folder),
                  trainer_class=loss_recording_trainer(losses))
    assert resumed.error is None and len(losses) == len(resumed.recording.engine_steps)
    windows = len(resumed.recording.trainer_updates_at)  # the Trainer's own windows in this run
    train_loss = resumed.trainer.state.log_history[-1]["train_loss"]
    if policy == "realign":
        updates = resumed.recording.engine_updates_at
        assert train_loss == pytest.approx(sum(losses[:updates[-1]]) / len(updates), rel=1e-6)
        return
    assert train_loss == pytest.approx(sum(losses) / windows, rel=1e-6)  # summed in float32 by the Trainer
    if policy == "drop_last":  # every window logged once (logging_steps=1): their mean
        assert len(logged_losses(resumed)) == windows
        assert train_loss == pytest.approx(sum(logged_losses(resumed)) / windows, rel=1e-6)


@pytest.mark.skipif(not DRIFTS, reason="realign acts where the counts drift")
def test_realign_resumed_names_every_micro_batch_never_applied(tmp_path):
    """realign follows DeepSpeed's windows; a resume restarts them and a checkpoint saved inside one loses it, so the
    resumed run ends with fewer updates than the uninterrupted one: the report names each micro-batch that never
    reaches an update (lost at the save, never trained after the run's last update, trained in the last window)."""
    n, g = 10, 3
    full = run(tmp_path / "full", n, g, EPOCHS, stage=2, policy="realign", save_strategy="epoch")
    resumed = run(tmp_path / "resumed", n, g, EPOCHS, stage=2, policy="realign",
                  resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    assert (full.engine.global_steps, resumed.engine.global_steps) == (10, 9)
    report, rec = resumed.callback.report, resumed.recording
    # The truth: the engine's open window at the save, the micro-batches trained after the resume, the last update.
    assert report.resumed_from.unapplied_at_save == 1 == n - max(i for i in full.recording.engine_updates_at if i <= n)
    trained = len(rec.engine_steps)
    never_trained = (EPOCHS - 1) * n - trained
    unapplied_at_end = trained - rec.engine_updates_at[-1]
    assert (trained, never_trained, unapplied_at_end) == (19, 1, 1)
    assert report.update_flaws == [
        f"the run ends at the engine's last update (max_steps=9): the {unapplied_at_end + never_trained} micro-batch(es) "
        f"after it never reach an update ({unapplied_at_end} trained but never applied, {never_trained} never trained; "
        "fewer than G: no update would apply them)"]
    assert report.unapplied_micro_batches == unapplied_at_end
    text = str(report)
    assert f"never applied: the last {unapplied_at_end} micro-batch(es), in the engine's window that never closed" in text
    assert "saved with 1 micro-batch(es) in DeepSpeed's open window" in text


@pytest.mark.skipif(not DRIFTS, reason="needs a checkpoint that carries drift")
def test_the_start_and_the_end_agree_after_a_resume_with_inherited_drift(tmp_path):
    """A checkpoint saved without stepsync on a drifting stack (checkpoint-3 holds global_step2), resumed as inspect
    recommends (realign) or with sync: the forecast's verdict says the counts the run ends with."""
    run(tmp_path / "full", N, G, 2, policy=None, save_strategy="steps", save_steps=1)
    folder = str(tmp_path / "full" / "checkpoint-3")
    synced = run(tmp_path / "sync", N, G, 2, policy="sync", resume_from_checkpoint=folder)
    final = (synced.trainer.state.global_step, synced.engine.global_steps)
    assert final == (6, 5)
    assert synced.callback.report.forecast.verdict() == (
        "aligned: the Trainer counts 6 updates, the engine makes 5: the drift +1 inherited at the start stays, no new "
        "one under policy 'sync'")
    realigned = run(tmp_path / "realign", N, G, 2, policy="realign", resume_from_checkpoint=folder)
    report = realigned.callback.report
    assert (realigned.trainer.state.global_step, realigned.engine.global_steps) == (report.trainer_steps,
                                                                                   report.engine_steps) == (4, 4)
    verdict = report.forecast.verdict()
    # the truth: 4 of epoch 2's 5 micro-batches trained, the last of them the engine's last update
    never_trained = N - len(realigned.recording.engine_steps)
    unapplied = len(realigned.recording.engine_steps) - realigned.recording.engine_updates_at[-1]
    assert (never_trained, unapplied) == (1, 0)
    assert verdict.startswith("affected: both sides count 4 updates under policy 'realign'; the run ends at the "
                              "engine's last update (max_steps=4): the 1 micro-batch(es) after it never reach an "
                              "update (0 trained but never applied, 1 never trained")
    # The inherited drift is an event; realign taking it back at its first correction is a note, not a "+0" event.
    assert [(event.cause.name, event.drift) for event in report.events] == [("INHERITED", 1)]
    assert any("the drift +1 carried until then is taken back" in note for note in report.notes)


def test_the_record_keeps_dataloader_drop_last(tmp_path):
    """dataloader_drop_last is part of the layout a record keeps (each layout drops its own tail of every epoch):
    a resume on the same layout is exact, and nothing is said of it."""
    full = run(tmp_path / "full", N, G, EPOCHS, policy="sync", save_strategy="steps", save_steps=3,
               dataloader_drop_last=True)
    resumed = run(tmp_path / "resumed", N, G, EPOCHS, policy="sync", dataloader_drop_last=True,
                  resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    report = resumed.callback.report
    assert full.error is None and resumed.error is None and report.resume_shift is None
    assert report.resumed_from.drop_last is True and report.resumed_from.layout.drop_last


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_a_resume_that_trains_nothing_is_said_at_its_start(tmp_path, policy):
    """Resumed from the run's last checkpoint (sync: the counts agree), the Trainer has nothing left to train and
    ends with 'training finished'; stepsync says so at the start (raise stops there). Its LR schedule came back
    with the engine's count: nothing said of it."""
    from stepsync.core.errors import StepSyncError

    full = run(tmp_path / "full", N, G, EPOCHS, policy="sync", save_strategy="steps", save_steps=1)
    last = full.trainer.state.global_step
    resumed = run(tmp_path / "resumed", N, G, EPOCHS, policy=policy,
                  resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{last}"))
    assert resumed.recording.engine_steps == []  # the truth: not one micro-batch trained
    if policy == "raise":
        assert isinstance(resumed.error, StepSyncError) and "the resumed run trains nothing" in str(resumed.error)
        return
    report = resumed.callback.report
    assert resumed.error is None
    said = [note for note in report.notes if "trains nothing" in note]
    assert said == [f"the resumed run trains nothing: its checkpoint holds {last} update(s) (Trainer; the plan has "
                    f"{full.trainer.state.max_steps}), already the end of the plan: resume from an earlier checkpoint, "
                    "or raise the epochs or max_steps to train on"]
    assert not [note for note in report.notes if "LR schedule" in note]
