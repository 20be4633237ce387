"""What stepsync saw in a run: drift events and the outcome, as plain data (no rendering here)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Dict, List, Optional

from .choices import Policy
from .forecast import Forecast


class StepDriftError(RuntimeError):
    """Raised by policy ``'raise'`` at the first divergence; carries the :class:`DriftEvent`."""

    def __init__(self, event: "DriftEvent") -> None:
        self.event = event
        super().__init__(event.message())


class StepSyncConfigError(ValueError):
    """A configuration that stepsync cannot serve; raised before any training step runs."""


class Cause(str, Enum):
    """Why the two counters diverged."""

    INHERITED = "inherited when training began (a resumed checkpoint, or an engine reused by a second train())"
    PARTIAL_WINDOW = "partial window at an epoch end"
    TINY_EPOCH = "tiny epoch (N <= G)"
    ENGINE_AHEAD = "engine ahead (its windows cross epoch ends)"
    OUTSIDE_ACCUMULATE = "backward outside accelerator.accumulate()"
    UNEXPLAINED = "unexplained"


@dataclass(frozen=True)
class DriftEvent:
    """One change of the drift, seen at a step end, an epoch end or the start of training.

    Attributes:
        epoch: 1-based epoch.
        micro_batch: 1-based micro-batch index inside the epoch (0 at the start of training).
        trainer_steps: ``state.global_step`` at that moment.
        engine_steps: ``engine.global_steps`` at that moment.
        previous_drift: the drift before this event.
        where: ``"train_begin"``, ``"step_end"`` or ``"epoch_end"``.
        counter: what ``trainer_steps`` counts (the Trainer's ``global_step``, or a custom loop's updates).
    """

    epoch: int
    micro_batch: int
    trainer_steps: int
    engine_steps: int
    previous_drift: int
    cause: Cause
    remedy: str
    where: str
    counter: str = "Trainer global_step"

    @property
    def drift(self) -> int:
        return self.trainer_steps - self.engine_steps

    def message(self) -> str:
        return (
            f"step drift {self.drift:+d} at epoch {self.epoch}, micro-batch {self.micro_batch} ({self.where}): "
            f"{self.counter}={self.trainer_steps}, DeepSpeed engine global_steps={self.engine_steps}; "
            f"cause: {self.cause.value}; remedy: {self.remedy}"
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["cause"] = self.cause.name
        data["drift"] = self.drift
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "DriftEvent":
        fields = {k: v for k, v in data.items() if k != "drift"}
        fields["cause"] = Cause[fields["cause"]]
        return cls(**fields)


RECORD_FILE = "stepsync_state.json"


@dataclass(frozen=True)
class EpochCount:
    """Both counts at the end of one epoch of the run, as stepsync read them.

    Attributes:
        epoch: 1-based epoch.
        micro_batches: micro-batches this run trained in it (fewer than N after a resume or an early stop).
        trainer_steps, engine_steps: the two counts at its end.
    """

    epoch: int
    micro_batches: int
    trainer_steps: int
    engine_steps: int


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint the Trainer loaded into the engine after training (``load_best_model_at_end``).

    Attributes:
        folder: its path (``state.best_model_checkpoint``).
        trainer_steps: the Trainer's count it was saved at (from its folder name; None if that has none).
        engine_steps: the engine's ``global_steps`` once loaded (the count DeepSpeed restored).
    """

    folder: Optional[str]
    trainer_steps: Optional[int]
    engine_steps: int

    def __str__(self) -> str:
        saved = "?" if self.trainer_steps is None else self.trainer_steps
        return f"the best checkpoint {self.folder} (Trainer {saved}, engine {self.engine_steps})"


@dataclass(frozen=True)
class ResumeRecord:
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

    FORMAT = 1

    @property
    def drift(self) -> int:
        return self.trainer_steps - self.engine_steps

    def to_dict(self) -> dict:
        return {
            "format": self.FORMAT,
            "policy": self.policy,
            "trainer_steps": self.trainer_steps,
            "engine_steps": self.engine_steps,
            "resume_steps": self.resume_steps,
            "next_epoch": self.next_epoch,
            "next_skip": self.next_skip,
            "unapplied_at_save": self.unapplied_at_save,
            "events": [event.to_dict() for event in self.events],
            "corrections": self.corrections,
            "dropped_micro_batches": {str(k): v for k, v in self.dropped_micro_batches.items()},
        }

    @classmethod
    def from_dict(cls, data: dict) -> "ResumeRecord":
        """Raises ValueError naming what is wrong when ``data`` is not a record this version wrote."""
        if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
            raise ValueError(f"not a stepsync record of format {cls.FORMAT}")
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
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"a stepsync record with a missing or malformed field: {exc!r}") from None


@dataclass
class SyncReport:
    """The outcome of a run as stepsync saw it; read it from ``callback.report``.

    Attributes:
        policy: the policy in force (``realign`` after a ``sync`` fallback).
        active: False when stepsync found nothing to watch (no DeepSpeed) or switched itself off.
        inactive_reason: why it is not active.
        forecast: the prediction made at ``on_train_begin`` (None without a dataloader length).
        trainer_steps, engine_steps: the last counts read.
        inherited_drift: the drift found when training began.
        events: every change of the drift, in order.
        planned_steps: the ``max_steps`` the Trainer planned (the LR schedule's length).
        dropped_micro_batches: per 1-based epoch, micro-batches ``drop_last`` left untrained.
        unapplied_micro_batches: micro-batches the engine accumulated but never applied at the end.
        notes: statements about what stepsync did or could not check, in order.
        forecast_mismatches: epoch ends where the counts differed from the forecast.
        corrections: times policy ``realign`` set the Trainer's count to the engine's.
        finished: ``on_train_end`` was reached.
        resumed_from: the record of the checkpoint this run resumed from (its events open ``events``).
        loaded_checkpoint: the checkpoint the Trainer loaded after training (``load_best_model_at_end``), or
            None. The counts above stay those of the training that happened.
        epochs: both counts at every epoch end of this run (:class:`EpochCount`): the epochs and
            micro-batches really trained.
        counter: who keeps the first count: ``"Trainer"``, or ``"your loop"`` for :func:`stepsync.watch`.
    """

    policy: Policy
    active: bool = False
    inactive_reason: str = ""
    forecast: Optional[Forecast] = None
    trainer_steps: int = 0
    engine_steps: int = 0
    inherited_drift: int = 0
    events: List[DriftEvent] = field(default_factory=list)
    planned_steps: Optional[int] = None
    dropped_micro_batches: Dict[int, int] = field(default_factory=dict)
    unapplied_micro_batches: int = 0
    notes: List[str] = field(default_factory=list)
    forecast_mismatches: List[str] = field(default_factory=list)
    corrections: int = 0
    finished: bool = False
    resumed_from: Optional[ResumeRecord] = None
    loaded_checkpoint: Optional[LoadedCheckpoint] = None
    epochs: List[EpochCount] = field(default_factory=list)
    counter: str = "Trainer"

    @property
    def micro_batches(self) -> int:
        """Micro-batches this run trained (every epoch that ended)."""
        return sum(row.micro_batches for row in self.epochs)

    @property
    def drift(self) -> int:
        return self.trainer_steps - self.engine_steps

    @property
    def new_drift(self) -> int:
        """Drift this run added on top of what it inherited."""
        return self.drift - self.inherited_drift

    def __str__(self) -> str:
        """A few readable lines (``print(callback.report)``); ``repr`` keeps every field."""
        if not self.active and not self.events and not self.finished:
            return f"stepsync report (policy '{self.policy.value}'): not active{': ' if self.inactive_reason else ''}" \
                   f"{self.inactive_reason}"
        lines = [f"stepsync report (policy '{self.policy.value}'): {self.counter} {self.trainer_steps} updates, engine "
                 f"{self.engine_steps} (drift {self.drift:+d}"
                 + (f", {self.inherited_drift:+d} inherited)" if self.inherited_drift else ")")]
        if self.planned_steps is not None:
            lines.append(f"schedule: planned {self.planned_steps}, made {self.engine_steps}"
                         + ("" if self.schedule_finished else f" ({self.missed_updates} not made)"))
        if self.epochs:
            lines.append(f"trained: {len(self.epochs)} epoch(s), {self.micro_batches} micro-batch(es)")
        lines += [f"drift event: {event.message()}" for event in self.events]
        lines += [f"note: {note}" for note in self.notes]
        if not self.active and self.inactive_reason:
            lines.append(f"switched off: {self.inactive_reason}")
        return "\n".join(lines)

    def __rich__(self):
        from ..display.render import summary_view  # drawn by the rendering module; the report stays plain data

        return summary_view(self)

    @property
    def missed_updates(self) -> int:
        """Planned updates the engine did not make (what policy ``realign`` or a drift leaves undone)."""
        return max((self.planned_steps or 0) - self.engine_steps, 0)

    @property
    def schedule_finished(self) -> Optional[bool]:
        """Whether the engine (which steps the LR scheduler) made every update the Trainer planned."""
        if self.planned_steps is None:
            return None
        return self.engine_steps >= self.planned_steps

    def to_dict(self) -> dict:
        return {
            "policy": self.policy.value,
            "active": self.active,
            "inactive_reason": self.inactive_reason,
            "trainer_steps": self.trainer_steps,
            "engine_steps": self.engine_steps,
            "drift": self.drift,
            "inherited_drift": self.inherited_drift,
            "planned_steps": self.planned_steps,
            "events": [event.to_dict() for event in self.events],
            "dropped_micro_batches": {str(k): v for k, v in self.dropped_micro_batches.items()},
            "unapplied_micro_batches": self.unapplied_micro_batches,
            "notes": list(self.notes),
            "forecast_mismatches": list(self.forecast_mismatches),
            "corrections": self.corrections,
            "finished": self.finished,
            "resumed_from": self.resumed_from.to_dict() if self.resumed_from else None,
            "loaded_checkpoint": asdict(self.loaded_checkpoint) if self.loaded_checkpoint else None,
            "missed_updates": self.missed_updates,
            "epochs": [asdict(row) for row in self.epochs],
        }
