"""``stepsync demo``: the drift and its fix on a real Trainer + DeepSpeed run, on CPU, in a minute."""
from __future__ import annotations

import tempfile
from typing import List

from rich.columns import Columns
from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table

STARTING = ("starting DeepSpeed on CPU; the first start on this machine compiles an op (about a minute), "
            "later ones take seconds")


def counters_table(title: str, rows: List[tuple]) -> Table:
    """One row per micro-batch: both counters after it and their difference."""
    table = Table(title=title)
    for name in ("micro-batch", "Trainer global_step", "engine global_steps", "drift"):
        table.add_column(name, justify="right")
    for index, (trainer, engine) in enumerate(rows, start=1):
        drift = trainer - engine
        table.add_row(str(index), str(trainer), str(engine), f"[{'red' if drift else 'green'}]{drift:+d}")
    return table


def _live_rows(live: Live, title: str, rows: List[tuple]):
    """A callback that redraws the table after every micro-batch."""
    from transformers import TrainerCallback

    class LiveTable(TrainerCallback):
        def _draw(self, state):
            engine = self.trainer_ref[0].model_wrapped
            rows.append((state.global_step, getattr(engine, "global_steps", 0)))
            live.update(counters_table(title, rows))

        def on_substep_end(self, args, state, control, **kwargs):
            self._draw(state)

        def on_step_end(self, args, state, control, **kwargs):
            self._draw(state)

    return LiveTable()


def run_demo(args) -> int:
    from .callback import StepSyncCallback
    from .choices import Policy
    from .testing import run_tiny

    console = Console()
    policies = [None, Policy.SYNC] if args.compare else [Policy.parse(args.policy)]
    console.print("[bold]stepsync demo[/]: a tiny GPT-2 built from a config, the real Trainer and DeepSpeed on CPU, "
                  f"N={args.samples} micro-batches per epoch, G={args.gas}, {args.epochs} epochs.")
    console.print(STARTING[0].upper() + STARTING[1:] + ".")
    tables, failed = [], False
    for policy in policies:
        title = "without stepsync" if policy is None else f"policy '{policy.value}'"
        rows: List[tuple] = []
        with Live(Group(Spinner("dots", f"{title}: {STARTING}")), console=console, refresh_per_second=8,
                  transient=args.compare) as live:
            live_table = _live_rows(live, title, rows)
            callback = StepSyncCallback(policy, console=console) if policy else None
            result = run_tiny(tempfile.mkdtemp(prefix="stepsync-demo-"), samples=args.samples, gas=args.gas,
                              epochs=args.epochs, callback=callback, extra_callbacks=[live_table], log_level="error", logging_strategy="no",
                              on_trainer=lambda trainer: setattr(live_table, "trainer_ref", [trainer]))
            live.update(counters_table(title, rows))
        if result.error is not None:
            failed = True
            console.print(f"[red]{title}: {type(result.error).__name__}: {result.error}")
        tables.append(counters_table(f"{title}: Trainer {result.trainer.state.global_step}, engine "
                                     f"{getattr(result.engine, 'global_steps', '?')}", rows))
    if len(tables) > 1:
        console.print(Columns(tables))
    return 1 if failed else 0
