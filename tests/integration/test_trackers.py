"""Findings where users look: real runs that log to TensorBoard, MLflow and W&B (offline), read back with each
tracker's own reader (tests/harness/trackers.py), held against a recorder of the engine's counters of its own.

The runs drift (7 micro-batches an epoch, G=2, accelerate < 1.8: the Trainer's count runs ahead by one an epoch) and
one micro-batch's loss is NaN, which DeepSpeed 0.19.8 skips on ZeRO-2 in fp32: a finding beyond the counts. The
Trainer's run follows transformers' ``integrations/integration_utils.py`` (its ``report_to`` callbacks), the
accelerate loop transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py`` with ``--with_tracking``.
"""
import json
import os

import pytest

from harness.stack import DRIFTS, needs_stack
from harness.trackers import mlflow_run, tensorboard, tracker_environment, wandb_summary_and_alerts

pytestmark = [needs_stack, pytest.mark.integration]

TRACKERS = ("tensorboard", "mlflow", "wandb")


@pytest.fixture
def trackers(tmp_path, monkeypatch):
    for name in TRACKERS:
        pytest.importorskip(name)
    for key, value in tracker_environment(tmp_path).items():
        monkeypatch.setenv(key, value)
    yield tmp_path
    import mlflow
    import wandb

    wandb.finish()  # the offline run's file is complete once its run ends
    wandb.teardown()  # W&B keeps its settings (WANDB_DIR) for the process until then
    mlflow.end_run()


def as_code(text):
    """A text as TensorBoard's text plugin keeps it from stepsync: indented, a block of code."""
    return "\n".join("    " + line for line in text.splitlines())


def engine_counts(folder):
    """A Trainer callback of the test's own: at each log, the Trainer's count and the engine's counters; at the
    first, the texts TensorBoard holds by then under ``folder``."""
    from transformers import TrainerCallback

    class Counts(TrainerCallback):
        rows = []
        trainer = None
        texts_at_first_log = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            engine = Counts.trainer.model_wrapped
            Counts.rows.append((state.global_step, engine.global_steps, engine.skipped_steps))
            if Counts.texts_at_first_log is None:
                Counts.texts_at_first_log = sorted(tensorboard(folder)[1])

    return Counts


def test_the_trainer_s_findings_reach_tensorboard_mlflow_and_wandb(trackers):
    from harness.nonfinite import nan_trainer
    from harness.runs import run

    counts = engine_counts(trackers)
    result = run(trackers, 7, 2, 2, stage=2, report_to=list(TRACKERS), trainer_class=nan_trainer(3),
                 extra_callbacks=[counts()], on_trainer=lambda trainer: setattr(counts, "trainer", trainer))
    assert result.error is None
    report = result.callback.report
    truth = counts.rows  # one row per log: the update logs (logging_steps=1) and the closing one
    assert [steps for steps, *_ in truth] == [1, 2, 3, 4, 5, 6, 7, 8, 8]
    assert truth[-1][1:] == (7 if DRIFTS else 8, 1)  # the engine made 7 updates (8 with accelerate's fix), skipped 1
    drift = [(steps, steps - engine) for steps, engine, _ in truth]
    skipped = [(steps, skips) for steps, _, skips in truth if skips]

    # the forecast is there from the first log on, not only at the end
    assert "stepsync/forecast/text_summary" in counts.texts_at_first_log
    scalars, texts = tensorboard(trackers)
    assert scalars["train/stepsync/drift"] == [(step, float(value)) for step, value in drift]
    assert scalars["train/stepsync/updates_skipped"] == [(step, float(value)) for step, value in skipped]
    assert texts["stepsync/forecast/text_summary"] == [(0, as_code(forecast_text(report)))]
    assert texts["stepsync/summary/text_summary"] == [(8, as_code(str(report)))]

    client, mlflow_run_info = mlflow_run(trackers)
    run_id = mlflow_run_info.info.run_id
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "stepsync/drift")]
    assert history == [(step, float(value)) for step, value in drift]
    stored = client.download_artifacts(run_id, "stepsync", str(trackers / "artifacts"))
    with open(os.path.join(stored, "summary.txt")) as handle:
        assert handle.read() == str(report)
    with open(os.path.join(stored, "forecast.txt")) as handle:
        assert handle.read() == forecast_text(report)

    import wandb

    wandb.finish()
    summary, alerts = wandb_summary_and_alerts(trackers)
    assert json.loads(summary["stepsync/summary"]) == str(report)
    assert json.loads(summary["stepsync/forecast"]) == forecast_text(report)
    assert json.loads(summary["train/stepsync/drift"]) == drift[-1][1]
    said = [note for note in report.notes if note.startswith("the engine skipped")]
    assert len(said) == 1
    expected = [("stepsync: skipped update", said[0], "WARN")]
    if DRIFTS:
        expected.insert(0, ("stepsync: drift (partial window at an epoch end)", report.events[0].message(), "WARN"))
    assert sorted(alerts) == sorted(expected)  # each once, with the terminal's words


def forecast_text(report):
    from stepsync.core.tracking import forecast_text as text

    return text(report.forecast)


def test_an_accelerate_loop_s_findings_reach_the_trackers_it_initialised(trackers):
    from harness.loops import run_loop

    result = run_loop(7, 2, 2, stage=2, nan_at=3, log_with=list(TRACKERS), project_dir=str(trackers))
    assert result.error is None
    report = result.watch.report
    truth = list(zip(result.loop_steps, result.engine_steps))  # the loop's count and the engine's, each micro-batch
    updates = [(loop, loop - engine) for index, (loop, engine) in enumerate(truth)
               if loop and (index == 0 or truth[index - 1][0] != loop)]  # logged at each update the loop counts
    assert updates[-1] == (8, 1 if DRIFTS else 0)

    scalars, texts = tensorboard(trackers)
    assert scalars["stepsync/drift"] == [(step, float(value)) for step, value in updates]
    skips = scalars["stepsync/updates_skipped"]
    assert {value for _, value in skips} == {1.0} and skips[0][0] == 2  # from the update the engine skipped
    assert texts["stepsync/forecast/text_summary"] == [(0, as_code(forecast_text(report)))]
    assert texts["stepsync/summary/text_summary"] == [(8, as_code(str(report)))]

    client, mlflow_run_info = mlflow_run(trackers)
    history = [(m.step, m.value) for m in client.get_metric_history(mlflow_run_info.info.run_id, "stepsync/drift")]
    assert history == [(step, float(value)) for step, value in updates]

    summary, alerts = wandb_summary_and_alerts(trackers)
    assert json.loads(summary["stepsync/summary"]) == str(report)
    assert ("stepsync: skipped update" in {title for title, _, _ in alerts})


def test_a_raw_engine_loop_sends_to_the_trackers_it_hands_the_watch(trackers):
    """DeepSpeed-Chat's loop (backward() and step() on every micro-batch): the watch is handed a SummaryWriter,
    mlflow on its active run, a wandb run and a callable; each gets the metrics at each finding, each epoch end and
    the end, the texts once, and W&B the alerts."""
    import mlflow
    import wandb
    from torch.utils.tensorboard import SummaryWriter

    from harness.raw_loops import run_chat_loop

    writer = SummaryWriter(str(trackers / "tb"))
    mlflow.start_run()
    run = wandb.init(project="stepsync")
    got = []
    result = run_chat_loop(7, 2, 2, stage=2, policy="warn", nan_at=3,
                           tracker=[writer, mlflow, run, lambda values, step: got.append((step, values))])
    writer.close()
    report = result.watch.report
    assert result.error is None and report.engine_skipped == 1
    assert result.epoch_ends == [3, 7]  # the engine counts its own windows of 2, across epochs
    numbers = [(step, values) for step, values in got if "stepsync/drift" in values]
    texts = [(step, values) for step, values in got if "stepsync/drift" not in values]
    # the skip (found at the update after it), the drift's change, each epoch end, the end
    assert [step for step, _ in numbers] == sorted(step for step, _ in numbers)
    assert numbers[-1] == (report.trainer_steps, result.watch.metrics())
    assert all(values["stepsync/updates_skipped"] == 1 for step, values in numbers if step >= 2)
    assert texts == [(0, {"stepsync/forecast": forecast_text(report)}),
                     (report.trainer_steps, {"stepsync/summary": str(report)})]

    scalars, tb_texts = tensorboard(trackers / "tb")
    assert scalars["stepsync/drift"] == [(step, float(values["stepsync/drift"])) for step, values in numbers]
    assert tb_texts["stepsync/summary/text_summary"] == [(report.trainer_steps, as_code(str(report)))]
    client, mlflow_run_info = mlflow_run(trackers)
    history = [(m.step, m.value) for m in client.get_metric_history(mlflow_run_info.info.run_id, "stepsync/drift")]
    assert history == scalars["stepsync/drift"]
    wandb.finish()
    summary, alerts = wandb_summary_and_alerts(trackers)
    assert json.loads(summary["stepsync/summary"]) == str(report)
    assert sorted(title for title, _, _ in alerts) == ["stepsync: drift (partial window at an epoch end)",
                                                       "stepsync: skipped update"]
