"""A raw DeepSpeed loop's checkpoints: stepsync's record in every ``engine.save_checkpoint`` folder, a save that a
resume cannot continue from exactly said when it is made, and an ``engine.load_checkpoint`` before the first
micro-batch that carries the report on.

The loop decides itself where a resumed run starts in its data, which stepsync cannot see: a run resumed from a
checkpoint saved inside an epoch has its epochs counted from the loop's first micro-batch after the resume, said so.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from ..core.plan import RunPlan
from ..engine.lifecycle import RunStart, start_training
from ..engine.resume import LoopSaves
from ..engine.run import Run


def checkpoint_folder(save_dir: Any, tag: Any, engine: Any) -> str:
    """The folder ``engine.save_checkpoint(save_dir, tag)`` writes: DeepSpeed's default tag is ``global_stepN``."""
    return os.path.join(os.fspath(save_dir), str(tag if tag is not None else f"global_step{engine.global_steps}"))


class EngineCheckpoints(LoopSaves):
    """What the engine watch knows of the checkpoints its loop saves (``engine.save_checkpoint``) and loads
    (``load_checkpoint``): the record it keeps in each, the saves a resume cannot continue from, the folder read."""

    def __init__(self) -> None:
        super().__init__("load_checkpoint")

    def after_save(self, run: Run, folder: str, since_loop_update: int) -> None:
        """Keep the record in the folder (each node's first process), and say a save a resume cannot continue from
        exactly."""
        self.keep_the_record(run, folder, int(os.environ.get("LOCAL_RANK", "0") or 0) == 0)
        self.saves.check(run, folder, since_loop_update, "save after a step() that closes your loop's window")

    def after_load(self, run: Run, folder: Optional[str], started: bool) -> None:
        """``load_checkpoint`` read ``folder`` (None: it found no checkpoint, and loaded nothing)."""
        if folder is not None:
            super().after_load(run, folder, started)

    def start_training(self, run: Run, opened: RunStart, num_epochs: Optional[float]) -> RunStart:
        """The first micro-batch: training starts fresh, or from the checkpoint ``load_checkpoint`` read. Returns
        what it started from (the forecast is made from it at the loop's first step())."""
        if self.loaded is None:
            start_training(run, opened, forecast_now=False)
            return opened
        folder, record = self.loaded
        engine_steps, n = run.engine.global_steps, run.n
        name = os.path.basename(os.path.normpath(folder))
        if record is None:
            # Saved without stepsync: the loop's count before it is kept nowhere; the engine's stands for it.
            loop_steps, epoch, placed = engine_steps, 0, False
        else:
            loop_steps, epoch, placed = record.trainer_steps, record.next_epoch, record.next_skip == 0
            if n is not None and record.next_skip >= n:
                epoch, placed = epoch + 1, True
        plan = None
        if placed and n is not None and num_epochs is not None:
            plan = RunPlan(n, run.g, num_epochs, -1, loop_steps, engine_steps, start=(epoch, 0))
        started = dataclasses.replace(opened, trainer_steps=loop_steps, plan=plan, start_epoch=epoch, skip=0,
                                      record=record)
        start_training(run, started, resumed=True, forecast_now=False)
        if record is None:
            self.say_saved_without_stepsync(run, name, engine_steps)
        elif not placed:
            run.voice.warn(f"{name} was saved after micro-batch {record.next_skip} of epoch {record.next_epoch + 1}; "
                           "stepsync cannot see where your loop resumes in it, so it counts that epoch from your "
                           "loop's next micro-batch and makes no forecast")
        return started
