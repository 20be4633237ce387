"""Loops that drive the DeepSpeed engine themselves, recorded by the loop itself (independently of stepsync).

:func:`run_chat_loop` follows DeepSpeed-Chat's step-1 SFT loop (DeepSpeedExamples,
applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py): the LR schedule planned as
``epochs * ceil(len(train_dataloader) / G)`` updates and handed to ``deepspeed.initialize``, then
``model.backward(loss)`` and ``model.step()`` after every micro-batch, the engine owning G. The model is one weight
per sample and each micro-batch one sample's one-hot row, so each update's micro-batches are read from the weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List

from stepsync.tools.tiny_run import cpu_distributed_env


@dataclass
class ChatLoopRun:
    """What the loop saw: the engine's count after every micro-batch and at each epoch's end, the updates it
    planned, the scheduler's steps, the engine's micro-batches left in its open window, and each update's samples."""

    engine_steps: List[int] = field(default_factory=list)
    epoch_ends: List[int] = field(default_factory=list)
    planned: int = 0
    scheduler_steps: int = 0
    unapplied: int = 0
    updates: List[List[int]] = field(default_factory=list)
    watch: Any = None


def run_chat_loop(samples: int, gas: int, epochs: int, stage: int = 0, watched: bool = False) -> ChatLoopRun:
    """The loop above; ``watched``: ``stepsync.watch(engine)`` is called on its engine first."""
    cpu_distributed_env()
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(samples, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    run = ChatLoopRun(planned=epochs * math.ceil(samples / gas))  # DeepSpeed-Chat's num_update_steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=config)
    if watched:
        import stepsync

        run.watch = stepsync.watch(engine, console=False)
    rows = torch.eye(samples)

    def weights():
        with deepspeed.zero.GatheredParameters([engine.module.weight]):
            return engine.module.weight.detach().clone().flatten()

    last = weights()
    for _ in range(epochs):
        for step in range(samples):
            loss = engine(rows[step:step + 1]).sum()
            engine.backward(loss)
            engine.step()
            run.engine_steps.append(engine.global_steps)
            now = weights()
            if not torch.equal(now, last):
                run.updates.append([i for i, moved in enumerate((now - last).tolist()) if abs(moved) > 1e-9])
            last = now
        run.epoch_ends.append(engine.global_steps)
    run.scheduler_steps = scheduler.last_epoch
    run.unapplied = len(run.engine_steps) - engine.global_steps * gas
    engine.destroy()
    return run
