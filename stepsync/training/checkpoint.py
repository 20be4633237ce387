"""stepsync's record in a Trainer checkpoint folder: written at every save, read back on resume.

Plain file I/O (no torch, no DeepSpeed). transformers >= 4.41 keeps the record in
``trainer_state.json`` (``stateful_callbacks``, through ``ExportableState``); older releases get
``stepsync_state.json`` next to it.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from ..core.report import RECORD_FILE, ResumeRecord

TRAINER_STATE = "trainer_state.json"
CALLBACK_NAME = "StepSyncCallback"


def record_in_trainer_state(trainer_state: dict, name: str = CALLBACK_NAME) -> Optional[dict]:
    """The raw record inside a loaded ``trainer_state.json`` (or ``TrainerState.stateful_callbacks``)."""
    stored = (trainer_state or {}).get(name)
    # With two instances the Trainer keeps a list and appends at every save: the newest record is the last one.
    entries = stored if isinstance(stored, list) else [stored]
    records = [(entry.get("attributes") or {}).get("saved_record") for entry in entries if isinstance(entry, dict)]
    return next((record for record in reversed(records) if record is not None), None)


def keep_a_place_in(state, name: str, exported) -> None:
    """Give callback ``name`` an entry in ``state.stateful_callbacks`` when the state was loaded from a
    checkpoint written without it: transformers >= 4.41 indexes that entry at every save (a KeyError
    otherwise). ``exported`` builds the entry."""
    stored = getattr(state, "stateful_callbacks", None)
    if isinstance(stored, dict) and name not in stored:
        stored[name] = exported()


def load_record(folder: str) -> Optional[ResumeRecord]:
    """The record saved in checkpoint ``folder``; None when there is none; ValueError when it is unreadable."""
    own = os.path.join(folder, RECORD_FILE)
    if os.path.isfile(own):
        return ResumeRecord.from_dict(read_json(own))
    state_path = os.path.join(folder, TRAINER_STATE)
    if os.path.isfile(state_path):
        raw = record_in_trainer_state(read_json(state_path).get("stateful_callbacks") or {})
        return None if raw is None else ResumeRecord.from_dict(raw)
    return None


def save_record(folder: str, record: ResumeRecord, stored_by_trainer: bool) -> None:
    """Write ``record`` into checkpoint ``folder`` and, where a policy moved ``global_step`` off the data
    position, the count the Trainer's resume arithmetic needs into ``trainer_state.json``."""
    if not stored_by_trainer:
        _write_json(os.path.join(folder, RECORD_FILE), record.to_dict())
    if record.resume_steps is not None and record.resume_steps != record.trainer_steps:
        state_path = os.path.join(folder, TRAINER_STATE)
        state = read_json(state_path)
        state["global_step"] = record.resume_steps
        _write_json(state_path, state)


def step_of(folder: Optional[str]) -> Optional[int]:
    """``N`` of a ``.../checkpoint-N`` folder, or None."""
    name = os.path.basename(os.path.normpath(folder or ""))
    prefix, _, number = name.rpartition("-")
    return int(number) if prefix == "checkpoint" and number.isdigit() else None


def read_json(path: str, what: str = "file") -> dict:
    """The JSON object in ``path``; ValueError with the fix when it is missing, unreadable or not an object."""
    if not os.path.exists(path):
        raise ValueError(f"{what} {path!r} does not exist: pass the path of a JSON file")
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{what} {path!r} is not valid JSON ({exc}): fix or delete the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path!r} must hold a JSON object, not {type(data).__name__}")
    return data


def _write_json(path: str, data: dict) -> None:
    partial = path + ".partial"
    with open(partial, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(partial, path)  # a crash mid-write never leaves half a file
