"""Custom accelerate loops for the tests, recorded by the loop itself (independently of stepsync)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from stepsync.tools.tiny_run import TinyDataset, cpu_distributed_env, tiny_model


@dataclass
class LoopRun:
    """A custom accelerate loop's run, recorded by the loop itself (independently of stepsync)."""

    accelerator: Any
    engine: Any
    watch: Any
    loop_steps: List[int] = field(default_factory=list)
    engine_steps: List[int] = field(default_factory=list)
    epoch_ends: List[tuple] = field(default_factory=list)
    error: Optional[BaseException] = None
    trained: List[tuple] = field(default_factory=list)  # (0-based epoch, the sample's tokens) of every micro-batch
    saved: Dict[str, tuple] = field(default_factory=dict)  # folder name -> (loop count, engine count) at its save
    loop_steps_at_start: int = 0
    engine_steps_at_start: int = 0

    @property
    def model(self):
        return self.engine.module

    @property
    def loop_updates_at(self) -> List[int]:
        return rises(self.loop_steps)

    @property
    def engine_updates_at(self) -> List[int]:
        return rises(self.engine_steps)


def rises(counts: List[int]) -> List[int]:
    """1-based micro-batch indices after which a counter went up."""
    return [i + 1 for i, value in enumerate(counts) if value > (counts[i - 1] if i else 0)]


def loss_alone(model):
    """The model returning its loss alone: DeepSpeed 0.18.3-0.19.5 divide the gradient again at a transformers
    model's logits (tests/integration/test_output_hooks.py), which these loops do not test."""
    import torch

    class LossAlone(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, **batch):
            return self.model(**batch).loss

    return LossAlone()


def loop_deepspeed_config(gas, stage: int = 0, bf16: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            **({"bf16": {"enabled": True}} if bf16 else {})}


def run_loop(samples: int, gas: int, epochs: int, policy: Optional[str] = "warn", stage: int = 0,
             outside_accumulate: bool = False, seed: int = 0, trackers=(),
             before_micro_batch: Optional[Callable[[int], None]] = None, bf16: bool = False,
             nan_at: Optional[int] = None, max_norm: Optional[float] = None, code_g: Optional[int] = None,
             config_g=None, told_g: Optional[int] = None, save_to: Optional[str] = None,
             resume_from: Optional[str] = None, save_every_micro_batch: bool = False,
             names_count_micro_batches: bool = False, evaluate_each_epoch: int = 0,
             log_with: Optional[List[str]] = None, project_dir: Optional[str] = None) -> LoopRun:
    """Train the tiny model with a loop shaped like transformers' run_clm_no_trainer.py on accelerate + DeepSpeed.

    ``policy=None`` runs without stepsync; ``outside_accumulate`` calls ``accelerator.backward`` outside
    ``accelerator.accumulate()`` (the pattern stepsync warns about); ``before_micro_batch`` is called with the
    1-based index of each micro-batch (across epochs) before it runs; ``bf16`` trains in bf16, and ``nan_at`` makes
    that micro-batch's loss not finite; ``max_norm`` clips as the examples do
    (``accelerator.clip_grad_norm_`` where ``sync_gradients``). ``code_g`` and ``config_g`` set G apart in
    ``Accelerator(...)`` and in the DeepSpeed config (both ``gas`` by default), ``told_g`` is what
    ``stepsync.watch`` is told the code asked.

    ``save_to`` saves ``step_N`` after every update and ``epoch_E`` after every epoch with ``accelerator.save_state``
    (``save_every_micro_batch``: at every micro-batch while ``completed_steps`` is N, as copies of the example before
    it checked ``sync_gradients`` did); ``resume_from`` loads one and places the data with the example's own
    arithmetic (transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py``).
    ``names_count_micro_batches`` names and places them as accelerate's ``examples/by_feature/checkpointing.py``
    does: ``step_N`` every G micro-batches, N counting micro-batches, and on resume N micro-batches skipped (whole
    epochs first), its count then restarting at the skip within the epoch (``overall_step += resume_step``).
    ``evaluate_each_epoch``: after every epoch, the example's evaluation: ``model.eval()`` and a forward under
    ``torch.no_grad()`` on each batch of a prepared eval dataloader of that many samples, then ``model.train()``.
    ``log_with``: the example's ``--with_tracking``: ``Accelerator(log_with=..., project_dir=project_dir)``,
    ``accelerator.init_trackers(...)`` after ``prepare`` (here after the watch too) and each tracker finished at the end.
    """
    cpu_distributed_env()
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from transformers import get_scheduler

    import stepsync

    from accelerate.state import AcceleratorState, GradientState

    # One process may run several loops (the tests do): accelerate keeps one shared state per process.
    AcceleratorState._reset_state(True)
    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)  # a bf16 run leaves it: the next fp32 loop would be bf16
    GradientState._reset_state()
    config = loop_deepspeed_config(gas if config_g is None else config_g, stage, bf16)
    accelerator = Accelerator(gradient_accumulation_steps=gas if code_g is None else code_g,
                              mixed_precision="bf16" if bf16 else None,
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), log_with=log_with,
                              project_dir=project_dir)
    accelerator.trackers.extend(trackers)  # what init_trackers() would hold: accelerator.log() writes to them
    model = loss_alone(tiny_model(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataloader = torch.utils.data.DataLoader(TinyDataset(samples), batch_size=1)
    steps_per_epoch = -(-len(dataloader) // gas)  # as run_clm_no_trainer.py plans them
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0,
                              num_training_steps=epochs * steps_per_epoch)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    engine = accelerator.deepspeed_engine_wrapped.engine
    evaluation = accelerator.prepare(torch.utils.data.DataLoader(TinyDataset(evaluate_each_epoch, seed=2),
                                                                 batch_size=1)) if evaluate_each_epoch else None
    watch = stepsync.watch(accelerator, policy, dataloader=dataloader, num_epochs=epochs, console=False,
                           gradient_accumulation_steps=told_g) if policy else None
    result = LoopRun(accelerator, engine, watch)
    if log_with:
        accelerator.init_trackers("clm_no_trainer", {"gradient_accumulation_steps": gas})
    completed, starting_epoch, resume_step = 0, 0, None
    if resume_from:  # run_clm_no_trainer.py's resume
        accelerator.load_state(resume_from)
        training_difference = os.path.splitext(os.path.basename(resume_from))[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            completed = starting_epoch * -(-len(dataloader) // gas)  # the example recounts after prepare()
        elif names_count_micro_batches:  # checkpointing.py's resume
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // len(dataloader)
            resume_step -= starting_epoch * len(dataloader)
        else:
            resume_step = int(training_difference.replace("step_", "")) * gas
            starting_epoch = resume_step // len(dataloader)
            completed = resume_step // gas
            resume_step -= starting_epoch * len(dataloader)
    result.loop_steps_at_start, result.engine_steps_at_start = completed, engine.global_steps
    try:
        for epoch in range(starting_epoch, epochs):
            model.train()
            active = dataloader
            if resume_from and epoch == starting_epoch and resume_step is not None:
                active = accelerator.skip_first_batches(dataloader, resume_step)
            for batch in active:
                result.trained.append((epoch, tuple(batch["input_ids"][0].tolist())))
                index = len(result.loop_steps) + 1
                if before_micro_batch is not None:
                    before_micro_batch(index)
                scale = float("nan") if index == nan_at else 1.0
                if outside_accumulate:
                    accelerator.backward(model(**batch) * scale)
                    optimizer.step(), scheduler.step(), optimizer.zero_grad()
                else:
                    with accelerator.accumulate(model):
                        accelerator.backward(model(**batch) * scale)
                        if max_norm is not None and accelerator.sync_gradients:
                            accelerator.clip_grad_norm_(model.parameters(), max_norm)
                        optimizer.step(), scheduler.step(), optimizer.zero_grad()
                if accelerator.sync_gradients:  # the loop's own count of updates, as in the examples
                    completed += 1
                result.loop_steps.append(completed)
                result.engine_steps.append(engine.global_steps)
                overall = len(result.loop_steps) + ((resume_step or 0) if names_count_micro_batches else 0)
                if save_to and names_count_micro_batches and overall % gas == 0:
                    accelerator.save_state(os.path.join(save_to, f"step_{overall}"))
                    result.saved[f"step_{overall}"] = (completed, engine.global_steps)
                elif save_to and (accelerator.sync_gradients or save_every_micro_batch) and completed and \
                        not names_count_micro_batches:
                    accelerator.save_state(os.path.join(save_to, f"step_{completed}"))
                    result.saved[f"step_{completed}"] = (completed, engine.global_steps)
            if evaluation is not None:  # run_clm_no_trainer.py's evaluation after each epoch
                model.eval()
                for batch in evaluation:
                    with torch.no_grad():
                        model(**batch)
            result.epoch_ends.append((completed, engine.global_steps))
            if save_to:
                accelerator.save_state(os.path.join(save_to, f"epoch_{epoch}"))
                result.saved[f"epoch_{epoch}"] = (completed, engine.global_steps)
    except Exception as exc:  # the caller asserts on it
        result.error = exc
    finally:
        if watch is not None:
            watch.close()
        for tracker in accelerator.trackers if log_with else ():  # end_training() would also end the process group
            tracker.finish()
    return result


@dataclass
class WindowLoopRun:
    """What the autoregressive example's loop saw: its optimizer.step() calls, the engine's count after each of its
    windows, and each micro-batch's share of the updates (1: applied whole, 0: never applied)."""

    optimizer_steps: int = 0
    engine_steps: List[int] = field(default_factory=list)
    shares: List[float] = field(default_factory=list)
    watch: Any = None
    error: Optional[BaseException] = None


def run_window_loop(samples: int, gas: int, epochs: int, stage: int = 2, policy: Optional[str] = None) -> WindowLoopRun:
    """accelerate's examples/by_feature/gradient_accumulation_for_autoregressive_models.py: windows of ``gas``
    micro-batches per epoch (the last one of ``samples % gas``) gathered by hand, each micro-batch's loss normalised
    by the window's items and multiplied by G, ``accelerator.backward`` on each outside ``accumulate()``, then one
    ``optimizer.step()`` per window; G given to the DeepSpeed plugin and the Accelerator alike. The model is one
    weight per sample under plain SGD at lr 1 and each micro-batch one sample's one-hot row, so each micro-batch's
    share is read from the weights (DeepSpeed divides by G again: a window applied whole moves each of its samples
    by 1 / its length)."""
    cpu_distributed_env()
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    import stepsync
    from stepsync.core.errors import StepSyncError

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=gas,
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=loop_deepspeed_config(gas, stage)))
    model = torch.nn.Linear(samples, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    dataloader = torch.utils.data.DataLoader(torch.eye(samples), batch_size=1)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    engine = accelerator.deepspeed_engine_wrapped.engine
    run = WindowLoopRun()
    if policy is not None:
        run.watch = stepsync.watch(accelerator, policy, dataloader=dataloader, num_epochs=epochs, console=False,
                                   gradient_accumulation_steps=gas)
    total_updates = -(-len(dataloader) // gas)
    remainder = len(dataloader) % gas or gas
    moved = torch.zeros(samples)
    try:
        for _ in range(epochs):
            iterator = iter(dataloader)
            for update_step in range(total_updates):
                window = [next(iterator) for _ in range(gas if update_step != total_updates - 1 else remainder)]
                before = engine.module.weight.detach().clone().flatten()
                for row in window:
                    accelerator.backward(model(row).sum() / len(window) * gas)  # num_items_in_batch, times G
                optimizer.step()
                optimizer.zero_grad()
                run.optimizer_steps += 1
                run.engine_steps.append(engine.global_steps)
                moved += (before - engine.module.weight.detach().flatten()) * len(window)
    except StepSyncError as exc:
        run.error = exc
    if run.watch is not None:
        run.watch.close()
    run.shares = [round(value / epochs, 3) for value in moved.tolist()]
    return run


def accumulate_one_window(accelerator: Any, model: Any, optimizer: Any, policy: Optional[str], g: int,
                          world: int) -> tuple:
    """Rank r trains samples r*g .. r*g+g-1 of a model of one weight per sample, in order, through accumulate(),
    watched by stepsync under ``policy`` (None: not watched): (the type name of the exception that ended it, or None;
    what stepsync said of each micro-batch's weight, or None unwatched)."""
    import torch
    import torch.distributed as dist

    import stepsync

    rank, error, watch = dist.get_rank(), None, None
    try:
        watch = stepsync.watch(accelerator, policy, console=False) if policy else None
        for k in range(g):
            x = torch.zeros(world * g)
            x[rank * g + k] = 1
            with accelerator.accumulate(model):
                accelerator.backward(model(x)["loss"])
                optimizer.step()
                optimizer.zero_grad()
    except Exception as exc:  # asserted on
        error = type(exc).__name__
    finally:
        if watch is not None:
            watch.close()
    return error, watch.report.weight_faults if watch else None
