"""stepsync's record in a checkpoint: what it holds, and reading and writing it. Plain file I/O.

transformers >= 4.41 keeps the record in ``trainer_state.json`` (``stateful_callbacks``, through
``ExportableState``); older releases get ``stepsync_state.json`` next to it.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from . import rules
from .errors import UnreadableFileError
from .events import Counted, DriftEvent
from .relayout import Layout, ResumeShift, position, resume_shift
from .versions import PlannedSteps

RECORD_FILE = "stepsync_state.json"
TRAINER_STATE = "trainer_state.json"
CALLBACK_NAME = "StepSyncCallback"
_RNG_STATE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")


@dataclass(frozen=True)
class ResumeRecord(Counted):
    """What stepsync saves with every checkpoint, so a resumed run carries its report on.

    Attributes:
        policy: the policy in force at the save.
        trainer_steps, engine_steps: both counts at the save.
        resume_steps: the ``global_step`` from which the Trainer's resume arithmetic lands exactly at the
            next micro-batch (differs from ``trainer_steps`` under ``realign`` and ``drop_last``; None when
            no ``global_step`` lands there).
        next_epoch, next_skip: where the next micro-batch is (0-based epoch, micro-batches done in it).
        unapplied_at_save: micro-batches in DeepSpeed's open window at the save; DeepSpeed saves neither
            them nor its micro-step counter, so a resume loses their gradients and restarts its windows.
        events, corrections, dropped_micro_batches: the report so far.
        world_size, per_device_batch, gradient_accumulation_steps, examples, zero_stage, drop_last: the layout the
            run was saved on (data-parallel ranks, samples per micro-batch per rank, G, the dataset's length, whether
            the dataloader drops an epoch's tail), which a resume on another layout is compared with; None in a
            record written before they were kept.
    """

    policy: str
    trainer_steps: int
    engine_steps: int
    resume_steps: Optional[int]
    next_epoch: int
    next_skip: int
    unapplied_at_save: int = 0
    events: List[DriftEvent] = field(default_factory=list)
    corrections: int = 0
    dropped_micro_batches: Dict[int, int] = field(default_factory=dict)
    world_size: Optional[int] = None
    per_device_batch: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    examples: Optional[int] = None
    zero_stage: Optional[int] = None
    drop_last: Optional[bool] = None

    FORMAT = 1
    LAYOUT = tuple(f.name for f in fields(Layout))  # kept as fields of their own, each optional

    @property
    def layout(self) -> Optional[Layout]:
        """The layout the run was saved on, when the record keeps it."""
        world, batch, gas, examples = self.world_size, self.per_device_batch, self.gradient_accumulation_steps, \
            self.examples
        if world is None or batch is None or gas is None or examples is None:
            return None
        return Layout(world, batch, gas, examples, self.zero_stage, bool(self.drop_last))

    def resume_on(self, layout: Layout, global_step: int, planned: PlannedSteps,
                  epochs: Optional[int] = None) -> Optional[ResumeShift]:
        """What resuming this checkpoint on ``layout`` does to the data (``global_step``: the count the Trainer
        places the resume from), or None when the layouts are alike or cannot be compared (a record without its
        layout, another dataset)."""
        saved = self.layout
        if saved is None or saved.examples != layout.examples:
            return None
        if (saved.world_size, saved.per_device_batch, saved.gradient_accumulation_steps) == (
                layout.world_size, layout.per_device_batch, layout.gradient_accumulation_steps):
            return None
        return resume_shift(saved, layout, global_step, position(saved, self.next_epoch, self.next_skip), planned,
                            epochs)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["events"] = [event.to_dict() for event in self.events]
        data["dropped_micro_batches"] = {str(k): v for k, v in self.dropped_micro_batches.items()}
        return {"format": self.FORMAT, **data}

    @classmethod
    def from_dict(cls, data: dict) -> ResumeRecord:
        """Raises ValueError naming what is wrong when ``data`` is not a record this version wrote."""
        if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
            raise UnreadableFileError(f"not a stepsync record of format {cls.FORMAT}")
        try:
            return cls(
                policy=str(data["policy"]),
                trainer_steps=int(data["trainer_steps"]),
                engine_steps=int(data["engine_steps"]),
                resume_steps=None if data["resume_steps"] is None else int(data["resume_steps"]),
                next_epoch=int(data["next_epoch"]),
                next_skip=int(data["next_skip"]),
                unapplied_at_save=int(data["unapplied_at_save"]),
                events=[DriftEvent.from_dict(event) for event in data["events"]],
                corrections=int(data["corrections"]),
                dropped_micro_batches={int(k): int(v) for k, v in data["dropped_micro_batches"].items()},
                **{name: None if data.get(name) is None else int(data[name]) for name in cls.LAYOUT
                   if name != "drop_last"},
                drop_last=None if data.get("drop_last") is None else bool(data["drop_last"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UnreadableFileError(f"a stepsync record with a missing or malformed field: {exc!r}") from None


def record_in_trainer_state(stateful_callbacks: Optional[dict], name: str = CALLBACK_NAME) -> Optional[dict]:
    """The raw record inside ``trainer_state.json``'s ``stateful_callbacks`` (or ``TrainerState``'s)."""
    stored = (stateful_callbacks or {}).get(name)
    # With two instances the Trainer keeps a list and appends at every save: the newest record is the last one.
    entries = stored if isinstance(stored, list) else [stored]
    records = [(entry.get("attributes") or {}).get("saved_record") for entry in entries if isinstance(entry, dict)]
    return next((record for record in reversed(records) if record is not None), None)


def load_record(folder: str) -> Optional[ResumeRecord]:
    """The record saved in checkpoint ``folder``; None when there is none; ValueError when it is unreadable."""
    own = os.path.join(folder, RECORD_FILE)
    if os.path.isfile(own):
        return ResumeRecord.from_dict(read_json(own))
    state_path = os.path.join(folder, TRAINER_STATE)
    if os.path.isfile(state_path):
        raw = record_in_trainer_state(read_json(state_path).get("stateful_callbacks"))
        return None if raw is None else ResumeRecord.from_dict(raw)
    return None


def save_record(folder: str, record: ResumeRecord, own_file: bool, trainer_state: Callable[[], Dict[str, Any]]) -> None:
    """Write ``record`` into checkpoint ``folder`` (its own file when ``own_file``: the Trainer does not keep it)
    and, where a policy moved ``global_step`` off the data position, the count the Trainer's resume arithmetic
    needs into ``trainer_state.json``.

    ``trainer_state`` gives the live state the Trainer has just saved, as a dict: the file is written again from
    it, never read back, because another node saving into the same folder may be rewriting it right now.
    """
    if own_file:
        write_json(os.path.join(folder, RECORD_FILE), record.to_dict())
    if record.resume_steps is not None and record.resume_steps != record.trainer_steps:
        write_json(os.path.join(folder, TRAINER_STATE), {**trainer_state(), "global_step": record.resume_steps})


def step_of(folder: Optional[str]) -> Optional[int]:
    """``N`` of a ``.../checkpoint-N`` folder, or None."""
    name = os.path.basename(os.path.normpath(folder or ""))
    prefix, _, number = name.rpartition("-")
    return int(number) if prefix == "checkpoint" and number.isdigit() else None


def read_json(path: str, what: str = "file") -> dict:
    """The JSON object in ``path``; ValueError with the fix when it is missing, unreadable or not an object."""
    if not os.path.exists(path):
        raise UnreadableFileError(f"{what} {path!r} does not exist: pass the path of a JSON file")
    try:
        with open(path) as handle:
            data = json.load(handle)
    except UnicodeDecodeError:
        raise UnreadableFileError(
            f"{what} {path!r} is a binary file, not JSON (the Trainer's training_args.bin is its TrainingArguments "
            "pickled): pass a JSON file; in Python, open('args.json', 'w').write(trainer.args.to_json_string())"
        ) from None
    except OSError as exc:
        raise UnreadableFileError(f"cannot read {what} {path!r}: {exc}") from None
    except ValueError as exc:
        raise UnreadableFileError(f"{what} {path!r} is not valid JSON ({exc}): fix it, or restore it from a "
                                  "copy") from None
    if not isinstance(data, dict):
        raise UnreadableFileError(f"{what} {path!r} must hold a JSON object, not {type(data).__name__}")
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


def rng_state_ranks(entries: List[str]) -> Set[int]:
    """The processes whose RNG state the Trainer saved in a checkpoint folder (``rng_state.pth`` from one process,
    ``rng_state_R.pth`` from each of several), from the folder's file names."""
    found = [m.group(1) for m in map(_RNG_STATE.match, entries) if m]
    return {int(rank) if rank is not None else 0 for rank in found}


def record_from_files(folder: str, global_step: int, resumed: Layout,
                      planned: PlannedSteps) -> Tuple[Optional[ResumeRecord], str]:
    """For a checkpoint saved without stepsync's record: (what its record would hold, how its layout was read), or
    (None, why not) where its files do not show a layout other than ``resumed``'s (:func:`layout_from_files`; what
    the files do not tell is taken as ``resumed``'s, said)."""
    saved, how = layout_from_files(folder, global_step, resumed.examples, planned, resumed.per_device_batch,
                                   resumed.gradient_accumulation_steps, resumed.zero_stage, resumed.drop_last)
    if saved is None:
        return None, how
    if (saved.world_size, saved.per_device_batch, saved.gradient_accumulation_steps) == (
            resumed.world_size, resumed.per_device_batch, resumed.gradient_accumulation_steps):
        return None, ""
    return record_at(saved, global_step, planned), how


def layout_from_files(folder: str, global_step: int, examples: int, planned: PlannedSteps,
                      batch: Optional[int] = None, g: Optional[int] = None,
                      zero_stage: Optional[int] = None, drop_last: bool = False) -> Tuple[Optional[Layout], str]:
    """(the layout a checkpoint was saved on, how it was read from its files) or (None, why not), for a run of
    ``examples`` samples (its dataloader dropping an epoch's tail where ``drop_last``, as the resuming run's does).

    The processes come from its ``rng_state`` files, the per-device batch from its ``trainer_state.json`` (else
    ``batch``), G from the same file's ``max_steps``, ``num_train_epochs`` and ``epoch`` where one G alone fits them
    (else ``g``, said; None: the layout cannot be told)."""
    try:
        ranks = rng_state_ranks(os.listdir(folder))
        with open(os.path.join(folder, TRAINER_STATE)) as handle:
            state = json.load(handle)
        saved_batch = state.get("train_batch_size")
    except (OSError, ValueError, AttributeError):
        return None, f"{folder}: no stepsync record, and its files do not show the layout it was saved on"
    if not ranks:
        return None, f"{folder}: no stepsync record and no rng_state file: the layout it was saved on is unknown"
    world = max(ranks) + 1
    saved_batch = saved_batch if isinstance(saved_batch, int) and saved_batch > 0 else batch
    if saved_batch is None:
        return None, f"{folder}: its trainer_state.json does not keep the per-device batch it was saved with"
    per_epoch = Layout(world, saved_batch, 1, examples, drop_last=drop_last).micro_batches_per_epoch
    fitting = [fit for fit in range(1, per_epoch + 1) if _fits(state, per_epoch, fit, global_step, planned)]
    saved_g = fitting[0] if len(fitting) == 1 else g
    if saved_g is None:
        return None, (f"{folder}: {len(fitting) or 'no'} gradient_accumulation_steps fit its trainer_state.json: "
                      "the G it was saved with is unknown")
    how_g = "G from its max_steps and epoch" if len(fitting) == 1 else "G taken as this run's"
    saved = Layout(world, saved_batch, saved_g, examples, zero_stage, drop_last)
    return saved, (f"no stepsync record in the checkpoint: {world} rank(s) read from its rng_state files, batch "
                   f"{saved_batch} from its trainer_state.json, {how_g}")


def record_at(saved: Layout, global_step: int, planned: PlannedSteps) -> ResumeRecord:
    """The record a run on ``saved`` would hold at ``global_step``, standing where the Trainer's own arithmetic
    places that count."""
    g = saved.gradient_accumulation_steps
    epoch, updates = _placed(saved.micro_batches_per_epoch, g, global_step, planned)
    return ResumeRecord("", global_step, global_step, None, epoch, updates * g, **asdict(saved))


def _placed(micro_batches: int, g: int, global_step: int, planned: PlannedSteps) -> Tuple[int, int]:
    """(0-based epoch, updates done in it) where the Trainer's arithmetic places ``global_step``."""
    per_epoch = rules.planned_updates_per_epoch(planned.value, micro_batches, g)
    return divmod(global_step, per_epoch) if per_epoch else (0, 0)


def _fits(state: Dict[str, Any], micro_batches: int, g: int, global_step: int, planned: PlannedSteps) -> bool:
    """Whether a run of ``micro_batches`` per epoch with this G would have written ``state``: its planned
    ``max_steps`` and the fractional ``epoch`` the Trainer keeps at the save and logs at each logged update."""
    epochs, max_steps = state.get("num_train_epochs"), state.get("max_steps")
    per_epoch = rules.planned_updates_per_epoch(planned.value, micro_batches, g)
    if not (isinstance(epochs, (int, float)) and isinstance(max_steps, int) and per_epoch):
        return False
    if max_steps != math.ceil(per_epoch * epochs):
        return False
    logged = [(entry.get("step"), entry.get("epoch")) for entry in state.get("log_history") or []
              if isinstance(entry, dict)] + [(global_step, state.get("epoch"))]
    for step, epoch_logged in logged:
        if not isinstance(step, int) or not isinstance(epoch_logged, (int, float)):
            continue
        epoch, updates = _placed(micro_batches, g, step, planned)
        if abs(epoch_logged - (epoch + min(updates * g, micro_batches) / micro_batches)) > 1e-6:
            return False
    return True
