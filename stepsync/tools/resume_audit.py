"""``stepsync inspect DIR --world-size W``: whether each checkpoint resumes on W data-parallel ranks. Pure file
reading: DeepSpeed's refusal foreseen from the files it would load (no pickle is run), with the conversion that
lifts it, and the data the Trainer would skip or train twice there, from stepsync's record or, without one, from
the checkpoint's own files."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from ..core.record import layout_from_files, record_at
from ..core.relayout import Layout, ResumeShift
from ..core.versions import PlannedSteps, Stack, behaviour_of
from .audit import CheckpointAudit


@dataclass
class ResumeOn:
    """One checkpoint resumed on ``world_size`` ranks.

    Attributes:
        refused: why DeepSpeed will refuse the load, with the command and the config line that lift it.
        shift: the samples the Trainer will skip or train twice (None when the record does not keep the layout).
        notes: what could not be told, and where the saved layout was read from.
        layout_unknown: the layout the checkpoint was saved on could not be told (the notes say why).
    """

    name: str
    world_size: int
    refused: Optional[str] = None
    shift: Optional[ResumeShift] = None
    notes: List[str] = field(default_factory=list)
    layout_unknown: bool = False

    @property
    def works(self) -> bool:
        return self.refused is None and (self.shift is None or self.shift.exact)

    def lines(self) -> List[str]:
        said = [self.refused] if self.refused else []
        if self.shift is not None:
            said.append(self.shift.message())
        return [f"{self.name} on {self.world_size} rank(s): {line}" for line in said + self.notes] or [
            f"{self.name} on {self.world_size} rank(s): resumes exactly"]

    def to_dict(self) -> dict:
        return {"name": self.name, "world_size": self.world_size, "works": self.works, "refused": self.refused,
                "shift": self.shift.to_dict() if self.shift else None, "notes": list(self.notes)}


def planned_here() -> PlannedSteps:
    """How the installed transformers plans its epochs (the newest measured release's way where it is missing)."""
    return behaviour_of(Stack.installed()).planned_steps


def resume_on(audit: CheckpointAudit, world_size: int, planned: PlannedSteps, per_device_batch: Optional[int] = None,
              gradient_accumulation_steps: Optional[int] = None, examples: Optional[int] = None,
              give_examples: str = "--examples N") -> ResumeOn:
    """Whether ``audit``'s checkpoint resumes on ``world_size`` ranks (per-device batch and G as saved unless
    given), under the Trainer's ``planned`` arithmetic. A checkpoint without stepsync's record has its layout read
    from its files, given the training set's length ``examples`` (asked for as ``give_examples`` says it)."""
    verdict = ResumeOn(audit.name, world_size)
    record = audit.record
    saved_ranks = audit.saved_world_size or (record.world_size if record is not None else None)
    tag = f"global_step{audit.deepspeed_step}" if audit.deepspeed_step is not None else None
    if audit.zero_stage and saved_ranks and saved_ranks != world_size and tag:
        if audit.universal:
            verdict.notes.append(f"a universal copy ({tag}_universal) is there: add \"checkpoint\": "
                                 "{\"load_universal\": true} to the DeepSpeed config")
        else:
            folder = os.path.join(audit.path, tag)
            verdict.refused = (
                f"DeepSpeed refuses the load: ZeRO-{audit.zero_stage}'s optimizer states are partitioned over "
                f"{saved_ranks} rank(s). Convert them once: python -m deepspeed.checkpoint.ds_to_universal "
                f"--input_folder {folder} --output_folder {folder}_universal --inject_missing_state ; then add "
                "\"checkpoint\": {\"load_universal\": true} to the DeepSpeed config")
    how = ""
    if record is None or record.layout is None:
        step = audit.trainer_state_step
        if examples is None or step is None:
            verdict.notes.append(f"no stepsync record keeps the layout it was saved on: give {give_examples} (the "
                                 "training set's length) to read it from the checkpoint's files")
            verdict.layout_unknown = True
            return verdict
        saved, how = layout_from_files(audit.path, step, examples, planned, per_device_batch,
                                       gradient_accumulation_steps)
        if saved is None:
            verdict.notes.append(how)
            verdict.layout_unknown = True
            return verdict
        record = record_at(saved, step, planned)
    saved = record.layout
    assert saved is not None  # a record read from files has one
    resumed = Layout(world_size, per_device_batch or saved.per_device_batch,
                     gradient_accumulation_steps or saved.gradient_accumulation_steps, saved.examples)
    step = record.resume_steps if record.resume_steps is not None else record.trainer_steps
    verdict.shift = record.resume_on(resumed, step, planned, audit.num_train_epochs)
    if verdict.shift is not None:
        verdict.shift.read_from_files = how
    elif how:
        verdict.notes.append(how)
    return verdict
