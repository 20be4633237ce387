"""``stepsync demo``: the drift and its fix on a real Trainer + DeepSpeed run, on CPU, in seconds.

The problem first (policy ``warn`` only watches: the run is what it would be without stepsync), then the
fix (``sync``), each with both counters live after every micro-batch, then one line that compares them.
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile
from typing import List

from rich.console import Console
from rich.live import Live
from rich.table import Table

import stepsync

from ..core.choices import Policy
from ..core.versions import EngineBoundary, Stack, behaviour_of, installed_version
from .tiny_run import run_tiny


def counters_table(title: str, rows: List[tuple]) -> Table:
    """One row per micro-batch: both counters after it and their difference."""
    table = Table(title=title, title_justify="left")
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


def _prepare(trainer, live_table) -> None:
    from transformers.trainer_callback import PrinterCallback

    live_table.trainer_ref = [trainer]
    trainer.remove_callback(PrinterCallback)  # the Trainer's own metrics print would break the tables


def _aligned_here() -> bool:
    return behaviour_of(Stack.installed()).engine_boundary is EngineBoundary.FOLLOWS_TRAINER


def run_demo(args) -> int:
    console = Console()
    policies = [Policy.WARN, Policy.SYNC] if args.compare else [Policy.parse(args.policy)]
    console.print(f"[bold]stepsync demo[/]: a tiny GPT-2 built from a config, trained by the real Trainer and "
                  f"DeepSpeed on CPU: N={args.samples} micro-batches per epoch, G={args.gas}, {args.epochs} epochs "
                  f"(transformers {installed_version('transformers')}, accelerate {installed_version('accelerate')}, "
                  f"deepspeed {installed_version('deepspeed')}).")
    if _aligned_here():
        console.print(f"[yellow]This stack does not drift: accelerate {installed_version('accelerate')} >= 1.8 "
                      "sets DeepSpeed's boundary from the Trainer's, so both runs agree. Seeing the drift needs "
                      "accelerate < 1.8: bash scripts/demo.sh builds such a stack, or pip install 'accelerate<1.8'.")
    logging.getLogger("stepsync").setLevel(logging.ERROR)  # the views below say it; no second copy as log lines
    finals, failed = [], False
    saved_under = tempfile.mkdtemp(prefix="stepsync-demo-")  # each demo its own: the last one's checkpoints stay
    for policy in policies:
        what = policy.role
        title = f"policy '{policy.value}' ({what})"
        console.rule(title)
        rows: List[tuple] = []
        output_dir = os.path.join(saved_under, policy.value)
        with Live(counters_table(title, rows), console=console, refresh_per_second=8) as live:
            live_table = _live_rows(live, title, rows)
            result = run_tiny(output_dir, samples=args.samples, gas=args.gas, epochs=args.epochs,
                              callbacks=[live_table, stepsync.StepSyncCallback(policy, console=console)],
                              log_level="error", logging_strategy="no", save_strategy="epoch",
                              on_trainer=functools.partial(_prepare, live_table=live_table))
            live.update(counters_table(title, rows))
        console.print()
        if result.error is not None:
            failed = True
            console.print(f"[red]{title}: {type(result.error).__name__}: {result.error}")
        trainer, engine = result.trainer.state.global_step, getattr(result.engine, "global_steps", None)
        finals.append(f"policy '{policy.value}': Trainer {trainer}, engine {engine}"
                      + (f" (drift {trainer - engine:+d})" if engine is not None else ""))
    console.rule("result")
    console.print("; ".join(finals))
    saved = os.path.join(saved_under, policies[0].value)
    console.print(f"Each run saved a checkpoint at every epoch end: stepsync inspect {saved} says what a resume "
                  "from each would carry.", highlight=False)
    return 1 if failed else 0

