"""What stepsync hands a run's tracker (TensorBoard, MLflow, W&B, a callable): every finding as a metric with a
stable name, the forecast and the summary as text. One table names them all; ``docs/trackers.md`` prints it and
``tests/unit/test_tracking.py`` holds both to what the code logs."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, NamedTuple, Optional, Tuple

from .prediction import SHOWN_EPOCHS, shown_epochs

if TYPE_CHECKING:  # pragma: no cover
    from .prediction import Forecast
    from .report import SyncReport


class Metric(NamedTuple):
    """One metric: its name in every tracker, what it counts, and when it moves."""

    name: str
    means: str
    moves: str


# The three counts each framework logs (``Framework.metric_keys``), then the findings, logged from the first one on.
COUNTS: Tuple[Metric, ...] = (
    Metric("stepsync/trainer_steps", "the Trainer's count of updates (`state.global_step`)",
           "at each update it counts"),
    Metric("stepsync/lightning_steps", "Lightning's count of updates (`trainer.global_step`)",
           "at each update it counts"),
    Metric("stepsync/loop_steps", "your loop's updates: the windows it closed with step()",
           "at each update it counts"),
    Metric("stepsync/engine_steps", "DeepSpeed's updates (`engine.global_steps`, the LR schedule's count)",
           "at each update the engine makes"),
    Metric("stepsync/optimizer_steps", "the torch optimizer's steps, in a run without DeepSpeed",
           "at each optimizer step"),
    Metric("stepsync/drift", "the framework's count less the updates made: 0 when they agree",
           "where the two counts part or meet"),
)
FINDINGS: Tuple[Metric, ...] = (
    Metric("stepsync/updates_skipped", "updates the engine counted and did not apply (its `skipped_steps`)",
           "at each skipped update"),
    Metric("stepsync/non_finite_at_update", "the update after which the weights were first found not finite",
           "once, where they are found"),
    Metric("stepsync/ranks_apart_at_update", "the update at or before which the ranks' copies of the weights parted",
           "once, at the comparison that finds it"),
    Metric("stepsync/micro_batches_lost", "micro-batches an update left out (several backward() per step())",
           "at each update that loses some"),
    Metric("stepsync/updates_unsynced", "updates whose gradients were not their window's (where the sync was on)",
           "at each such update"),
    Metric("stepsync/windows_dropped", "windows cleared with zero_grad() and no update", "at each dropped window"),
    Metric("stepsync/micro_batches_dropped", "micro-batches policy 'drop_last' left untrained",
           "at each epoch end that drops some"),
    Metric("stepsync/micro_batches_unapplied", "micro-batches the engine accumulated and never applied",
           "at the end of training"),
    Metric("stepsync/update_flaws", "what each update's micro-batch weights get wrong, by kind (each said in the "
           "summary)", "at the start, or at the epoch end whose counts show one"),
    Metric("stepsync/token_weight_ratio", "the heaviest trained token's weight over the lightest's, in the first "
           "window whose micro-batches differ in tokens", "once, at that window"),
    Metric("stepsync/token_weighting_unexpected", "1 where that window's tokens were not weighed by the rule you "
           "declared (`loss_normalisation`)", "once, at that window"),
    Metric("stepsync/gradient_clipping", "the clip norm the engine applies, where it is not the one asked",
           "at the start"),
    Metric("stepsync/gradient_accumulation_steps", "the micro-batches per update the engine applies, where it is not "
           "the G asked", "at the start"),
    Metric("stepsync/samples_skipped", "samples a resume on another layout skips", "at the start of a resumed run"),
    Metric("stepsync/samples_repeated", "samples a resume on another layout trains twice",
           "at the start of a resumed run"),
    Metric("stepsync/corrections", "times policy 'realign' set the framework's count to the engine's",
           "at each correction"),
)
METRICS: Tuple[Metric, ...] = COUNTS + FINDINGS

# The texts, each sent once: the forecast as training starts, the summary as it ends.
FORECAST_TEXT = "stepsync/forecast"
SUMMARY_TEXT = "stepsync/summary"


def finding_metrics(report: SyncReport) -> Dict[str, float]:
    """Each finding of ``report`` that has something to say, by its metric's name: the counts once above 0, a
    resume's shift where it is not exact, the rest once found (nothing for a clean run: the framework's logs stay
    as they were)."""
    shift, weighting = report.resume_shift, report.token_weighting
    if not (report.engine_skipped or report.lost_micro_batches or report.updates_unsynced or report.windows_dropped
            or report.dropped_micro_batches or report.unapplied_micro_batches or report.weight_faults
            or report.update_flaws or report.corrections or report.non_finite or report.ranks_apart
            or weighting is not None or report.clip_in_force is not None or report.g_in_force is not None
            or (shift is not None and not shift.exact)):
        return {}  # most logs of most runs: asked at every logging step, answered without building anything
    counted = (("stepsync/updates_skipped", report.engine_skipped),
               ("stepsync/micro_batches_lost", report.lost_micro_batches),
               ("stepsync/updates_unsynced", report.updates_unsynced),
               ("stepsync/windows_dropped", report.windows_dropped),
               ("stepsync/micro_batches_dropped", sum(report.dropped_micro_batches.values())),
               ("stepsync/micro_batches_unapplied", report.unapplied_micro_batches),
               ("stepsync/update_flaws", len(report.weight_faults) + len(report.update_flaws)),
               ("stepsync/corrections", report.corrections))
    found: Dict[str, float] = {name: value for name, value in counted if value}
    if shift is not None and not shift.exact:  # both, a 0 included: the shift is one finding
        found.update({"stepsync/samples_skipped": sum(shift.skipped.values()),
                      "stepsync/samples_repeated": sum(shift.repeated.values())})
    for name, value in (
            ("stepsync/non_finite_at_update", report.non_finite.engine_steps if report.non_finite else None),
            ("stepsync/ranks_apart_at_update", report.ranks_apart.engine_steps if report.ranks_apart else None),
            ("stepsync/token_weight_ratio", weighting.ratio if weighting is not None else None),
            ("stepsync/token_weighting_unexpected", int(not weighting.as_expected) if weighting is not None else None),
            ("stepsync/gradient_clipping", report.clip_in_force),
            ("stepsync/gradient_accumulation_steps", report.g_in_force)):
        if value is not None:
            found[name] = value
    return found


def run_metrics(report: SyncReport, counted: int, made: Optional[int] = None) -> Dict[str, float]:
    """Every metric of ``report`` now: the framework's count (``counted``), the updates made (``made``; default the
    report's), the drift, and each finding (:func:`finding_metrics`)."""
    made = report.engine_steps if made is None else made
    counted_key, made_key, drift_key = report.framework.metric_keys
    if report.updater == "optimizer":  # a run without DeepSpeed: the updates are its optimizer's steps
        made_key = "stepsync/optimizer_steps"
    return {counted_key: counted, made_key: made, drift_key: counted - made, **finding_metrics(report)}


def forecast_text(forecast: Forecast) -> str:
    """The forecast in plain lines: what it rests on, each epoch's counts (the rows its table shows), its
    verdict."""
    plan, who = forecast.plan, forecast.behaviour.framework.who
    lines = [f"stepsync forecast: N={plan.micro_batches_per_epoch} micro-batches/epoch, "
             f"G={plan.gradient_accumulation_steps}, policy '{forecast.policy.value}'",
             f"{'epoch':>6} {who + ' steps':>16} {'engine steps':>13} {'drift':>6}"]
    shown = shown_epochs(forecast)
    for index, row in enumerate(shown):
        if index == SHOWN_EPOCHS // 2 and len(shown) < len(forecast.epochs):
            lines.append(f"{'...':>6}")
        lines.append(f"{row.epoch:>6} {row.trainer_steps:>16} {row.engine_steps:>13} {row.drift:>+6d}")
    lines.append(forecast.verdict())
    return "\n".join(lines)


def summary_text(report: SyncReport) -> str:
    """The report at the end, in the lines ``print(report)`` gives."""
    return str(report)
