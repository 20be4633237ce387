"""What stepsync saw in a run, as plain data (rendering is in ``stepsync.display``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

from .choices import Policy
from .events import (
    Counted,
    DriftEvent,
    DroppedWindow,
    LostGradients,
    NonFiniteUpdate,
    RanksApart,
    SkippedUpdate,
    UnsyncedUpdate,
)
from .frameworks import TRAINER, Framework
from .prediction import Forecast
from .record import ResumeRecord
from .relayout import ResumeShift
from .tokens import TokenWeighting


@dataclass(frozen=True)
class EpochCount:
    """Both counts at the end of one epoch of the run, as stepsync read them.

    Attributes:
        epoch: 1-based epoch.
        micro_batches: micro-batches this run trained in it (fewer than N after a resume or an early stop).
        trainer_steps, engine_steps: the two counts at its end.
        engine_skipped: of ``engine_steps``, the updates the engine counted but did not apply (its
            ``skipped_steps``).
    """

    epoch: int
    micro_batches: int
    trainer_steps: int
    engine_steps: int
    engine_skipped: int = 0


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


# Findings of one kind kept as they happened, the first ones and the last; the rest are counted: what a report
# keeps, prints and saves in every checkpoint is bounded by the kinds of finding, not by the run's updates.
KEPT = 8


def keep(found: list, item: object) -> None:
    """``item`` into ``found``: appended among the first :data:`KEPT`, else in place of the last."""
    if len(found) < KEPT:
        found.append(item)
    else:
        found[-1] = item


@dataclass
class SyncReport(Counted):
    """The outcome of a run as stepsync saw it; read it from ``callback.report``.

    Attributes:
        policy: the policy in force (``realign`` after a ``sync`` fallback).
        active: False when stepsync found nothing to watch (no DeepSpeed) or switched itself off.
        inactive_reason: why it is not active.
        forecast: the prediction made at ``on_train_begin`` (None without a dataloader length).
        trainer_steps, engine_steps: both counts at the last check (each change of the drift, each epoch end, the end).
        inherited_drift: the drift found when training began.
        events: every change of the drift, in order.
        planned_steps: the ``max_steps`` the Trainer planned (the LR schedule's length).
        dropped_micro_batches: per 1-based epoch, micro-batches ``drop_last`` left untrained.
        unapplied_micro_batches: micro-batches the engine accumulated but never applied at the end.
        notes: what the user has something to learn from or to do about, in order (each said when it happened).
        not_checked: what stepsync could not tell, and why (logged at DEBUG, never in the summary).
        forecast_mismatches: epoch ends where the counts differed from the forecast.
        corrections: times policy ``realign`` set the Trainer's count to the engine's.
        finished: ``on_train_end`` was reached.
        resumed_from: the record of the checkpoint this run resumed from (its events open ``events``).
        loaded_checkpoint: the checkpoint the Trainer loaded after training (``load_best_model_at_end``), or
            None. The counts above stay those of the training that happened.
        epochs: both counts at every epoch end of this run (:class:`EpochCount`): the epochs and
            micro-batches really trained.
        framework: who keeps the first count (:mod:`stepsync.core.frameworks`); ``counter`` is its short name.
        resume_shift: when the run resumed on another layout than it was saved on (ranks, batch, G): the samples
            the Trainer's resume skips and trains twice, per epoch, counted over all ranks.
        update_flaws: what the updates themselves got wrong beyond the counts, as the forecast the run's counts
            matched says (each micro-batch's weight, gradients cleared before the engine applied them, windows
            across epochs); empty when each update trained what the framework means by one.
        engine_skipped: of ``engine_steps``, the updates the engine counted but did not apply (its own
            ``skipped_steps``, kept across resumes); ``applied_steps`` is the rest.
        skipped_updates: the updates this run saw the engine skip, where (:class:`SkippedUpdate`): the first
            :data:`KEPT` - 1 and the last, bounded whatever the run's length; ``skips_lost`` and
            ``skips_by_design`` count them all, by kind.
        weight_faults: what the installed DeepSpeed does to each micro-batch's weight in this configuration, as
            probed (:mod:`stepsync.core.weights`), said before the first micro-batch.
        non_finite: where the weights were first found not finite after an update the engine applied
            (:class:`NonFiniteUpdate`); None while they are finite or where the engine checks its gradients.
        ranks_apart: where the ranks' copies of the weights were first found to differ (:class:`RanksApart`); None
            while they agree, on one rank, or where no rank holds a whole copy (ZeRO-3).
        lost_gradients: the updates the engine applied without some of the micro-batches the loop gave it
            (:class:`LostGradients`: several backward() calls per step() on ZeRO 1 and 2): the first :data:`KEPT` - 1
            and the last; ``updates_losing`` and ``lost_micro_batches`` count them all.
        unsynced_updates: the updates whose gradients were not those of the window the loop closed, because of
            where the gradient sync was on (:class:`UnsyncedUpdate`: FSDP2 and DDP): the first :data:`KEPT` - 1 and
            the last; ``updates_unsynced`` counts them all.
        dropped_windows: the windows a torch-native loop closed and cleared with ``optimizer.zero_grad()`` and no
            ``optimizer.step()`` (:class:`DroppedWindow`: fp16's GradScaler skipping a step): the first
            :data:`KEPT` - 1 and the last; ``windows_dropped`` counts them all.
        token_weighting: how the loss weighed each trained token in the first window whose micro-batches hold
            different numbers of them (:class:`TokenWeighting`); None until such a window, or where the model has
            no output embeddings to read it at.
        updater: who makes the updates ``engine_steps`` counts: ``"engine"`` (DeepSpeed's ``global_steps``) or
            ``"optimizer"`` (its steps, in a run without DeepSpeed).
        clip_in_force: the clip norm the engine applies, where it is not the one the framework asked (0: none);
            None where they agree or nothing was asked.
        g_in_force: the micro-batches per update the engine applies, where a framework or the loop asked another
            G; None where they agree.
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
    not_checked: List[str] = field(default_factory=list)
    forecast_mismatches: List[str] = field(default_factory=list)
    corrections: int = 0
    finished: bool = False
    resumed_from: Optional[ResumeRecord] = None
    loaded_checkpoint: Optional[LoadedCheckpoint] = None
    epochs: List[EpochCount] = field(default_factory=list)
    framework: Framework = TRAINER
    resume_shift: Optional[ResumeShift] = None
    update_flaws: List[str] = field(default_factory=list)
    engine_skipped: int = 0
    skipped_updates: List[SkippedUpdate] = field(default_factory=list)
    skips_lost: int = 0
    skips_by_design: int = 0
    non_finite: Optional[NonFiniteUpdate] = None
    ranks_apart: Optional[RanksApart] = None
    weight_faults: List[str] = field(default_factory=list)
    lost_gradients: List[LostGradients] = field(default_factory=list)
    updates_losing: int = 0
    lost_micro_batches: int = 0
    unsynced_updates: List[UnsyncedUpdate] = field(default_factory=list)
    updates_unsynced: int = 0
    dropped_windows: List[DroppedWindow] = field(default_factory=list)
    windows_dropped: int = 0
    token_weighting: Optional[TokenWeighting] = None
    updater: str = "engine"
    clip_in_force: Optional[float] = None
    g_in_force: Optional[int] = None

    @property
    def counter(self) -> str:
        """Who keeps the first count, short: ``"Trainer"``, ``"Lightning"``, ``"your loop"``."""
        return self.framework.who

    @property
    def micro_batches(self) -> int:
        """Micro-batches this run trained (every epoch that ended)."""
        return sum(row.micro_batches for row in self.epochs)

    @property
    def new_drift(self) -> int:
        """Drift this run added on top of what it inherited."""
        return self.drift - self.inherited_drift

    def __str__(self) -> str:
        """A few readable lines (``print(callback.report)``); ``repr`` keeps every field."""
        if not self.active and not self.events and not self.epochs and self.forecast is None:  # never watched
            return f"stepsync report (policy '{self.policy.value}'): not active{': ' if self.inactive_reason else ''}" \
                   f"{self.inactive_reason}"
        lines = [f"stepsync report (policy '{self.policy.value}'): {self.counter} {self.trainer_steps} updates, "
                 f"{self.updater} {self.engine_steps} (drift {self.drift:+d}"
                 + (f", {self.inherited_drift:+d} inherited)" if self.inherited_drift else ")")]
        if self.planned_steps is not None:
            lines.append(f"schedule: planned {self.planned_steps}, made {self.made()}"
                         + ("" if self.schedule_finished else f" ({self.missed_updates} not made)"))
        if self.engine_skipped:
            lines.append(f"applied: {self.applied_steps} of the engine's {self.engine_steps} updates "
                         f"({self.engine_skipped} skipped)")
        lines += [f"skipped {skip}" for skip in self._first_and_last_skips()]
        if self.non_finite is not None:
            lines.append(f"not finite: {self.non_finite}; the updates after it trained nothing")
        if self.ranks_apart is not None:
            lines.append(f"ranks apart: {self.ranks_apart}")
        if self.epochs:
            lines.append(f"trained: {len(self.epochs)} epoch(s), {self.micro_batches} micro-batch(es)")
        if self.lost_gradients:
            lines.append(f"lost: {self.lost_micro_batches} micro-batch(es) in {self.updates_losing} update(s); "
                         f"first {self.lost_gradients[0]}")
        if self.unsynced_updates:
            lines.append(f"gradient sync: {self.updates_unsynced} update(s) did not hold their window; first "
                         f"{self.unsynced_updates[0]}")
        if self.dropped_windows:
            lines.append(f"dropped: {self.windows_dropped} window(s) cleared without an update; first "
                         f"{self.dropped_windows[0]}")
        if self.unapplied_micro_batches:
            lines.append(f"never applied: the last {self.unapplied_micro_batches} micro-batch(es), in the "
                         f"{self.updater}'s window that never closed")
        if self.resume_shift is not None and not self.resume_shift.exact:
            lines.append(f"resumed on another layout: {self.resume_shift.message()}")
        lines += [f"updates: {flaw}" for flaw in self.weight_faults + self.update_flaws]
        lines += [f"drift event: {event.message()}" for event in self.events]
        lines += [f"note: {note}" for note in self.notes]
        if not self.active and self.inactive_reason:
            lines.append(f"switched off: {self.inactive_reason}")
        return "\n".join(lines)

    @property
    def applied_steps(self) -> int:
        """The engine's updates that it applied: those it counted, less those it skipped."""
        return self.engine_steps - self.engine_skipped

    @property
    def lost_updates(self) -> List[SkippedUpdate]:
        """The skipped updates kept whose data is lost (not fp16's loss-scale search); ``skips_lost`` counts all."""
        return [skip for skip in self.skipped_updates if not skip.by_design]

    @property
    def missed_updates(self) -> int:
        """Planned updates the engine did not apply (what policy ``realign``, a drift or a skip leaves undone)."""
        return max((self.planned_steps or 0) - self.applied_steps, 0)

    @property
    def schedule_finished(self) -> Optional[bool]:
        """Whether the engine applied every update the framework planned (DeepSpeed steps its LR scheduler only
        at an update it applies)."""
        if self.planned_steps is None:
            return None
        return self.applied_steps >= self.planned_steps

    def made(self) -> str:
        """The engine's updates in words: ``"4"``, ``"4 (1 skipped, 3 applied)"``, or with where the weights
        stopped being finite."""
        parts = [f"{self.engine_skipped} skipped, {self.applied_steps} applied"] if self.engine_skipped else []
        if self.non_finite is not None:
            found = self.non_finite
            parts.append(f"weights not finite {'from' if found.each_update else 'by'} update {found.engine_steps}")
        return f"{self.engine_steps} ({'; '.join(parts)})" if parts else str(self.engine_steps)

    def took_a_skip(self, skip: SkippedUpdate) -> None:
        """The engine skipped an update: counted by kind, kept where it is among the first or the last."""
        if skip.by_design:
            self.skips_by_design += 1
        else:
            self.skips_lost += 1
        keep(self.skipped_updates, skip)

    def took_lost_gradients(self, lost: LostGradients) -> None:
        """An update left out micro-batches the loop gave it: counted, kept where among the first or the last."""
        self.updates_losing += 1
        self.lost_micro_batches += lost.lost
        keep(self.lost_gradients, lost)

    def took_an_unsynced_update(self, found: UnsyncedUpdate) -> None:
        """An update whose gradients are not its window's: counted, kept where among the first or the last."""
        self.updates_unsynced += 1
        keep(self.unsynced_updates, found)

    def took_a_dropped_window(self, dropped: DroppedWindow) -> None:
        """A window cleared without an update: counted, kept where among the first or the last."""
        self.windows_dropped += 1
        keep(self.dropped_windows, dropped)

    def _first_and_last_skips(self) -> List[SkippedUpdate]:
        skips = self.skipped_updates
        return skips if len(skips) <= 2 else [skips[0], skips[-1]]

    def to_dict(self) -> dict:
        """Every field but the forecast (``forecast.to_dict()`` gives it), JSON-ready, with the drift and the
        missed updates."""
        data = asdict(replace(self, forecast=None, events=[], resumed_from=None, resume_shift=None,
                              token_weighting=None))
        del data["forecast"]
        data.update(policy=self.policy.value, framework=self.framework.name, counter=self.counter, drift=self.drift,
                    missed_updates=self.missed_updates, applied_steps=self.applied_steps,
                    events=[event.to_dict() for event in self.events],
                    dropped_micro_batches={str(k): v for k, v in self.dropped_micro_batches.items()},
                    resumed_from=self.resumed_from.to_dict() if self.resumed_from else None,
                    resume_shift=self.resume_shift.to_dict() if self.resume_shift else None,
                    token_weighting=self.token_weighting.to_dict() if self.token_weighting else None)
        return data
