"""``stepsync.resume_settings``: before ``TrainingArguments`` are built, the settings that make a resume on the ranks
a launcher hands out (Ray Train's elastic restarts, ``torchrun --nnodes MIN:MAX``) land where the run stood, and
DeepSpeed's refusal of a partitioned checkpoint on another number of ranks named before anything loads; the same for
an accelerate loop that resumes as transformers' run_*_no_trainer.py examples do.

Pure file reading (no pickle is run), except the one conversion it is asked for (DeepSpeed's ``ds_to_universal``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from ..core.choices import unsupported
from ..core.errors import StepSyncConfigError
from ..core.frameworks import SavedFolders
from ..core.record import load_record
from ..core.relayout import (
    Layout,
    ResumeShift,
    clamped,
    example_landing,
    landing,
    micro_batch_landing,
    position,
    resume_shift,
)
from ..core.versions import PlannedSteps
from .audit import audit_checkpoint
from .resume_audit import planned_here, resume_on
from .storage import RANDOM_STATES, locate

CONVERTED = "stepsync_converted"  # written into the universal copy once DeepSpeed's conversion has finished


@dataclass
class ResumeSettings:
    """What a run resuming a checkpoint on ``world_size`` ranks should set.

    Attributes:
        per_device_train_batch_size, gradient_accumulation_steps: the values to build ``TrainingArguments`` with
            (those asked where they land already, else the change that keeps the global batch and lands).
        lands_exactly: the resume lands where the saved run stood with these settings; False where no layout on
            these ranks does; None where the saved layout cannot be told (say so to the user).
        load_universal: DeepSpeed must read the checkpoint's universal copy (:meth:`deepspeed_config` adds it).
        shift: what a resume with the settings asked would do (None where they land, or nothing is known).
        notes: what was found, in words, in order.
    """

    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    lands_exactly: Optional[bool] = True
    load_universal: bool = False
    shift: Optional[ResumeShift] = None
    notes: List[str] = field(default_factory=list)

    def training_arguments(self) -> dict:
        """The ``TrainingArguments`` keywords to pass."""
        return {"per_device_train_batch_size": self.per_device_train_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}

    def deepspeed_config(self, config: dict) -> dict:
        """A copy of DeepSpeed ``config`` with ``"checkpoint": {"load_universal": true}`` where it is needed, and with
        the settings' G and batch where the config names them (its ``train_batch_size`` holds: the global batch is
        kept)."""
        config = dict(config)
        if self.load_universal:
            config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
        for key, value in (("gradient_accumulation_steps", self.gradient_accumulation_steps),
                           ("train_micro_batch_size_per_gpu", self.per_device_train_batch_size)):
            if key in config and config[key] != "auto":
                config[key] = value
        return config

    def message(self) -> str:
        """What was found and what the settings change, in words."""
        return "; ".join(self.notes)

    def lands_as_asked(self) -> str:
        return (f"the resume on {self.world_size} rank(s) with per_device_train_batch_size="
                f"{self.per_device_train_batch_size}, gradient_accumulation_steps={self.gradient_accumulation_steps} "
                "lands where the run stood: nothing to change")


def resume_settings(checkpoint: Optional[str], world_size: int, per_device_train_batch_size: int,
                    gradient_accumulation_steps: int, examples: Optional[int] = None,
                    convert: bool = False, loop: str = "trainer") -> ResumeSettings:
    """The settings that make a resume of ``checkpoint`` on ``world_size`` ranks land where the run stood.

    Call it in the training function, with the world size the launcher hands out and the batch and G the run was
    configured with, before building ``TrainingArguments``; pass the returned :meth:`ResumeSettings.training_arguments`.

    Args:
        checkpoint: a ``checkpoint-N`` folder, Ray Train's checkpoint directory (its ``checkpoint/`` inside is
            read), or None for a fresh start.
        world_size: the data-parallel ranks of the resumed run.
        per_device_train_batch_size, gradient_accumulation_steps: what the run is configured with.
        examples: the training set's length; needed only for a checkpoint saved without stepsync's record.
        convert: where DeepSpeed would refuse the checkpoint (ZeRO >= 1 saved on other ranks), convert it once to
            DeepSpeed's universal format here (the first process to get here does, the others wait) instead of
            raising.
        loop: ``"trainer"``, or ``"accelerate"`` for a loop that resumes as transformers' run_*_no_trainer.py
            examples do (``checkpoint``: their ``step_N`` or ``epoch_N`` folder from ``save_state``, its ranks read
            from its ``random_states_R.pkl`` files, its batch and G taken as the ones given; ``examples`` needed).

    Raises:
        StepSyncConfigError: DeepSpeed would refuse the checkpoint on ``world_size`` ranks and ``convert`` is False;
            the message names the conversion.
        ValueError: for a folder that holds no checkpoint, or settings below 1.
    """
    for name, value in (("world_size", world_size), ("per_device_train_batch_size", per_device_train_batch_size),
                        ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise StepSyncConfigError(f"{name} must be a whole number >= 1, got {value!r}")
    readable = (SavedFolders.TRAINER.value, SavedFolders.ACCELERATE.value)
    if loop not in readable:
        raise StepSyncConfigError(unsupported("loop", loop, readable))
    saved_by = SavedFolders(loop)
    settings = ResumeSettings(world_size, per_device_train_batch_size, gradient_accumulation_steps)
    if checkpoint is None:
        settings.notes.append("no checkpoint: a fresh start, nothing to resume")
        return settings
    if saved_by.count_in_the_record:  # accelerator.save_state's folders: the loop's place is in the record
        return _apply(settings, example_shift(os.fspath(checkpoint), world_size, per_device_train_batch_size,
                                              gradient_accumulation_steps, examples, settings.notes))
    located = locate(os.fspath(checkpoint))
    if located is None or located.loop or not os.path.isdir(located.path):
        raise StepSyncConfigError(f"{os.fspath(checkpoint)!r} holds no Trainer checkpoint: pass a checkpoint-N folder "
                                  "or Ray Train's checkpoint directory (for accelerator.save_state's folders, "
                                  "loop='accelerate')")
    folder = located.path
    audit = audit_checkpoint(folder, verify_data=False, located=located)
    planned = planned_here()
    verdict = resume_on(audit, world_size, planned, per_device_train_batch_size, gradient_accumulation_steps,
                        examples, give_examples="resume_settings(..., examples=N)")
    if verdict.refused is not None:
        if not convert:
            raise StepSyncConfigError(f"{verdict.refused}; or call resume_settings(..., convert=True) to convert it "
                                      "before the run starts")
        universal = convert_to_universal(folder, f"global_step{audit.deepspeed_step}")
        settings.notes.append(f"converted the checkpoint's DeepSpeed files for {world_size} rank(s) into {universal}")
        settings.load_universal = True
    elif audit.universal and audit.zero_stage and audit.saved_world_size not in (None, world_size):
        settings.load_universal = True
    settings.notes += verdict.notes
    if verdict.layout_unknown and not settings.load_universal:
        settings.lands_exactly = None
    return _apply(settings, verdict.shift)


def _apply(settings: ResumeSettings, shift: Optional[ResumeShift]) -> ResumeSettings:
    """The settings that land where ``shift`` says the run stood (None: nothing to change)."""
    if shift is None:
        if settings.lands_exactly:
            settings.notes.append(settings.lands_as_asked())
        return settings
    settings.shift = None if shift.exact else shift
    if shift.exact:
        settings.notes.append(shift.message())
    elif shift.fixed_layouts:
        fixed = shift.fixed_layouts[0]
        settings.per_device_train_batch_size = fixed.per_device_batch
        settings.gradient_accumulation_steps = fixed.gradient_accumulation_steps
        settings.notes.append(f"{shift.message(with_fix=False)}; these settings resume with {shift.fixes[0]} "
                              "instead, which lands where it stood")
    else:
        settings.lands_exactly = False
        settings.notes.append(shift.message())
    return settings


def example_shift(folder: str, world_size: int, batch: int, gas: int, examples: Optional[int],
                  notes: List[str]) -> Optional[ResumeShift]:
    """What the run_*_no_trainer.py examples' resume from ``folder`` does on ``world_size`` ranks (None: lands)."""
    kind, _, number = os.path.basename(os.path.normpath(folder)).partition("_")
    if kind not in ("step", "epoch") or not number.isdigit():
        raise StepSyncConfigError(f"{folder!r}: pass the step_N or epoch_N folder accelerator.save_state() wrote")
    if kind == "epoch":
        notes.append("an epoch_N checkpoint: the examples start the next epoch whole, on any number of ranks")
        return None
    ranks = {int(m.group(1)) for m in map(RANDOM_STATES.match, os.listdir(folder)) if m}
    if not ranks:
        raise StepSyncConfigError(f"{folder!r} holds no random_states_R.pkl: pass a folder accelerator.save_state() "
                                  "wrote")
    if examples is None:
        raise StepSyncConfigError("examples=... (the training set's length) is needed to place an accelerate loop's "
                                  "resume")
    saved, resumed = Layout(max(ranks) + 1, batch, gas, examples), Layout(world_size, batch, gas, examples)
    step = int(number)
    record = load_record(folder)  # stepsync.watch's: where the run really stood, whatever the name says
    place: Callable[[Layout, int], Tuple[int, int]] = example_landing
    arithmetic = f"{step} updates x G={gas} micro-batches, whole epochs first"
    if record is None:
        stood = clamped(saved, landing(saved, step, PlannedSteps.CEIL))  # accumulate(): ceil(N/G) an epoch
    else:
        stood = position(saved, record.next_epoch, record.next_skip)
        if record.unapplied_at_save:
            notes.append(f"the last {record.unapplied_at_save} micro-batch(es) before the save were trained but were "
                         "in DeepSpeed's open window: their gradients are not in the checkpoint")
        if step != record.trainer_steps and step == record.next_epoch * saved.micro_batches_per_epoch + \
                record.next_skip:  # the name counts micro-batches (accelerate's checkpointing.py), not updates
            place, arithmetic = micro_batch_landing, f"{step} micro-batches, whole epochs first"
    shift = resume_shift(saved, resumed, step, stood, PlannedSteps.CEIL, place=place)
    same = saved.world_size == world_size
    if shift.exact and same:
        return None
    where = "where it stood from stepsync's record, " if record is not None else ""
    shift.read_from_files = (f"{where}{len(ranks)} rank(s) read from its random_states files, batch {batch} and "
                             f"G={gas} taken as the ones given")
    shift.placement = (f"the examples' arithmetic ({arithmetic}) places the resume at epoch {shift.lands[0] + 1}, "
                       f"sample {shift.lands[1]} of its order")
    count = "skip the micro-batches your loop really trained in that epoch (save the count with the checkpoint)"
    shift.advice = (f"the examples count G micro-batches for an epoch's short last update: {count}" if same else
                    f"no batch or G on these ranks lands there: resume on the saved layout, or {count}")
    return shift


def convert_to_universal(folder: str, tag: str, timeout: float = 3600.0) -> str:
    """DeepSpeed's universal copy of ``folder``/``tag``, made once: the process that creates the lock file converts,
    the others wait for its mark."""
    source = os.path.join(folder, tag)
    target = f"{source}_universal"
    mark = os.path.join(target, CONVERTED)
    try:
        os.close(os.open(f"{target}.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another process converts it
        deadline = time.monotonic() + timeout
        while not os.path.isfile(mark):
            if time.monotonic() > deadline:
                raise StepSyncConfigError(f"waited {timeout:.0f} s for another process to convert {source}: remove "
                                          f"{target}.lock and {target} and start again") from None
            time.sleep(1.0)
        return target
    if not os.path.isfile(mark):
        done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", source,
                               "--output_folder", target, "--inject_missing_state"], capture_output=True, text=True)
        if done.returncode != 0:
            os.remove(f"{target}.lock")
            raise StepSyncConfigError(f"DeepSpeed's ds_to_universal could not convert {source}: "
                                      f"{done.stderr.strip()[-2000:]}")
        with open(mark, "w"):
            pass
    return target
