"""Rich renderables built from stepsync's data; nothing here computes counts or prints globally.

Short two-line headers, columns that would stay empty left out, and sentences as wrapping text, never as table
cells that rich would cut; :func:`print_view` prints a view into a pipe or a log file with no word broken.
"""
from __future__ import annotations

import textwrap
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from rich import box
from rich.console import Console, Group, JustifyMethod
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..core.prediction import SHOWN_EPOCHS, EpochForecast, Forecast, shown_epochs
from ..core.report import DriftEvent, SyncReport
from ..core.versions import installed_version


def print_view(console: Console, view: Any) -> None:
    """Print ``view`` (a renderable, or a Group of them) on ``console``. Where the console is not a terminal (a pipe,
    a log file) nothing is cut: a table takes the width its cells need, and text wraps at the console's width on
    spaces only, never inside a word or a path."""
    if console.is_terminal:
        console.print(view)
        return
    for part in view.renderables if isinstance(view, Group) else [view]:
        if isinstance(part, Group):
            print_view(console, part)
        elif isinstance(part, Table):
            console.print(_fitted(console, part), crop=False)
        elif isinstance(part, Text):
            lines = [textwrap.fill(line, console.width, break_long_words=False, break_on_hyphens=False)
                     for line in part.plain.splitlines() or [""]]
            console.print(Text("\n".join(lines), style=part.style), soft_wrap=True)
        else:
            console.print(part)


def _fitted(console: Console, table: Table) -> Table:
    """``table`` with each column as wide as its cells need, narrowed (the widest first, down to its longest word)
    until it fits the console: wider than the console only where its words need it. Rich alone narrows the widest
    columns below their longest word and cuts it."""
    wide = console.options.update(width=10 ** 6)
    ranges = [[Measurement.get(console, wide, cell) for cell in (column.header, *column.cells)]
              for column in table.columns]
    narrowest = [max(m.minimum for m in cells) for cells in ranges]
    widths = [max(m.maximum for m in cells) for cells in ranges]
    around = Measurement.get(console, wide, table).maximum - sum(widths)  # padding and edges
    if sum(widths) + around <= console.width:
        return table
    while sum(widths) + around > console.width and any(w > n for w, n in zip(widths, narrowest)):
        widest = max((w, i) for i, (w, n) in enumerate(zip(widths, narrowest)) if w > n)[1]
        widths[widest] -= 1
    for column, width in zip(table.columns, widths):
        column.width = width
    table.width = max(console.width, sum(widths) + around)
    return table


def _drift_text(drift: int) -> Text:
    return Text(f"{drift:+d}", style="bold red" if drift else "green")


def _table(title: Optional[str], headers: Sequence[str], rows: List[list], justify: JustifyMethod = "right") -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), title_justify="left")
    for header in headers:
        table.add_column(header, justify=justify, no_wrap=False, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def _notes(lines: Iterable[str], style: Optional[str] = None) -> List[Text]:
    return [Text(f"- {line}", style=style or "") for line in lines]


def _shown(field: str) -> Callable[[EpochForecast], str]:
    """A cell with ``field`` of a forecast row, empty when it is 0."""
    return lambda row: str(getattr(row, field) or "")


def forecast_table(forecast: Forecast, title: Optional[str] = None) -> Table:
    """One row per epoch: updates counted by each side, the drift; partial windows, drops and cuts when any."""
    plan = forecast.plan
    who = forecast.behaviour.framework.who
    columns: List[Tuple[str, Callable[[EpochForecast], Any]]] = [
               ("epoch", lambda r: str(r.epoch)), ("micro-\nbatches", lambda r: str(r.micro_batches)),
               (f"{who}\nupdates", lambda r: str(r.trainer_updates)),
               ("engine\nupdates", lambda r: str(r.engine_updates)),
               (f"{who}\nsteps", lambda r: str(r.trainer_steps)), ("engine\nsteps", lambda r: str(r.engine_steps)),
               ("drift", lambda r: _drift_text(r.drift))]
    for header, field in (("partial\nwindow", "partial_window"), ("dropped", "dropped"), ("cut", "cut")):
        if any(getattr(row, field) for row in forecast.epochs):
            columns.append((header, _shown(field)))
    title = title or (f"stepsync forecast: N={plan.micro_batches_per_epoch} micro-batches/epoch, "
                      f"G={plan.gradient_accumulation_steps}, policy '{forecast.policy.value}'")
    epochs, shown = forecast.epochs, shown_epochs(forecast)
    rows = [[cell(row) for _, cell in columns] for row in shown]
    stack, packages = forecast.behaviour.stack, forecast.behaviour.framework.packages
    # the releases that decide this framework's counting: as the stack names them, else as installed here
    table_caption = ", ".join(f"{p} {getattr(stack, p)}" if hasattr(stack, p) else
                              f"{p} {installed_version(p) or 'not installed here'}" for p in packages) or str(stack)
    if len(shown) < len(epochs):  # a long run: its first and last epochs (--json has them all)
        rows.insert(SHOWN_EPOCHS // 2, ["..."] * len(columns))
        table_caption += f"; {len(epochs) - len(shown)} epochs between not shown (--json has every one)"
    table = _table(title, [header for header, _ in columns], rows)
    table.caption = table_caption
    return table



def verdict_text(forecast: Forecast, said: Optional[str] = None) -> Text:
    said = said or forecast.verdict()
    troubled = not said.startswith("aligned") or forecast.ends_early() is not None
    return Text(said, style="bold yellow" if troubled else "green")


def forecast_view(forecast: Forecast, notes: Sequence[str] = (), verdict: Optional[str] = None) -> Group:
    """The table, the verdict (the forecast's own unless ``verdict`` is given), then what the forecast rests on
    beyond measurement."""
    return Group(forecast_table(forecast), verdict_text(forecast, verdict), *_notes(notes, "dim"))


def drift_panel(event: DriftEvent) -> Panel:
    body = Text.assemble(
        (f"{event.counter} ", ""), (str(event.trainer_steps), "bold"),
        ("   engine global_steps ", ""), (str(event.engine_steps), "bold"),
        ("   drift ", ""), _drift_text(event.drift),
        f"\ncause: {event.cause.value}\nremedy: {event.remedy}",
    )
    return Panel(body, title=f"stepsync: drift at epoch {event.epoch}, micro-batch {event.micro_batch}",
                 border_style="red" if event.drift else "green")


def events_table(events: Iterable[DriftEvent], who: str = "Trainer") -> Table:
    """One row per entry (a drift that changed again and again with one cause is one row: where it started, the
    drift it reached, its changes); ``who`` heads the framework's count (``Framework.who``)."""
    rows = [[str(e.epoch), str(e.micro_batch), e.where.replace("_", " "), str(e.trainer_steps), str(e.engine_steps),
             _drift_text(e.drift) if e.last is None else Text(f"{e.drift:+d} to {e.last_drift:+d}", style="bold red"),
             str(e.changes), e.cause.name.lower().replace("_", " ")] for e in events]
    return _table("drift events", ["epoch", "micro-\nbatch", "where", who, "engine", "drift", "changes", "cause"],
                  rows)


def summary_view(report: SyncReport) -> Panel:
    """The end-of-training summary: both counts, the events and what the drift did to the schedule."""
    lines = Text()
    lines.append(f"policy '{report.policy.value}': {report.counter} counted {report.trainer_steps} updates, "
                 f"the {report.updater} made {report.engine_steps} (drift ")
    lines.append_text(_drift_text(report.drift))
    lines.append(")")
    if report.inherited_drift:
        lines.append(f", of which {report.inherited_drift:+d} was inherited when training began")
    if report.planned_steps is not None:
        finished = report.schedule_finished
        lines.append(f"\nschedule: {report.counter} planned {report.planned_steps} updates, the {report.updater} made "
                     f"{report.made()}: " + ("finished" if finished else
                                             f"NOT finished ({report.missed_updates} not made)"),
                     style=None if finished else "yellow")
    lost = report.lost_updates
    if lost:
        where = f"first {lost[0]}" + (f"; last {lost[-1]}" if report.skips_lost > 1 else "")
        lines.append(f"\nthe engine skipped {report.skips_lost} update(s) it counted: {where}", style="bold red")
    if report.skips_by_design:
        lines.append(f"\nfp16's loss scale skipped {report.skips_by_design} update(s) while searching for a scale "
                     "(by design)")
    if report.lost_gradients:
        lines.append(f"\n{report.lost_micro_batches} micro-batch(es) your loop gave the engine's updates trained "
                     f"nothing: first {report.lost_gradients[0]}", style="bold red")
    if report.unsynced_updates:
        lines.append(f"\n{report.updates_unsynced} update(s) did not hold the window your loop gave them (where the "
                     f"gradient sync was on): first {report.unsynced_updates[0]}", style="bold red")
    if report.dropped_windows:
        lines.append(f"\n{report.windows_dropped} window(s) cleared without an update: first "
                     f"{report.dropped_windows[0]}", style="yellow")
    if report.ranks_apart is not None:
        lines.append(f"\n{report.ranks_apart}", style="bold red")
    shift = report.resume_shift
    if shift is not None and not shift.exact:
        lines.append(f"\nresumed on another layout: {shift.message()}", style="bold red")
    if report.dropped_micro_batches:
        total = sum(report.dropped_micro_batches.values())
        dropped = sorted(report.dropped_micro_batches.items())
        per_epoch = ", ".join(f"{count} in epoch {epoch}" for epoch, count in dropped)
        lines.append(f"\ndrop_last left {total} micro-batch(es) untrained: {per_epoch}")
    for flaw in report.update_flaws:
        lines.append(f"\nupdates: {flaw}", style="yellow")
    if report.unapplied_micro_batches:
        lines.append(f"\n{report.unapplied_micro_batches} micro-batch(es) accumulated by the {report.updater} were "
                     "never applied",
                     style="yellow")
    for note in report.notes:
        lines.append(f"\nnote: {note}")
    parts: List[Any] = [lines]
    if report.events:
        parts.append(events_table(report.events, report.framework.who))
    weighed = report.token_weighting
    troubled = (report.drift or report.update_flaws or lost or report.lost_gradients or report.unsynced_updates
                or report.ranks_apart
                or (shift is not None and not shift.exact) or (weighed is not None and not weighed.as_expected))
    return Panel(Group(*parts), title="stepsync summary", border_style="red" if troubled else "green")


def audit_view(audit) -> Group:
    """``stepsync inspect``: one row per checkpoint with the columns its layout has, then what the checkpoints hold
    on purpose, each finding once (with the checkpoints that have it), each broken file, and the verdict."""
    items = audit.checkpoints
    columns: List[Tuple[str, Callable[[Any], Any]]] = [("checkpoint", lambda item: item.name)]
    if all(item.loop for item in items):  # accelerator.save_state: the loop's count is stepsync's record
        columns += [("your loop's\nupdates", lambda item: str(item.record.trainer_steps) if item.record else "?"),
                    ("DeepSpeed\nstep", lambda item: "?" if item.deepspeed_step is None else str(item.deepspeed_step))]
    else:
        columns += [("trainer_state\nglobal_step", lambda item: "?" if item.trainer_state_step is None
                     else str(item.trainer_state_step)), ("DeepSpeed\nlatest", _tag_cell)]
        if any(item.record for item in items):
            columns.append(("stepsync record\nTrainer/engine", lambda item: f"{item.record.trainer_steps}/"
                            f"{item.record.engine_steps}" if item.record else "-"))
    if any(item.unapplied_at_save for item in items):
        columns.append(("open\nwindow", lambda item: str(item.unapplied_at_save)))
    columns += [("drift", lambda item: Text("?") if item.drift is None else _drift_text(item.drift)),
                ("status", _status_cell)]
    rows = [[cell(item) for _, cell in columns] for item in items]
    table = _table(None, [header for header, _ in columns], rows, justify="left")
    verdict = Text(audit.verdict(), style="green" if audit.ok else "bold yellow")
    return Group(Text(f"stepsync inspect: {audit.output_dir}", style="italic"), table, *_notes(audit.on_purpose()),
                 *_notes(audit.findings_once(), "red"), *_notes([p for item in items for p in item.problems], "red"),
                 verdict)


def _tag_cell(item) -> str:
    if item.deepspeed_tag:
        return item.deepspeed_tag
    return "-" if item.deepspeed_step is None else f"(global_step{item.deepspeed_step})"


def _status_cell(item) -> Text:
    if item.ok:
        return Text("ok", style="green")
    damaged = len(item.problems) > item.node_local  # a node's own copy misses only its 'latest'
    return Text("BROKEN" if damaged else "MISMATCH" if item.findings else "NO LATEST", style="bold red")
