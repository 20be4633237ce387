"""An accelerate loop's checkpoints: stepsync's record in every ``save_state`` folder, a save that a resume cannot
continue from exactly said when it is made, and a ``load_state`` that carries the report on.

transformers' ``run_*_no_trainer.py`` examples resume by their folder's name (``step_N``: ``N * G`` micro-batches
skipped, whole epochs first, with ``skip_first_batches``); the record keeps where the run really stood, so the
first micro-batch after a resume is held against it.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional, Tuple

from ..core.errors import UnsafeCheckpointError
from ..core.plan import RunPlan
from ..core.record import RECORD_FILE
from ..core.relayout import Layout, places_by_name
from ..engine.lifecycle import RunStart, start_training
from ..engine.resume import LoopSaves, Schedule, engines_schedule
from ..engine.run import Run

_NUMBER_AT_END = re.compile(r"(\d+)$")


def loop_layout(engine: Any, dataloader: Any, g: int, n: Optional[int]) -> Optional[Layout]:
    """How a loop splits its data (ranks, per-device batch, G, the dataset's length), kept in each ``save_state``
    record; None where the dataloader does not say it, or says another epoch than the ``n`` it yields."""
    # a prepared dataloader keeps its batch size on its batch sampler (accelerate's BatchSamplerShard and the like)
    batch = getattr(dataloader, "batch_size", None) or getattr(getattr(dataloader, "batch_sampler", None),
                                                                "batch_size", None)
    try:
        examples = len(dataloader.dataset)
    except (AttributeError, TypeError):
        return None
    world = getattr(engine, "dp_world_size", None) or 1
    if not isinstance(batch, int) or batch < 1 or not examples:
        return None
    stage = getattr(engine, "zero_optimization_stage", None)
    layout = Layout(int(world), batch, g, examples, stage() if callable(stage) else None,
                    getattr(dataloader, "drop_last", False) is True)
    return layout if layout.micro_batches_per_epoch == n else None


LOOP_KEEPS = ("accelerator.save_state keeps a scheduler given to prepare() in scheduler.bin and load_state restores "
              "it; one created or prepared after load_state starts over")


class LoopCheckpoints(LoopSaves):
    """What a loop watch knows of the checkpoints its accelerate loop saves (``save_state``) and loads
    (``load_state``): the record it keeps in each, the saves a resume cannot continue from, the folder read."""

    def __init__(self, accelerator: Any) -> None:
        super().__init__("load_state")
        self.accelerator = accelerator

    def after_save(self, run: Run, folder: str, loop_steps: int, since_loop_update: int) -> None:
        """Keep the record in the folder, and say a save that a resume cannot continue from exactly."""
        self.keep_the_record(run, folder, getattr(getattr(self.accelerator, "state", None), "is_local_main_process",
                                                  True))
        number = _NUMBER_AT_END.search(os.path.basename(os.path.normpath(folder)))
        engine_steps, misnamed = run.engine.global_steps, []
        if number and int(number.group(1)) == loop_steps != engine_steps:
            misnamed.append(f"its name counts your loop's {loop_steps} updates but it holds DeepSpeed's step "
                            f"{engine_steps} (drift {loop_steps - engine_steps:+d}), which a resume restores")
        self.saves.check(run, folder, since_loop_update, "save where accelerator.sync_gradients is true", misnamed)

    def start_training(self, run: Run, opened: RunStart, num_epochs: Optional[float]) -> int:
        """The first micro-batch: training starts fresh, or where the checkpoint ``load_state`` read says. Returns
        the loop's count it starts from."""
        if self.loaded is None:
            start_training(run, opened)
            return 0
        folder, record = self.loaded
        engine_steps, n = run.engine.global_steps, run.n
        skipped_here = self._skipped_by_the_loop()
        if record is None:
            # Saved without stepsync: the loop's count before it is not kept anywhere; the engine's stands for it.
            loop_steps, epoch, skip, placed = engine_steps, 0, skipped_here or 0, False
        else:
            loop_steps, epoch, skip, placed = record.trainer_steps, record.next_epoch, record.next_skip, True
            if n is not None and skip >= n:
                epoch, skip = epoch + 1, 0
            resumed, how = self._where_the_loop_resumes(folder, n, run.g, epoch, skipped_here)
            if resumed != (epoch, skip):
                # The loop's windows then restart where it resumes, not where the rule places them: no forecast.
                self._say_the_loops_resume(run, folder, (epoch, skip), resumed, how, n, record.unapplied_at_save)
                (epoch, skip), placed = resumed, False
        plan = None
        if n is not None and num_epochs is not None and placed:
            plan = RunPlan(n, run.g, num_epochs, -1, loop_steps, engine_steps, start=(epoch, skip))
        start_training(run, dataclasses.replace(opened, trainer_steps=loop_steps, plan=plan, start_epoch=epoch,
                                                skip=skip, record=record,
                                                schedules=self.schedules(run, trusted=record is not None)),
                       resumed=True)
        if record is None:
            self.say_saved_without_stepsync(run, folder, engine_steps)
        return loop_steps

    def schedules(self, run: Run, trusted: bool) -> Tuple[Schedule, ...]:
        """The LR schedulers the loop prepared: DeepSpeed's own type the engine steps; a torch one accelerate steps
        once per process at each of the loop's updates (once, with split_batches), held against the loop's count only
        where it is ``trusted`` (a record kept it)."""
        found = list(engines_schedule(run.engine))
        state = getattr(self.accelerator, "state", None)
        for prepared in getattr(self.accelerator, "_schedulers", None) or []:
            inner = getattr(prepared, "scheduler", prepared)
            if inner is getattr(run.engine, "lr_scheduler", None) or not trusted or \
                    not getattr(prepared, "step_with_optimizer", False):
                continue
            per_update = 1 if getattr(prepared, "split_batches", False) else int(
                getattr(state, "num_processes", 1) or 1)
            found.append(Schedule(prepared, False, LOOP_KEEPS, per_update))
        return tuple(found)

    def _skipped_by_the_loop(self) -> Optional[int]:
        """The micro-batches the loop skipped in the epoch it resumes in (accelerate's ``skip_first_batches``)."""
        loader = getattr(getattr(self.accelerator, "gradient_state", None), "active_dataloader", None)
        if loader is None:
            return None
        # skip_first_batches puts the count on the loader, its batch sampler or its sampler, by the loader's kind.
        for holder in (loader, getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
            skipped = getattr(holder, "skip_batches", None)
            if isinstance(skipped, int) and skipped > 0:
                return skipped
        return 0

    @staticmethod
    def _where_the_loop_resumes(folder: str, n: Optional[int], g: int, epoch: int,
                                skipped: Optional[int]) -> Tuple[Tuple[int, int], str]:
        """(0-based epoch, micro-batches skipped in it) where the loop resumes, and how that is known: the examples'
        arithmetic on the folder's name (accelerate's checkpointing.py or transformers' run_*_no_trainer.py),
        whichever skips what the loop skipped (``skip_first_batches``); else the record's epoch at that skip."""
        name = os.path.basename(os.path.normpath(folder))
        at = skipped or 0
        found = {place: how for how, place in places_by_name(name, n or 0, g) if place[1] == at}
        if len(found) == 1:
            (place, how), = found.items()
            return place, f"as {how} places {name}"
        return (epoch, at if skipped is not None else 0), "skip_first_batches"

    @staticmethod
    def _say_the_loops_resume(run: Run, folder: str, saved: Tuple[int, int], resumed: Tuple[int, int], how: str,
                              n: Optional[int], unapplied: int) -> None:
        """The loop resumed elsewhere than the checkpoint was saved at (another epoch, or another micro-batch of it):
        micro-batches skipped or trained twice (training again those whose gradients the save lost applies them
        once)."""
        name = os.path.basename(os.path.normpath(folder))
        per_epoch = n or 0
        saved_at, resumed_at = saved[0] * per_epoch + saved[1], resumed[0] * per_epoch + resumed[1]
        lost = min(unapplied, saved[1])
        stood = f"epoch {saved[0] + 1}, after micro-batch {saved[1]}"
        lands = f"epoch {resumed[0] + 1}, after micro-batch {resumed[1]}"
        if resumed_at > saved_at:
            what = f"skips {resumed_at - saved_at} micro-batch(es) that were never trained"
        elif saved_at - resumed_at <= lost:
            run.voice.note(f"{name} was saved at {stood} with {lost} in DeepSpeed's open window; your loop resumes at "
                           f"{lands}, so it trains again {saved_at - resumed_at} whose gradients the save lost: each "
                           "is applied once")
            return
        else:
            what = f"trains {saved_at - resumed_at - lost} micro-batch(es) a second time"
        text = (f"{name} was saved at {stood}, but your loop resumes at {lands} ({how}): it {what}; place the resume "
                f"with the position stepsync saved ({RECORD_FILE}: next_epoch, next_skip), not with the folder's name")
        run.object_to(text, "before the first micro-batch", UnsafeCheckpointError)
