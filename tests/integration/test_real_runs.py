"""Real Trainer + real DeepSpeed engine on CPU, one process. Counts are asserted exactly."""
import pytest

from harness.runs import forget_deepspeed, record_losses, run
from harness.stack import DRIFTS, expected_counts, needs_stack

pytestmark = [needs_stack, pytest.mark.integration]

CASES = [(3, 2, 2, 0), (3, 2, 2, 1), (3, 2, 2, 2), (3, 2, 2, 3), (5, 2, 2, 0), (7, 3, 2, 0), (5, 4, 3, 0)]


def forecast_counts(result):
    rows = result.callback.report.forecast.epochs
    return [(r.trainer_steps, r.engine_steps) for r in rows]


@pytest.mark.parametrize("n, g, epochs, stage", CASES)
def test_warn_reports_the_real_drift(tmp_path, n, g, epochs, stage):
    result = run(tmp_path, n, g, epochs, stage)
    assert result.error is None
    trainer, engine = expected_counts(n, g, epochs)
    report = result.callback.report
    assert (result.trainer.state.global_step, result.engine.global_steps) == (trainer, engine)
    assert (report.trainer_steps, report.engine_steps, report.drift) == (trainer, engine, trainer - engine)
    # The forecast equals what the engine's real counters showed at every epoch end.
    assert forecast_counts(result) == result.recording.epoch_ends
    assert report.forecast.aligned == (not DRIFTS)
    assert report.forecast_mismatches == []
    if DRIFTS:
        first = report.events[0]
        assert (first.epoch, first.micro_batch, first.where, first.cause.name) == (1, n, "step_end", "PARTIAL_WINDOW")
        assert (first.trainer_steps, first.engine_steps) == (-(-n // g), n // g)
        assert [e.drift for e in report.events] == sorted({e.drift for e in report.events})
    else:
        assert report.events == []


def test_seed_case_first_divergence(tmp_path):
    result = run(tmp_path, 3, 2, 2)
    report = result.callback.report
    if DRIFTS:
        assert [(e.epoch, e.micro_batch, e.trainer_steps, e.engine_steps) for e in report.events] == [(1, 3, 2, 1)]
        assert (report.trainer_steps, report.engine_steps) == (4, 3)
        assert not report.schedule_finished
    else:
        assert report.events == [] and report.drift == 0


def test_every_log_record_carries_the_metrics(tmp_path):
    from transformers import TrainerCallback

    seen = []

    class Reporter(TrainerCallback):  # sits where report_to integrations sit: before user callbacks
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    result = run(tmp_path, 3, 2, 2, extra_callbacks=[Reporter()])
    keys = {"stepsync/trainer_steps", "stepsync/engine_steps", "stepsync/drift"}
    history = result.trainer.state.log_history
    assert len(history) == 5 and len(seen) == 5
    for record in history + seen:
        assert keys <= set(record)
        assert record["stepsync/drift"] == record["stepsync/trainer_steps"] - record["stepsync/engine_steps"]
    assert history[-1]["stepsync/drift"] == (1 if DRIFTS else 0)
    assert [r["stepsync/engine_steps"] for r in seen] == [r["stepsync/engine_steps"] for r in history]


def test_raise_stops_before_the_first_micro_batch_where_the_forecast_drifts(tmp_path):
    from stepsync import StepDriftError

    result = run(tmp_path, 3, 2, 2, policy="raise")
    if DRIFTS:
        assert isinstance(result.error, StepDriftError) and isinstance(result.error, RuntimeError)
        assert (result.trainer.state.global_step, result.engine.global_steps, result.engine.micro_steps) == (0, 0, 0)
        event = result.error.event  # the first drift the forecast predicts
        assert (event.epoch, event.micro_batch, event.where) == (1, 3, "forecast")
        assert str(result.error).startswith("the forecast: affected: the Trainer counts 4 updates, the engine makes 3")
        assert "global_step=2" in str(result.error) and "global_steps=1" in str(result.error)
        assert "policy='sync'" in str(result.error)
    else:
        assert result.error is None and result.trainer.state.global_step == 4


def test_trainer_without_deepspeed_is_watched_against_its_optimizer(tmp_path):
    """No DeepSpeed: the run is watched all the same, its count held against its optimizer's steps (the checks
    against the parameters themselves are tests/integration/test_without_deepspeed.py)."""
    forget_deepspeed()  # earlier runs in this process left DeepSpeed switched on
    result = run(tmp_path, 3, 2, 2, deepspeed=False, use_cpu=True)
    report = result.callback.report
    assert result.error is None and result.trainer.state.global_step == 4
    assert (report.active, report.updater, report.trainer_steps, report.engine_steps) == (True, "optimizer", 4, 4)
    assert report.events == [] and report.forecast.aligned and report.finished
    logged = [(r["stepsync/trainer_steps"], r["stepsync/engine_steps"]) for r in result.trainer.state.log_history]
    assert logged == [(1, 1), (2, 2), (3, 3), (4, 4), (4, 4)]


def test_trainer_subclass_is_found(tmp_path):
    from transformers import Trainer

    class MyTrainer(Trainer):
        def train(self, *args, **kwargs):
            return super().train(*args, **kwargs)

    result = run(tmp_path, 3, 2, 2, trainer_class=MyTrainer)
    assert result.callback.report.active
    assert result.callback.report.drift == (1 if DRIFTS else 0)


@pytest.mark.parametrize("n, g, epochs, stage", [(3, 2, 2, 0), (3, 2, 2, 2), (3, 2, 2, 3), (7, 3, 2, 0), (5, 4, 3, 0)])
def test_sync_makes_the_engine_update_where_the_trainer_counts(tmp_path, n, g, epochs, stage):
    result = run(tmp_path, n, g, epochs, stage, policy="sync")
    trainer, _ = expected_counts(n, g, epochs)
    rec = result.recording
    assert result.error is None
    assert rec.engine_updates_at == rec.trainer_updates_at
    assert (result.trainer.state.global_step, result.engine.global_steps) == (trainer, trainer)
    assert all(t == e for t, e in rec.epoch_ends)
    assert result.callback.report.events == []
    assert forecast_counts(result) == rec.epoch_ends
    if DRIFTS:  # the engine decides by itself again after training (accelerate >= 1.8 sets it itself)
        assert result.engine._is_gradient_accumulation_boundary is None


def test_sync_runs_the_schedule_to_its_planned_end(tmp_path):
    synced = run(tmp_path / "s", 3, 2, 2, policy="sync")
    watched = run(tmp_path / "w", 3, 2, 2, policy="warn")
    from harness.runs import _last_lr

    scheduler = synced.engine.lr_scheduler
    assert scheduler.last_batch_iteration + 1 == synced.trainer.state.max_steps == 4
    if DRIFTS:
        assert watched.engine.lr_scheduler.last_batch_iteration + 1 == 3  # a schedule that never finished
    assert _last_lr(synced) == pytest.approx(0.005)


@pytest.mark.parametrize("n, g, epochs, stage", [(3, 2, 2, 0), (3, 2, 2, 2), (3, 2, 2, 3), (7, 3, 2, 0), (5, 4, 3, 0)])
def test_realign_makes_the_trainer_follow_the_engine(tmp_path, n, g, epochs, stage):
    result = run(tmp_path, n, g, epochs, stage, policy="realign", save_strategy="steps", save_steps=1)
    _, engine = expected_counts(n, g, epochs)
    rec = result.recording
    assert result.error is None
    for index in rec.trainer_updates_at:
        assert rec.trainer_steps[index - 1] == rec.engine_steps[index - 1]
    assert (result.trainer.state.global_step, result.engine.global_steps) == (engine, engine)
    steps = [record["step"] for record in result.trainer.state.log_history if "loss" in record]
    assert steps == sorted(set(steps)) == list(range(1, engine + 1))  # one record per real update
    import os

    checkpoints = sorted(int(d.split("-")[1]) for d in os.listdir(tmp_path) if d.startswith("checkpoint-"))
    assert checkpoints == list(range(1, engine + 1))
    for step in checkpoints:
        assert open(tmp_path / f"checkpoint-{step}" / "latest").read().strip() == f"global_step{step}"


@pytest.mark.parametrize("n, g, epochs, stage", [(3, 2, 2, 0), (3, 2, 2, 2), (3, 2, 2, 3), (7, 3, 2, 0), (5, 4, 3, 0)])
def test_drop_last_trains_only_full_windows(tmp_path, n, g, epochs, stage):
    result = run(tmp_path, n, g, epochs, stage, policy="drop_last")
    report = result.callback.report
    full = (n // g) * g
    assert result.error is None
    # Whole micro-batches are kept: the user's dataloader_drop_last (which also drops evaluation batches) stays.
    assert result.trainer.args.dataloader_drop_last is False
    assert len(result.recording.engine_steps) == epochs * full
    assert (result.trainer.state.global_step, result.engine.global_steps) == (epochs * (n // g),) * 2
    assert report.dropped_micro_batches == {e: n - full for e in range(1, epochs + 1)}
    assert forecast_counts(result) == result.recording.epoch_ends


@pytest.mark.reliability("bad_input")
def test_drop_last_refuses_epochs_shorter_than_a_window(tmp_path):
    from stepsync import StepSyncConfigError

    result = run(tmp_path, 3, 4, 2, policy="drop_last")
    assert isinstance(result.error, StepSyncConfigError)
    assert "lower gradient_accumulation_steps" in str(result.error)
    assert result.recording.engine_steps == []  # refused before any micro-batch ran


@pytest.mark.reliability("fault")
def test_a_failing_engine_switches_stepsync_off_not_the_run(tmp_path):
    from transformers import TrainerCallback

    class BreakEngine(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            if state.epoch and state.epoch >= 1:
                holder["callback"]._run.engine = object()  # counters disappear mid-run

    holder = {}
    from stepsync import StepSyncCallback
    from harness.runs import run_tiny

    callback = StepSyncCallback("sync", console=False)
    holder["callback"] = callback
    result = run_tiny(str(tmp_path), samples=3, gas=2, epochs=2, callback=callback, extra_callbacks=[BreakEngine()])
    assert result.error is None and result.trainer.state.global_step == 4
    assert not callback.report.active and "internal error" in callback.report.inactive_reason
    if DRIFTS:
        assert result.engine._is_gradient_accumulation_boundary is None  # restored on the way out


@pytest.mark.reliability("resume")
def test_resumed_drifted_checkpoint_reports_inherited_drift(tmp_path):
    first = run(tmp_path, 3, 2, 2, policy=None, save_strategy="steps", save_steps=4)
    assert first.error is None
    checkpoint = tmp_path / "checkpoint-4"
    assert (checkpoint / "latest").read_text().strip() == ("global_step3" if DRIFTS else "global_step4")
    resumed = run(tmp_path, 3, 2, 3, resume_from_checkpoint=str(checkpoint))
    report = resumed.callback.report
    assert resumed.error is None
    if DRIFTS:
        inherited = report.events[0]
        assert (inherited.where, inherited.cause.name, inherited.trainer_steps, inherited.engine_steps) == (
            "train_begin", "INHERITED", 4, 3)
        assert report.inherited_drift == 1
    else:
        assert report.inherited_drift == 0
    assert forecast_counts(resumed) == resumed.recording.epoch_ends


def test_realign_logs_the_mean_loss_of_the_windows_it_merges(tmp_path):
    """realign moves the Trainer's count back at an epoch's partial window; the next logged loss covers two of
    the Trainer's windows and must be their mean, as the Trainer logs without stepsync (never their sum)."""
    def losses(policy):
        result = run(tmp_path / policy, 5, 2, 3, policy=policy)
        assert result.error is None
        return [record["loss"] for record in result.trainer.state.log_history if "loss" in record]

    windows = losses("warn")  # logging_steps=1: one loss per Trainer window, 3 per epoch
    realigned = losses("realign")
    if DRIFTS:  # the partial window of epoch 1 is logged with the next one; the run ends at the engine's 7th
        expected = windows[:2] + [(windows[2] + windows[3]) / 2] + windows[4:8]
    else:
        expected = windows
    assert realigned == pytest.approx(expected, rel=1e-5)


def test_an_aligned_run_with_nothing_found_ends_with_the_verdict_alone(tmp_path):
    """N=4, G=2: no drift on any stack, and the tiny data's micro-batches hold equal numbers of tokens, so the loss
    normalisation cannot be named: that is in the report's not_checked, not a note in every summary."""
    import io

    from rich.console import Console

    from stepsync.display.render import summary_view

    result = run(tmp_path, 4, 2, 2)
    report = result.callback.report
    assert result.error is None and report.drift == 0 and report.notes == []
    assert any(line.startswith("loss normalisation: not named") for line in report.not_checked)
    assert "note:" not in str(report) and "loss normalisation" not in str(report)
    shown = io.StringIO()
    Console(file=shown, width=100).print(summary_view(report))
    assert "note:" not in shown.getvalue() and "loss normalisation" not in shown.getvalue()


@pytest.mark.parametrize("resumed", [False, True])
def test_realign_train_loss_is_the_mean_over_the_updates_the_engine_applied(tmp_path, resumed):
    """N=7, G=3, 2 epochs: realign ends at the Trainer's boundary after the engine's last update, with a micro-batch
    trained but never applied. The Trainer's train_loss is the mean over the updates the engine applied of what their
    micro-batches backpropagated, as a recorder of every micro-batch's loss counts it (the Trainer summed the one
    never applied too, over its own windows), fresh and resumed from checkpoint-2."""
    start = None
    if resumed:
        run(tmp_path / "full", 7, 3, 2, policy="realign", save_strategy="steps", save_steps=1)
        start = str(tmp_path / "full" / "checkpoint-2")
    seen = []
    result = run(tmp_path / "run", 7, 3, 2, policy="realign", resume_from_checkpoint=start,
                 on_trainer=lambda trainer: record_losses(trainer, seen))
    assert result.error is None
    engine_at_start = result.recording.engine_at_start
    counts = [engine_at_start] + [engine for _, engine in seen]
    last_update = max(i for i in range(1, len(counts)) if counts[i] != counts[i - 1])
    applied = sum(loss for loss, _ in seen[:last_update])
    truth = applied / (counts[-1] - engine_at_start)
    reported = result.trainer.state.log_history[-1]["train_loss"]
    assert reported == pytest.approx(truth, rel=1e-6, abs=1e-6)
    if DRIFTS:  # there were micro-batches after the engine's last update, and they are not in it
        assert last_update < len(seen)
