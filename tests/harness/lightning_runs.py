"""Real Lightning + DeepSpeed runs and Fabric loops on CPU for the tests, with an independent recorder and exact
update weights, on the shipped tiny run (stepsync/tools/tiny_lightning.py: the one-hot model, and the one device
check lifted). The recorder logs, after every batch, Lightning's ``global_step``, the engine's ``global_steps``,
the scheduler's steps and the sample of the batch; each update's micro-batch weights come from the parameters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from stepsync.tools.tiny_lightning import fit_tiny, lift_the_cuda_check, one_hot_loader
from stepsync.tools.tiny_run import cpu_distributed_env


@dataclass
class LightningRecording:
    """After every batch: (epoch, batch_idx, sample, Lightning's count, the engine's count, the scheduler's steps);
    per update: {sample: weight}."""

    batches: List[tuple] = field(default_factory=list)
    updates: List[Dict[int, float]] = field(default_factory=list)

    @property
    def epoch_ends(self) -> List[tuple]:
        ends: Dict[int, tuple] = {}
        for epoch, _, _, lightning, engine, _ in self.batches:
            ends[epoch] = (lightning, engine)
        return list(ends.values())

    def samples(self, epoch: int) -> List[int]:
        return [sample for e, _, sample, *_ in self.batches if e == epoch]


@dataclass
class LightningRun:
    trainer: Any
    module: Any
    recording: LightningRecording
    callback: Any
    error: Optional[BaseException] = None

    @property
    def engine(self):
        return self.trainer.strategy.model


def parameters(module):
    if not hasattr(module.w, "ds_id"):  # no DeepSpeed
        return module.w.detach().clone()
    import deepspeed

    with deepspeed.zero.GatheredParameters([module.w]):  # ZeRO-3 keeps a shard per rank
        return module.w.detach().clone()


def run_lightning(samples: int, gas: int, epochs: int = 2, stage: int = 0, callback: Any = None,
                  deepspeed: bool = True, limit_train_batches=None, ckpt_path: Optional[str] = None,
                  default_root_dir: Optional[str] = None, devices: int = 1, **trainer_options) -> LightningRun:
    """Fit the one-hot linear model on ``samples`` samples (batch 1, in order) with ``accumulate_grad_batches``,
    the recorder first, then ``callback``, then any ``callbacks=`` given."""
    import lightning.pytorch as pl
    import torch

    recording = LightningRecording()

    class Recorder(pl.Callback):
        last = None
        optimizer_steps = 0  # without DeepSpeed, the updates: the torch optimizer's steps, from its own hook

        def on_train_start(self, trainer, module):
            self.last = parameters(module)
            if not deepspeed:
                trainer.optimizers[0].register_step_post_hook(lambda *_: setattr(self, "optimizer_steps",
                                                                                 self.optimizer_steps + 1))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            weights = parameters(module)
            if not torch.equal(weights, self.last):
                moved = self.last - weights
                recording.updates.append({i: round(float(v), 6) for i, v in enumerate(moved) if abs(float(v)) > 1e-9})
            self.last = weights
            configs = trainer.lr_scheduler_configs
            engine_steps = getattr(trainer.strategy.model, "global_steps", None) if deepspeed else self.optimizer_steps
            recording.batches.append((trainer.current_epoch, batch_idx, int(batch.argmax()), trainer.global_step,
                                      engine_steps, configs[0].scheduler.last_epoch if configs else None))

    if limit_train_batches is not None:
        trainer_options["limit_train_batches"] = limit_train_batches
    if default_root_dir is not None:
        trainer_options["default_root_dir"] = default_root_dir
    callbacks = [Recorder()] + ([callback] if callback is not None else []) + list(trainer_options.pop("callbacks", []))
    trainer, module, error = fit_tiny(samples, gas, epochs, stage, callbacks, deepspeed, devices, ckpt_path,
                                      **trainer_options)
    return LightningRun(trainer, module, recording, callback, error)


@dataclass
class FabricRun:
    """A Fabric loop's run, recorded by the loop itself: after each micro-batch (epoch, batch_idx, the loop's
    optimizer.step() count, the engine's count); each update's {sample: weight}."""

    batches: List[tuple] = field(default_factory=list)
    updates: List[Dict[int, float]] = field(default_factory=list)
    watch: Any = None
    engine: Any = None
    error: Optional[BaseException] = None
    weights: Any = None


def run_fabric(samples: int, gas: int, epochs: int = 2, stage: int = 0, policy: Optional[str] = "warn",
               config_gas: int = 1, deepspeed: bool = True,
               before_micro_batch: Optional[Callable[[int], None]] = None, precision: Optional[str] = None,
               data: Any = None, loggers: Any = None) -> FabricRun:
    """Fabric's documented accumulation loop (no_backward_sync around each backward, optimizer.step() every
    ``gas`` micro-batches of an epoch, the loss divided by ``gas``) on the one-hot linear model;
    ``before_micro_batch`` is called with the 1-based index of each micro-batch (across epochs) before it runs;
    ``precision`` is Fabric's, ``data`` replaces the one-hot rows, and ``loggers`` are Fabric's."""
    cpu_distributed_env()
    import lightning as L
    import torch
    from lightning.fabric.strategies import DeepSpeedStrategy

    import stepsync.lightning

    lift_the_cuda_check()
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 1,
              "gradient_accumulation_steps": config_gas, "zero_allow_untested_optimizer": True}
    strategy = DeepSpeedStrategy(config=config, parallel_devices=[torch.device("cpu", 0)],
                                 process_group_backend="gloo") if deepspeed else "auto"
    # lightning 2.0 refuses precision=None: pass it only when asked
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, loggers=loggers,
                      **({"precision": precision} if precision else {}))
    fabric.launch()

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(samples))

        def forward(self, x):
            return (x @ self.w).sum()

    record = FabricRun()
    module = Linear()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1.0))
    record.engine = model._forward_module if deepspeed else None
    data = one_hot_loader(samples) if data is None else data
    try:
        record.watch = stepsync.lightning.watch(fabric, model, optimizer, policy, dataloader=data, console=False) \
            if policy else None
        last = parameters(module)
        for epoch in range(epochs):
            for batch_idx, batch in enumerate(data):
                if before_micro_batch is not None:
                    before_micro_batch(len(record.batches) + 1)
                ends_window = (batch_idx + 1) % gas == 0
                with fabric.no_backward_sync(model, enabled=not ends_window):
                    fabric.backward(model(batch) / gas)
                if ends_window:
                    optimizer.step()
                    optimizer.zero_grad()
                weights = parameters(module)
                if not torch.equal(weights, last):
                    moved = last - weights
                    record.updates.append({i: round(float(v), 6) for i, v in enumerate(moved) if abs(float(v)) > 1e-9})
                last = weights
                steps = record.watch.loop_steps if record.watch else None
                record.batches.append((epoch, batch_idx, steps, getattr(record.engine, "global_steps", None)))
    except Exception as exc:  # the caller asserts on it
        record.error = exc
    finally:
        if record.watch is not None:
            record.watch.close()
    record.weights = parameters(module) if deepspeed else module.w.detach().clone()
    return record
