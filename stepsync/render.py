"""Rich renderables built from stepsync's data; nothing here computes counts or prints globally."""
from __future__ import annotations

from typing import Iterable, Optional

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .forecast import Forecast
from .report import DriftEvent, SyncReport


def _drift_text(drift: int) -> Text:
    return Text(f"{drift:+d}", style="bold red" if drift else "green")


def forecast_table(forecast: Forecast, title: Optional[str] = None) -> Table:
    """One row per epoch: updates counted by each side, the drift and the partial windows."""
    plan = forecast.plan
    table = Table(
        title=title or (
            f"stepsync forecast: N={plan.micro_batches_per_epoch} micro-batches/epoch, "
            f"G={plan.gradient_accumulation_steps}, policy '{forecast.policy.value}'"
        ),
        caption=str(forecast.behaviour.stack),
    )
    for name in ("epoch", "micro-batches", "Trainer updates", "engine updates", "Trainer steps", "engine steps",
                 "drift", "partial window", "dropped"):
        table.add_column(name, justify="right")
    for row in forecast.epochs:
        table.add_row(str(row.epoch), str(row.micro_batches), str(row.trainer_updates), str(row.engine_updates),
                      str(row.trainer_steps), str(row.engine_steps), _drift_text(row.drift),
                      str(row.partial_window or ""), str(row.dropped or ""))
    return table


def verdict_text(forecast: Forecast) -> Text:
    verdict = forecast.verdict()
    return Text(verdict, style="green" if forecast.aligned else "bold yellow")


def forecast_view(forecast: Forecast) -> Group:
    return Group(forecast_table(forecast), verdict_text(forecast))


def drift_panel(event: DriftEvent) -> Panel:
    body = Text.assemble(
        ("Trainer global_step ", ""), (str(event.trainer_steps), "bold"),
        ("   engine global_steps ", ""), (str(event.engine_steps), "bold"),
        ("   drift ", ""), _drift_text(event.drift),
        f"\ncause: {event.cause.value}\nremedy: {event.remedy}",
    )
    return Panel(body, title=f"stepsync: drift at epoch {event.epoch}, micro-batch {event.micro_batch}",
                 border_style="red" if event.drift else "green")


def events_table(events: Iterable[DriftEvent]) -> Table:
    table = Table(title="drift events")
    for name in ("epoch", "micro-batch", "where", "Trainer", "engine", "drift", "cause"):
        table.add_column(name)
    for event in events:
        table.add_row(str(event.epoch), str(event.micro_batch), event.where, str(event.trainer_steps),
                      str(event.engine_steps), _drift_text(event.drift), event.cause.value)
    return table


def summary_view(report: SyncReport) -> Panel:
    """The end-of-training summary: both counts, the events and what the drift did to the schedule."""
    lines = Text()
    lines.append(f"policy '{report.policy.value}': Trainer counted {report.trainer_steps} updates, "
                 f"the engine made {report.engine_steps} (drift ")
    lines.append_text(_drift_text(report.drift))
    lines.append(")")
    if report.inherited_drift:
        lines.append(f", of which {report.inherited_drift:+d} was inherited from the checkpoint")
    if report.planned_steps is not None:
        finished = report.schedule_finished
        lines.append(f"\nschedule: the Trainer planned {report.planned_steps} updates, the engine made "
                     f"{report.engine_steps}: " + ("finished" if finished else
                                                   f"NOT finished ({report.missed_updates} not made)"),
                     style=None if finished else "yellow")
    if report.dropped_micro_batches:
        total = sum(report.dropped_micro_batches.values())
        lines.append(f"\ndrop_last left {total} micro-batch(es) untrained: {report.dropped_micro_batches}")
    if report.unapplied_micro_batches:
        lines.append(f"\n{report.unapplied_micro_batches} micro-batch(es) accumulated by the engine were never applied",
                     style="yellow")
    for note in report.notes:
        lines.append(f"\nnote: {note}")
    parts = [lines]
    if report.events:
        parts.append(events_table(report.events))
    return Panel(Group(*parts), title="stepsync summary", border_style="red" if report.drift else "green")


def audit_view(audit) -> Group:
    """``stepsync inspect``: one row per checkpoint, then every message and the verdict."""
    table = Table(title=f"stepsync inspect: {audit.output_dir}")
    for name in ("checkpoint", "trainer_state.json", "DeepSpeed latest", "stepsync record", "drift", "status"):
        table.add_column(name)
    messages = []
    for item in audit.checkpoints:
        record = item.record
        table.add_row(
            item.name,
            "?" if item.trainer_state_step is None else str(item.trainer_state_step),
            item.deepspeed_tag or "-",
            f"{record.trainer_steps}/{record.engine_steps}" if record else "-",
            _drift_text(item.drift) if item.drift is not None else Text("?"),
            Text("ok", style="green") if item.ok else Text("MISMATCH" if item.mismatches else "BROKEN", style="bold red"),
        )
        messages += item.mismatches + item.problems
    verdict = Text(audit.verdict(), style="green" if audit.ok else "bold yellow")
    return Group(table, *(Text(f"- {m}", style="red") for m in messages), verdict)
