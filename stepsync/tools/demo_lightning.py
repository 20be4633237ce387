"""``stepsync demo --framework lightning``: the drift and its fix on a real Lightning + DeepSpeed run on CPU.

    python -m stepsync.tools.demo_lightning [--samples N] [--gas G] [--epochs E] [--stage S] [--policy P]

The run of policy ``warn`` first (the run as it is), then the remedy (``sync`` by default, or ``drop_last``): both
counts after every batch, then what each update trained, read from the parameters of a model with one weight per
sample (stepsync/tools/tiny_lightning.py; on a CPU, Lightning's one device check is lifted there). The command
line runs it in a process of its own, so that ``stepsync`` itself never imports Lightning.
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import List

from rich.console import Console
from rich.table import Table

from ..core.choices import Policy
from ..core.frameworks import LIGHTNING
from ..core.versions import installed_version
from ..lightning import StepSyncCallback
from .tiny_lightning import fit_tiny


def updates_table(title: str, rows: List[tuple], updates: List[dict]) -> Table:
    """One row per batch: both counts after it, and what the update made there trained (sample: weight)."""
    table = Table(title=title, title_justify="left")
    for name in ("epoch", "batch", "Lightning global_step", "engine global_steps", "drift", "update trained"):
        table.add_column(name, justify="right" if name != "update trained" else "left")
    update = iter(updates)
    previous_engine = 0
    for epoch, batch, lightning, engine in rows:
        trained = ", ".join(f"{sample}: {weight:g}" for sample, weight in next(update).items()) \
            if engine != previous_engine else ""
        previous_engine = engine
        drift = lightning - engine
        table.add_row(str(epoch + 1), str(batch + 1), str(lightning), str(engine),
                      f"[{'red' if drift else 'green'}]{drift:+d}", trained)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="stepsync demo --framework lightning")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--policy", default="sync", help="the remedy shown after warn (sync or drop_last)")
    args = parser.parse_args(argv)
    remedy = LIGHTNING.parse_policy(args.policy, as_flag=True)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "stepsync", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)  # the tables below say it
    console = Console()
    console.print(f"[bold]stepsync demo[/]: a linear model with one weight per sample, trained by the real Lightning "
                  f"Trainer and DeepSpeed (ZeRO-{args.stage}) on CPU: N={args.samples} micro-batches per epoch, "
                  f"accumulate_grad_batches={args.gas}, {args.epochs} epochs (lightning "
                  f"{installed_version('lightning')}, deepspeed {installed_version('deepspeed')}). Plain SGD with lr 1 "
                  "makes what each update trained readable from the weights: each micro-batch should weigh "
                  f"1/{args.gas}.")
    import torch

    finals = []
    for policy in dict.fromkeys((Policy.WARN, remedy)):
        callback = StepSyncCallback(policy, console=False)
        rows: List[tuple] = []
        updates: List[dict] = []
        recorder = _recorder(rows, updates, torch)
        _, _, error = fit_tiny(args.samples, args.gas, args.epochs, args.stage, [recorder, callback])
        what = policy.role
        console.rule(f"policy '{policy.value}' ({what})")
        console.print(updates_table(f"policy '{policy.value}'", rows, updates))
        if callback.report.forecast is not None:
            console.print(callback.report.forecast.verdict())
        if error is not None:
            console.print(f"[red]{type(error).__name__}: {error}")
        dropped = sum(callback.report.dropped_micro_batches.values())
        finals.append(f"policy '{policy.value}': Lightning {callback.report.trainer_steps}, engine "
                      f"{callback.report.engine_steps}"
                      + (f" ({dropped} micro-batch(es) left untrained: whole windows only)" if dropped else ""))
    console.rule("result")
    console.print("; ".join(finals))
    return 0


def _recorder(rows: List[tuple], updates: List[dict], torch):
    import lightning.pytorch as pl

    class Recorder(pl.Callback):
        last = None

        def on_train_start(self, trainer, module):
            self.last = module.w.detach().clone()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            import deepspeed

            with deepspeed.zero.GatheredParameters([module.w]):
                weights = module.w.detach().clone()
            if not torch.equal(weights, self.last):
                moved = self.last - weights
                updates.append({i + 1: round(float(v), 4) for i, v in enumerate(moved) if abs(float(v)) > 1e-9})
            self.last = weights
            rows.append((trainer.current_epoch, batch_idx, trainer.global_step, trainer.strategy.model.global_steps))

    return Recorder()


if __name__ == "__main__":
    sys.exit(main())
