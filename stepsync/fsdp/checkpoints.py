"""A torch-native loop's checkpoints, written and read with ``torch.distributed.checkpoint``: stepsync's record in
every folder ``dcp.save`` writes, a save a resume cannot continue from exactly said when it is made, and a
``dcp.load`` before the first micro-batch that carries the report on."""
from __future__ import annotations

import math
import os
from typing import Optional

from ..core.frameworks import PlannedSteps
from ..core.record import ResumeRecord
from ..core.relayout import Layout, ResumeShift, position, resume_shift
from ..engine.lifecycle import RunStart, say_the_shift
from ..engine.run import Run
from ..engine.watch import ResumingSaves


class DistributedCheckpoints(ResumingSaves):
    """What a torch-native loop's watch knows of the checkpoints its loop writes and reads with
    ``torch.distributed.checkpoint`` (``dcp.save``, ``dcp.load``): stepsync's record in each folder, a save a resume
    cannot continue from exactly, and the record read before the first micro-batch."""

    save_where = ("a checkpoint keeps no gradient, so a resume from it loses them: save after the optimizer.step() "
                  "that closes a window")

    def __init__(self) -> None:
        super().__init__("torch.distributed.checkpoint.load")


    def start_training(self, run: Run, opened: RunStart, num_epochs: Optional[float],
                       forecast_now: bool = False) -> RunStart:
        """As a resumed loop starts: also a checkpoint saved on another number of ranks, which DCP reshards (the
        weights, the optimizer's state) while the data position stays the loop's own."""
        started = super().start_training(run, opened, num_epochs, forecast_now)
        record, now = started.record, run.facts.data_parallel_size
        saved_on = getattr(record, "world_size", None)
        if record is None or saved_on in (None, now) or not record.next_skip:
            return started
        if record.layout is None or opened.layout is None:
            run.voice.warn(f"this checkpoint was saved on {saved_on} rank(s), inside epoch {record.next_epoch + 1} "
                           f"(each rank had done {record.next_skip} micro-batch(es) of it), and the run resumed on "
                           f"{now}: torch.distributed.checkpoint reshards the weights and the optimizer's state, not "
                           f"where each rank is in its data, so skipping as many micro-batches on each rank now "
                           f"trains other samples than those left: {ADVICE.format(ranks=saved_on)}")
            return started
        say_the_shift(run, skipping_as_many(record, opened.layout, num_epochs))
        return started

    def restore_steps(self, run: Run, record: Optional[ResumeRecord]) -> None:
        """The optimizer's steps are counted from the watch's start: a record carries them on."""
        if record is not None:
            run.engine.global_steps = record.engine_steps


ADVICE = "resume from a checkpoint saved at an epoch's end, or on the {ranks} rank(s) it was saved on"


def skipping_as_many(record: ResumeRecord, resumed: Layout, num_epochs: Optional[float]) -> ResumeShift:
    """What a loop resumed on ``resumed`` trains of the data, skipping on each rank the micro-batches each rank had
    done of the epoch when the checkpoint was saved (its record's layout): torch.distributed.checkpoint keeps no
    data position, so that is the loop's own count, against where the saved run stood."""
    saved, epoch, skip = record.layout, record.next_epoch, record.next_skip
    assert saved is not None
    shift = resume_shift(saved, resumed, record.trainer_steps, position(saved, epoch, skip), PlannedSteps.CEIL,
                         None if num_epochs is None else math.ceil(num_epochs),
                         place=lambda layout, _: position(layout, epoch, skip))
    shift.fixed_layouts = []  # a loop's own batch and G: the Trainer's settings name none of them
    shift.placement = (f"torch.distributed.checkpoint reshards the weights and the optimizer's state, not the data "
                       f"position: a loop that skips the {skip} micro-batch(es) each rank had done of epoch "
                       f"{epoch + 1} resumes at sample {shift.lands[1]} of its order")
    shift.advice = ADVICE.format(ranks=saved.world_size)
    return shift


def checkpoint_folder(kwargs: dict) -> Optional[str]:
    """The folder a ``dcp.save`` or ``dcp.load`` call names: its ``checkpoint_id``, or its storage's ``path``."""
    found = kwargs.get("checkpoint_id")
    if found is None:
        storage = kwargs.get("storage_writer", kwargs.get("storage_reader"))
        found = getattr(storage, "path", None)
    return None if found is None else os.fspath(found)
