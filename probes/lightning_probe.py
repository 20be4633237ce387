"""What a Lightning release does with DeepSpeed and accumulate_grad_batches, measured on CPU, and without it.

    python probes/lightning_probe.py [N,G,E[,STAGE] ...]     (prints one JSON object per case)

STAGE ``none``: no DeepSpeed (Lightning's own accumulation, one CPU device); the engine's column is then the torch
optimizer's steps, counted by a step post-hook.

A linear model whose loss is ``w . x`` with one-hot ``x`` (one dimension per sample) and plain SGD (lr 1) makes
each update's weights exact: the update of dimension i is minus the weight sample i had in it. Per batch it
records Lightning's ``global_step``, the engine's ``global_steps`` and the LR scheduler's steps; per update,
which samples it held and with what weight. Lightning's DeepSpeed strategy refuses a CPU accelerator in
one device check; this probe lifts exactly that check (stepsync/tools/tiny_lightning.py).
"""
import json
import os
import sys
import warnings


def parameters(module):
    """The model's weights, whole (ZeRO-3 keeps a shard on each rank: gather it)."""
    if not hasattr(module.w, "ds_id"):  # no DeepSpeed
        return module.w.detach().clone()
    import deepspeed

    with deepspeed.zero.GatheredParameters([module.w]):
        return module.w.detach().clone()


def run_case(n: int, g: int, epochs: int, stage) -> dict:
    import lightning.pytorch as pl
    import torch

    class Record(pl.Callback):
        def __init__(self):
            self.rows, self.updates, self.last = [], [], None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            engine = trainer.strategy.model if stage is not None else self
            weights = parameters(module)
            if self.last is not None and not torch.equal(weights, self.last):
                moved = (self.last - weights)
                self.updates.append({str(i): round(float(v), 6) for i, v in enumerate(moved) if abs(float(v)) > 1e-9})
            self.last = weights
            scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
            self.rows.append([trainer.current_epoch, batch_idx, trainer.global_step, engine.global_steps,
                              getattr(scheduler, "last_epoch", None)])

        def on_train_start(self, trainer, module):
            self.last = parameters(module)
            self.global_steps = 0
            if stage is None:  # the optimizer's own steps
                trainer.optimizers[0].register_step_post_hook(lambda *_: setattr(self, "global_steps",
                                                                                 self.global_steps + 1))

    from stepsync.tools.tiny_lightning import fit_tiny

    record = Record()
    trainer, _, error = fit_tiny(n, g, epochs, stage or 0, [record], deepspeed=stage is not None)
    if error is not None:
        raise error
    engine = trainer.strategy.model if stage is not None else record
    return {"n": n, "g": g, "epochs": epochs, "stage": stage, "lightning_steps": trainer.global_step,
            "engine_steps": engine.global_steps, "batches": record.rows, "updates": record.updates}


def versions() -> dict:
    from importlib.metadata import version

    found = {}
    for name in ("lightning", "deepspeed", "torch"):
        try:
            found[name] = version(name)
        except Exception:  # a stack without DeepSpeed
            found[name] = None
    return found


def main(argv) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                        ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore")
    cases = argv or ["3,2,2", "5,2,3", "7,3,2", "2,4,2"]
    for case in cases:
        parts = case.split(",")
        n, g, epochs = (int(p) for p in parts[:3])
        stage = None if parts[3:] == ["none"] else int((parts[3:] or ["0"])[0])
        print(json.dumps({**run_case(n, g, epochs, stage), "versions": versions()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
