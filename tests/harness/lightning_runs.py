"""Real Lightning + DeepSpeed runs on CPU for the tests, with an independent recorder and exact update weights.

The model is linear with one parameter per sample and the loss ``w . x`` with one-hot ``x``: under plain SGD
(lr 1) the change of dimension i in an update is minus the weight sample i had in it, so every update's
micro-batch weights are read from the parameters. The recorder logs, after every batch, Lightning's
``global_step``, the engine's ``global_steps``, the scheduler's steps and the sample of the batch.

Lightning's DeepSpeed strategies refuse a CPU accelerator at one device check, an
``isinstance(self.accelerator, CUDAAccelerator)`` that is the only use of that name in their modules in every
release: :func:`lift_the_cuda_check` makes that name accept a CPU accelerator, and changes nothing else.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from stepsync.tools.tiny_run import cpu_distributed_env


def lift_the_cuda_check() -> None:
    """Let Lightning's DeepSpeed strategies (the Trainer's and Fabric's) run on a CPU accelerator."""
    import lightning.fabric.strategies.deepspeed as fabric_deepspeed
    import lightning.pytorch.strategies.deepspeed as trainer_deepspeed
    from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
    from lightning.pytorch.accelerators import CPUAccelerator

    for module, cpu in ((trainer_deepspeed, CPUAccelerator), (fabric_deepspeed, FabricCPU)):
        if not isinstance(module.CUDAAccelerator, tuple):
            module.CUDAAccelerator = (module.CUDAAccelerator, cpu)


def strategy(stage: int, devices: int = 1):
    import torch
    from lightning.pytorch.strategies import DeepSpeedStrategy

    lift_the_cuda_check()
    return DeepSpeedStrategy(stage=stage, parallel_devices=[torch.device("cpu", i) for i in range(devices)],
                             process_group_backend="gloo")


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
    import deepspeed

    with deepspeed.zero.GatheredParameters([module.w]):  # ZeRO-3 keeps a shard per rank
        return module.w.detach().clone()


def run_lightning(samples: int, gas: int, epochs: int = 2, stage: int = 0, callback: Any = None,
                  deepspeed: bool = True, limit_train_batches=None, ckpt_path: Optional[str] = None,
                  default_root_dir: Optional[str] = None, devices: int = 1, **trainer_options) -> LightningRun:
    """Fit the one-hot linear model on ``samples`` samples (batch 1, in order) with ``accumulate_grad_batches``."""
    cpu_distributed_env()
    import lightning.pytorch as pl
    import torch

    class OneHot(torch.utils.data.Dataset):
        def __len__(self):
            return samples

        def __getitem__(self, index):
            return torch.nn.functional.one_hot(torch.tensor(index), samples).float()

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(samples))

        def training_step(self, batch, batch_idx):
            return (batch @ self.w).sum()

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    recording = LightningRecording()

    class Recorder(pl.Callback):
        last = None

        def on_train_start(self, trainer, module):
            self.last = parameters(module)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            weights = parameters(module)
            if not torch.equal(weights, self.last):
                moved = self.last - weights
                recording.updates.append({i: round(float(v), 6) for i, v in enumerate(moved) if abs(float(v)) > 1e-9})
            self.last = weights
            configs = trainer.lr_scheduler_configs
            engine_steps = getattr(trainer.strategy.model, "global_steps", None)
            recording.batches.append((trainer.current_epoch, batch_idx, int(batch.argmax()), trainer.global_step,
                                      engine_steps, configs[0].scheduler.last_epoch if configs else None))

    options = dict(accelerator="cpu", max_epochs=epochs, accumulate_grad_batches=gas, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   use_distributed_sampler=False, default_root_dir=default_root_dir or tempfile.mkdtemp())
    if deepspeed:
        options["strategy"] = strategy(stage, devices)
    if limit_train_batches is not None:
        options["limit_train_batches"] = limit_train_batches
    options.update(trainer_options)
    callbacks = [Recorder()] + ([callback] if callback is not None else []) + list(options.pop("callbacks", []))
    trainer = pl.Trainer(callbacks=callbacks, **options)
    module = Linear()
    result = LightningRun(trainer, module, recording, callback)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(OneHot(), batch_size=1), ckpt_path=ckpt_path)
    except Exception as exc:  # the caller asserts on it
        result.error = exc
    return result


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
               config_gas: int = 1, deepspeed: bool = True) -> FabricRun:
    """Fabric's documented accumulation loop (no_backward_sync around each backward, optimizer.step() every
    ``gas`` micro-batches of an epoch, the loss divided by ``gas``) on the one-hot linear model."""
    cpu_distributed_env()
    import lightning as L
    import torch
    from lightning.fabric.strategies import DeepSpeedStrategy

    import stepsync.lightning

    lift_the_cuda_check()
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 1,
              "gradient_accumulation_steps": config_gas, "zero_allow_untested_optimizer": True}
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(
        config=config, parallel_devices=[torch.device("cpu", 0)], process_group_backend="gloo") if deepspeed else "auto")
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
    data = torch.utils.data.DataLoader(torch.eye(samples), batch_size=1)
    try:
        record.watch = stepsync.lightning.watch(fabric, model, optimizer, policy, dataloader=data, console=False) \
            if policy else None
        last = parameters(module)
        for epoch in range(epochs):
            for batch_idx, batch in enumerate(data):
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
