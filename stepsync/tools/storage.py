"""Where a run's checkpoints live, each with its step: the Trainer's ``output_dir`` (``checkpoint-N/``), Ray
Train's storage (``<storage_path>/<name>/checkpoint_<timestamp>/checkpoint/``: the folder Ray names by the time of
the report, the Trainer's checkpoint inside, its step in its ``trainer_state.json``) and an accelerate loop's
``save_state`` folders (``step_N/``, ``epoch_N/``, whatever their name: their step is DeepSpeed's own, read from its
files, for a name may count updates or micro-batches). Pure file reading."""
from __future__ import annotations

import json
import os
import re
from typing import List, NamedTuple, Optional

from ..core.errors import AuditInputError
from ..core.frameworks import SavedFolders
from ..core.record import TRAINER_STATE, step_of
from .archives import int_in_pickle

RAY_CHECKPOINT = re.compile(r"^checkpoint_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(?:\.\d+)?$")
RAY_INNER = "checkpoint"  # RayTrainReportCallback's name for the Trainer's checkpoint inside Ray's folder


RANDOM_STATES = re.compile(r"^random_states_(\d+)\.pkl$")  # accelerator.save_state's, one per process
ENGINE_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


class Located(NamedTuple):
    """One checkpoint: its name as shown, the folder that holds its files, its step (None where it cannot be read),
    and the folders it is (``saved_by``: a framework's ``checkpoints``; a loop's step is DeepSpeed's)."""

    name: str
    path: str
    step: Optional[int]
    saved_by: SavedFolders = SavedFolders.TRAINER

    @property
    def loop(self) -> bool:
        """A custom loop saved it: its count is in stepsync's record, not in the folder."""
        return self.saved_by.count_in_the_record


def is_loop_checkpoint(path: str) -> bool:
    """An ``accelerator.save_state`` folder: accelerate's random states, and no Trainer state."""
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    return TRAINER_STATE not in entries and any(RANDOM_STATES.match(name) for name in entries)


def is_engine_checkpoint(path: str) -> bool:
    """A folder ``engine.save_checkpoint`` wrote (a loop that drives DeepSpeed's engine): DeepSpeed's model states
    at its top, and neither a Trainer's state nor accelerate's random states."""
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    return any(name in entries for name in ENGINE_MODEL_STATES) and TRAINER_STATE not in entries and not any(
        RANDOM_STATES.match(name) for name in entries)


def engine_step_in(folder: str) -> Optional[int]:
    """DeepSpeed's ``global_steps`` in the model states at the top of ``folder`` (read from the pickle's opcodes)."""
    for name in ENGINE_MODEL_STATES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return int_in_pickle(path, "global_steps")
    return None


def engine_step_of(folder: str) -> Optional[int]:
    """DeepSpeed's ``global_steps`` in the checkpoint its ``latest`` file names inside ``folder`` (read from the
    pickle's opcodes, nothing run), or None."""
    try:
        with open(os.path.join(folder, "latest")) as handle:
            tag = handle.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    for name in ENGINE_MODEL_STATES:
        path = os.path.join(folder, tag, name)
        if tag and os.path.isfile(path):
            return int_in_pickle(path, "global_steps")
    return None


def _holds_checkpoints(path: str) -> bool:
    try:
        entries = [(name, os.path.join(path, name)) for name in os.listdir(path)]
    except OSError:
        return False
    # A Trainer checkpoint's own DeepSpeed tag (global_stepN inside it) is not a checkpoint of its own.
    trainers = os.path.isfile(os.path.join(path, TRAINER_STATE))
    return any(os.path.isdir(inner) and (step_of(name) is not None or RAY_CHECKPOINT.match(name)
                                         or is_loop_checkpoint(inner) or (is_engine_checkpoint(inner) and not trainers))
               for name, inner in entries)


def step_in_trainer_state(folder: str) -> Optional[int]:
    """``global_step`` in ``folder``'s ``trainer_state.json``, or None."""
    try:
        with open(os.path.join(folder, TRAINER_STATE)) as handle:
            step = json.load(handle).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def locate(path: str) -> Optional[Located]:
    """The checkpoint ``path`` names: a ``checkpoint-N`` folder, Ray Train's ``checkpoint_<timestamp>`` folder or its
    ``checkpoint/`` inside, or any folder holding a ``trainer_state.json`` (Ray's ``as_directory()`` copy); None for
    a folder that holds several (an output_dir, Ray's run folder)."""
    path = os.path.normpath(path)
    name = os.path.basename(path)
    if step_of(path) is not None:
        return Located(name, path, step_of(path))
    if _holds_checkpoints(path):  # an output folder, whatever sits at its root (save_state's trainer_state.json)
        return None
    if is_loop_checkpoint(path):
        return Located(name, path, engine_step_of(path), SavedFolders.ACCELERATE)
    if is_engine_checkpoint(path):
        return Located(name, path, engine_step_in(path), SavedFolders.ENGINE)
    inner = os.path.join(path, RAY_INNER)
    if RAY_CHECKPOINT.match(name) or (not os.path.isfile(os.path.join(path, TRAINER_STATE))
                                      and os.path.isfile(os.path.join(inner, TRAINER_STATE))):
        return Located(name, inner, step_in_trainer_state(inner))
    if os.path.isfile(os.path.join(path, TRAINER_STATE)):
        parent = os.path.basename(os.path.dirname(path))
        shown = parent if name == RAY_INNER and RAY_CHECKPOINT.match(parent) else name
        return Located(shown, path, step_in_trainer_state(path))
    return None


def checkpoints_under(path: str) -> List[Located]:
    """Every checkpoint in a Trainer ``output_dir``, a Ray Train run's storage folder or a loop's output folder,
    ordered by step; a folder whose step cannot be read comes last, by name (its audit says why)."""
    if not os.path.isdir(path):
        raise AuditInputError(f"{path!r} is not a directory: pass the Trainer's output_dir or Ray Train's run folder")
    found = [Located(name, os.path.join(path, name), step_of(name)) for name in os.listdir(path)
             if step_of(name) is not None]
    found += [located for name in os.listdir(path) if RAY_CHECKPOINT.match(name)
              and (located := locate(os.path.join(path, name))) is not None]
    found += [Located(name, inner, engine_step_of(inner), SavedFolders.ACCELERATE) for name in os.listdir(path)
              if step_of(name) is None and is_loop_checkpoint(inner := os.path.join(path, name))]
    found += [Located(name, inner, engine_step_in(inner), SavedFolders.ENGINE) for name in os.listdir(path)
              if step_of(name) is None and is_engine_checkpoint(inner := os.path.join(path, name))]
    return sorted(found, key=lambda item: (item.step is None, item.step or 0, item.name))
