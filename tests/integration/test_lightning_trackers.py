"""Lightning's loggers get stepsync's findings: a real Lightning + DeepSpeed fit on CPU that logs to TensorBoard,
MLflow and W&B (offline) through Lightning's own loggers, read back with each tracker's own reader
(tests/harness/trackers.py) and held against an independent recorder of both counts (harness/lightning_runs.py).

The fit drifts (5 micro-batches an epoch, G=2: Lightning closes each epoch's partial window, DeepSpeed's counter runs
across epochs) and the third micro-batch of every epoch is not finite in bf16, which DeepSpeed 0.19.8 skips on
ZeRO-2: a finding beyond the counts."""
import json

import pytest

pytest.importorskip("lightning")
for _name in ("tensorboard", "mlflow", "wandb"):
    pytest.importorskip(_name)

from harness.lightning_runs import run_lightning  # noqa: E402
from harness.trackers import mlflow_run, tensorboard, tracker_environment, wandb_summary_and_alerts  # noqa: E402
from stepsync.core.tracking import forecast_text  # noqa: E402
from stepsync.lightning import StepSyncCallback  # noqa: E402

pytestmark = pytest.mark.integration


def test_lightning_s_loggers_get_the_metrics_the_texts_and_the_alerts(tmp_path, monkeypatch):
    import torch
    import wandb
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    import stepsync.tools.tiny_lightning as tiny

    for key, value in tracker_environment(tmp_path).items():
        monkeypatch.setenv(key, value)

    def loader(samples):  # the third micro-batch's row is not finite: its gradient neither
        rows = torch.eye(samples)
        rows[2] *= float("nan")
        return torch.utils.data.DataLoader(rows, batch_size=1)

    monkeypatch.setattr(tiny, "one_hot_loader", loader)
    loggers = [TensorBoardLogger(str(tmp_path / "tb"), name="fit"),
               MLFlowLogger(experiment_name="fit", tracking_uri=f"file://{tmp_path}/mlruns"),
               WandbLogger(project="fit", save_dir=str(tmp_path), offline=True)]
    callback = StepSyncCallback("warn", console=False)
    try:
        result = run_lightning(5, 2, 2, 2, callback, precision="bf16-mixed", logger=loggers, log_every_n_steps=1)
    finally:
        wandb.finish()
        wandb.teardown()
    assert result.error is None
    report = callback.report
    engine = result.engine
    assert (engine.global_steps, engine.skipped_steps) == (5, 2)  # DeepSpeed's own counters
    # The recorder's (Lightning's count, the engine's) at each batch where Lightning counted an update: Lightning
    # logs there (log_every_n_steps=1).
    batches = result.recording.batches
    truth = [(steps, steps - engine_steps) for index, (_, _, _, steps, engine_steps, _) in enumerate(batches)
             if steps != (batches[index - 1][3] if index else 0)]
    assert truth == [(1, 0), (2, 0), (3, 0), (4, 0)]
    # Lightning logs at its updates, at the step before its count; stepsync adds the end: the engine's 5th update
    # came after Lightning's last (its windows run across the epochs)
    logged = [(steps - 1, drift) for steps, drift in truth] + [(4, 4 - 5)]

    scalars, texts = tensorboard(tmp_path / "tb")
    assert scalars["stepsync/drift"] == [(step, float(drift)) for step, drift in logged]
    assert scalars["stepsync/updates_skipped"] == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0)]  # from the first skip
    assert [text for _, text in texts["stepsync/forecast/text_summary"]] == [
        "\n".join("    " + line for line in forecast_text(report.forecast).splitlines())]
    assert [text for _, text in texts["stepsync/summary/text_summary"]] == [
        "\n".join("    " + line for line in str(report).splitlines())]

    client, run = mlflow_run(tmp_path)
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "stepsync/drift")]
    assert history == scalars["stepsync/drift"]
    stored = client.download_artifacts(run.info.run_id, "stepsync", str(tmp_path / "artifacts"))
    with open(f"{stored}/summary.txt") as handle:
        assert handle.read() == str(report)

    summary, alerts = wandb_summary_and_alerts(tmp_path)
    assert json.loads(summary["stepsync/summary"]) == str(report)
    said = [note for note in report.notes if note.startswith("the engine skipped")]
    assert [(title, text) for title, text, _ in alerts if title == "stepsync: skipped update"] == [
        ("stepsync: skipped update", said[0])]


def test_fabric_s_loggers_get_the_metrics_at_each_finding_each_epoch_end_and_the_end(tmp_path):
    """Fabric's loop logs only when its user does: stepsync sends its metrics to Fabric's loggers itself. Fabric's
    documented accumulation loop (5 micro-batches an epoch, G=2) on DeepSpeed: its optimizer.step() bypasses the
    engine's step(), whose count stays at 0 (a drift that grows at each update, said once where it starts)."""
    from lightning.fabric.loggers import TensorBoardLogger

    from harness.lightning_runs import run_fabric

    logger = TensorBoardLogger(str(tmp_path / "tb"), name="fabric")
    result = run_fabric(5, 2, 2, loggers=[logger])
    logger.finalize("success")
    assert result.error is None
    report = result.watch.report
    drifts = [(steps, steps - engine) for _, _, steps, engine in result.batches]  # the loop's own record
    first = next(row for row in drifts if row[1])
    ends = [row for row, (_, batch_idx, _, _) in zip(drifts, result.batches) if batch_idx == 4]
    assert (first, ends) == ((1, 1), [(2, 2), (4, 4)])
    scalars, texts = tensorboard(tmp_path / "tb")
    # where the drift is found, at each epoch end, then at the end
    assert scalars["stepsync/drift"] == [(step, float(drift)) for step, drift in [first, *ends, ends[-1]]]
    assert scalars["stepsync/micro_batches_unapplied"] == [(4, 10.0)]  # the engine's window that never closed
    assert [text for _, text in texts["stepsync/summary/text_summary"]] == [
        "\n".join("    " + line for line in str(report).splitlines())]
