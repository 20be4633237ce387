"""A tiny real Lightning run on DeepSpeed on a CPU: a linear model with one weight per sample, data in memory.

What the Lightning demo trains; the tests build theirs on it. The model's loss is ``w . x`` with one-hot ``x``
and plain SGD (lr 1): the change of weight i in an update is minus the weight sample i had in it, so what each
update trained is read from the parameters.

Lightning's DeepSpeed strategies refuse a CPU accelerator at one device check, an
``isinstance(self.accelerator, CUDAAccelerator)`` that is the only use of that name in their modules in every
release: :func:`lift_the_cuda_check` makes that name accept a CPU accelerator and changes nothing else. It is
called only where no GPU is used (this CPU run); ``stepsync.lightning`` itself never calls it.
"""
from __future__ import annotations

import tempfile
from typing import Any, Optional, Sequence

from .tiny_run import cpu_distributed_env


def lift_the_cuda_check() -> None:
    """Let Lightning's DeepSpeed strategies (the Trainer's and Fabric's) run on a CPU accelerator."""
    import lightning.fabric.strategies.deepspeed as fabric_deepspeed
    import lightning.pytorch.strategies.deepspeed as trainer_deepspeed
    from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
    from lightning.pytorch.accelerators import CPUAccelerator

    for module, cpu in ((trainer_deepspeed, CPUAccelerator), (fabric_deepspeed, FabricCPU)):
        if not isinstance(module.CUDAAccelerator, tuple):
            module.CUDAAccelerator = (module.CUDAAccelerator, cpu)


def cpu_deepspeed_strategy(stage: int, devices: int = 1):
    """Lightning's DeepSpeedStrategy on ``devices`` CPU devices (gloo), its device check lifted."""
    import torch
    from lightning.pytorch.strategies import DeepSpeedStrategy

    lift_the_cuda_check()
    return DeepSpeedStrategy(stage=stage, parallel_devices=[torch.device("cpu", i) for i in range(devices)],
                             process_group_backend="gloo")


def one_hot_module(samples: int):
    """The linear LightningModule: one weight per sample, loss ``w . x``, plain SGD and a constant scheduler."""
    import lightning.pytorch as pl
    import torch

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

    return Linear()


def one_hot_loader(samples: int):
    """``samples`` one-hot rows, in order, one per micro-batch."""
    import torch

    return torch.utils.data.DataLoader(torch.eye(samples), batch_size=1)


def fit_tiny(samples: int, gas: int, epochs: int = 2, stage: int = 0, callbacks: Sequence[Any] = (),
             deepspeed: bool = True, devices: int = 1, ckpt_path: Optional[str] = None, **options):
    """Fit the one-hot model once; returns (trainer, module, the exception that ended it early or None)."""
    cpu_distributed_env()
    import lightning.pytorch as pl

    settings = dict(accelerator="cpu", max_epochs=epochs, accumulate_grad_batches=gas, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False, default_root_dir=tempfile.mkdtemp())
    if deepspeed:
        settings["strategy"] = cpu_deepspeed_strategy(stage, devices)
    settings.update(options)
    trainer = pl.Trainer(callbacks=list(callbacks), **settings)
    module = one_hot_module(samples)
    try:
        trainer.fit(module, one_hot_loader(samples), ckpt_path=ckpt_path)
    except Exception as exc:  # the caller decides what an early end means
        return trainer, module, exc
    return trainer, module, None
