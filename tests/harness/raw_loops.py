"""Loops that drive the DeepSpeed engine themselves, recorded by the loop itself (independently of stepsync).

:func:`run_chat_loop` follows DeepSpeed-Chat's step-1 SFT loop (DeepSpeedExamples,
applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py): the LR schedule planned as
``epochs * ceil(len(train_dataloader) / G)`` updates and handed to ``deepspeed.initialize``, then
``model.backward(loss)`` and ``model.step()`` after every micro-batch, the engine owning G.

:func:`run_learner_loop` follows open-instruct's learner (open_instruct/grpo_fast.py, its training step before its
PR 1498): each micro-batch's loss divided by ``accumulation_steps``, ``self.model.backward(loss)`` on each, and
``self.model.step()`` only ``if (local_step + 1) % accumulation_steps == 0``, the DeepSpeed config's G being 1.

The model is one weight per sample and each micro-batch one sample's one-hot row under plain SGD at lr 1, so each
update's micro-batches, and each one's share of it, are read from the weights.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Union

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
    error: Optional[BaseException] = None


def _watched(engine: Any, policy: Optional[str], **kwargs: Any) -> Any:
    """``stepsync.watch(engine, ...)`` under ``policy``; None: not watched."""
    if policy is None:
        return None
    import stepsync

    return stepsync.watch(engine, policy=policy, console=False, **kwargs)


def _weights(engine: Any) -> Any:
    import deepspeed

    with deepspeed.zero.GatheredParameters([engine.module.weight]):
        return engine.module.weight.detach().float().clone().flatten()


def run_chat_loop(samples: int, gas: int, epochs: int, stage: int = 0, policy: Optional[str] = None,
                  save_to: Optional[str] = None, resume_from: Optional[str] = None,
                  nan_at: Optional[int] = None, load_schedule: bool = True, tracker: Any = None) -> ChatLoopRun:
    """The loop above; ``policy``: ``stepsync.watch(engine, policy=...)`` is called on its engine first (given the
    loop's dataloader length and epochs). ``save_to``: ``engine.save_checkpoint(save_to, tag=f"epoch_{e}")`` after
    every epoch; ``resume_from``: ``engine.load_checkpoint`` of such a folder first, and training from the epoch
    after it (``load_schedule=False``: without the LR scheduler's state, which then starts over); ``nan_at``: that
    micro-batch's loss (1-based, across epochs) is not finite; ``tracker``: handed to the watch."""
    cpu_distributed_env()
    import deepspeed
    import torch

    from stepsync.core.errors import StepSyncError

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
    run.watch = _watched(engine, policy, dataloader=range(samples), num_epochs=epochs, tracker=tracker)
    rows = torch.eye(samples)
    first_epoch = 0
    if resume_from:
        engine.load_checkpoint(os.path.dirname(resume_from), tag=os.path.basename(resume_from),
                               load_lr_scheduler_states=load_schedule)
        first_epoch = int(os.path.basename(resume_from).split("_")[-1]) + 1
    last, start = _weights(engine), engine.global_steps
    try:
        for epoch in range(first_epoch, epochs):
            for step in range(samples):
                loss = engine(rows[step:step + 1]).sum()
                if len(run.engine_steps) + 1 == nan_at:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
                run.engine_steps.append(engine.global_steps)
                now = _weights(engine)
                if not torch.equal(now, last) and torch.isfinite(now).all():
                    run.updates.append([i for i, moved in enumerate((now - last).tolist()) if abs(moved) > 1e-9])
                last = now
            run.epoch_ends.append(engine.global_steps)
            if save_to:
                engine.save_checkpoint(save_to, tag=f"epoch_{epoch}")
    except StepSyncError as exc:
        run.error = exc
    if run.watch is not None:
        run.watch.close()
    run.scheduler_steps = scheduler.last_epoch
    # The engine's open window at the end: the micro-batches after its count last rose.
    rose = [i for i, steps in enumerate(run.engine_steps) if steps != (run.engine_steps[i - 1] if i else start)]
    run.unapplied = len(run.engine_steps) - (rose[-1] + 1 if rose else 0)
    engine.destroy()
    return run


@dataclass
class LearnerLoopRun:
    """What the learner loop saw: the engine's count after each step(), each sample's share of the updates (1: its
    micro-batch applied whole, 0: lost), and the error a policy raised."""

    engine_steps: List[int] = field(default_factory=list)
    shares: List[float] = field(default_factory=list)
    watch: Any = None
    error: Optional[BaseException] = None
    gradient_passes: int = 0  # backward passes that reached the weight (a tensor hook of the loop's, apart from stepsync)


def run_learner_loop(accumulation_steps: Union[int, Sequence[int]], steps: int, stage: int = 0, gas: int = 1,
                     bf16: bool = False, policy: Optional[str] = None, set_boundary: bool = False,
                     managed: bool = True, torch_backward: bool = False, stated: Optional[int] = None) -> LearnerLoopRun:
    """The learner loop above, ``steps`` times ``accumulation_steps`` micro-batches of distinct samples (this rank's
    share of them where there are several ranks), or the windows ``accumulation_steps`` lists (``steps`` unread).
    ``gas``: the DeepSpeed config's G; ``set_boundary``: the loop sets the engine's boundary itself before each
    backward (the fix); ``managed=False``: the config's ``"managed_gradient_accumulation": false``;
    ``torch_backward``: ``loss.backward()`` in place of ``engine.backward(loss)`` (which DeepSpeed accepts on ZeRO
    1-3); ``stated``: the watch is given ``gradient_accumulation_steps=stated``."""
    cpu_distributed_env()
    import deepspeed
    import torch

    from stepsync.core.errors import StepSyncError

    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    windows = [accumulation_steps] * steps if isinstance(accumulation_steps, int) else list(accumulation_steps)
    samples = sum(windows) * world
    model = torch.nn.Linear(samples, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              **({"bf16": {"enabled": True}} if bf16 else {}),
              **({} if managed else {"managed_gradient_accumulation": False})}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config)
    run = LearnerLoopRun(watch=_watched(engine, policy, **({} if stated is None else
                                                           {"gradient_accumulation_steps": stated})))
    rows = torch.eye(samples, dtype=torch.bfloat16 if bf16 else torch.float32)
    before = _weights(engine)
    passes = engine.module.weight.register_hook(lambda grad: setattr(run, "gradient_passes", run.gradient_passes + 1))
    local_step = 0
    scales = []  # DeepSpeed averages each update over the ranks: a sample applied whole moves by 1 / (K * ranks * G)
    try:
        for window in windows:
            for i in range(window):
                sample = local_step * world + rank
                if set_boundary:
                    engine.set_gradient_accumulation_boundary(i + 1 == window)
                loss = engine(rows[sample:sample + 1]).sum() / window
                loss.backward() if torch_backward else engine.backward(loss)
                if i + 1 == window:
                    engine.step()
                    run.engine_steps.append(engine.global_steps)
                local_step += 1
            scales += [window * world * gas] * window * world
    except StepSyncError as exc:
        run.error = exc
    passes.remove()
    if run.watch is not None:
        run.watch.close()
    scales += [scales[-1] if scales else windows[0] * world * gas] * (samples - len(scales))
    run.shares = [round(-(after - first).item() * scale, 3)
                  for after, first, scale in zip(_weights(engine), before, scales)]
    engine.destroy()
    return run
