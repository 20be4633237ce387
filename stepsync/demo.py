"""``stepsync demo``: the drift and its fix on a real Trainer + DeepSpeed run, on CPU, in a minute."""
from __future__ import annotations

import tempfile

from rich.console import Console
from rich.table import Table

from .choices import Policy


def _table(title: str, recording) -> Table:
    table = Table(title=title)
    for name in ("micro-batch", "Trainer global_step", "engine global_steps", "drift"):
        table.add_column(name, justify="right")
    for index, (trainer, engine) in enumerate(zip(recording.trainer_steps, recording.engine_steps), start=1):
        drift = trainer - engine
        table.add_row(str(index), str(trainer), str(engine), f"[{'red' if drift else 'green'}]{drift:+d}")
    return table


def run_demo(args) -> int:
    console = Console()
    policies = [None, Policy.SYNC] if args.compare else [Policy.parse(args.policy)]
    console.print("[bold]stepsync demo[/]: tiny GPT-2 from a config, real Trainer and DeepSpeed on CPU. "
                  "The first DeepSpeed start compiles an op (about a minute); later runs start in seconds.")
    from .callback import StepSyncCallback
    from .testing import run_tiny

    tables = []
    for policy in policies:
        label = "without stepsync" if policy is None else f"policy '{policy.value}'"
        with console.status(f"training {label} (N={args.samples}, G={args.gas}, {args.epochs} epochs)..."):
            callback = StepSyncCallback(policy, console=console) if policy else None
            result = run_tiny(tempfile.mkdtemp(), samples=args.samples, gas=args.gas, epochs=args.epochs,
                              callback=callback, disable_tqdm=True, log_level="error")
        if result.error is not None:
            console.print(f"[red]{label}: {result.error}")
        tables.append(_table(label, result.recording))
    from rich.columns import Columns

    console.print(Columns(tables))
    return 0
