"""stepsync's record in a Trainer checkpoint folder: written at every save, read back on resume.

Plain file I/O (no torch, no DeepSpeed). transformers >= 4.41 keeps the record in
``trainer_state.json`` (``stateful_callbacks``, through ``ExportableState``); older releases get
``stepsync_state.json`` next to it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any, Optional

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


def save_record(folder: str, record: ResumeRecord, stored_by_trainer: bool, trainer_state: Any) -> None:
    """Write ``record`` into checkpoint ``folder`` and, where a policy moved ``global_step`` off the data
    position, the count the Trainer's resume arithmetic needs into ``trainer_state.json``.

    ``trainer_state`` is the live ``TrainerState`` the Trainer has just saved: the file is written again from
    it, never read back, because another node saving into the same folder may be rewriting it right now.
    """
    if not stored_by_trainer:
        write_json(os.path.join(folder, RECORD_FILE), record.to_dict())
    if record.resume_steps is not None and record.resume_steps != record.trainer_steps:
        state = dataclasses.asdict(trainer_state)
        state["global_step"] = record.resume_steps
        write_json(os.path.join(folder, TRAINER_STATE), state)


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


def write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` at once: readers see the old file or the new one, never half of either."""
    folder, name = os.path.split(path)
    # A name of its own per writer: two nodes saving into one shared folder never share a temporary file.
    handle, partial = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=folder or ".")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(data, out, indent=2, sort_keys=True)
            out.write("\n")
        os.chmod(partial, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644)  # not mkstemp's 0600
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
