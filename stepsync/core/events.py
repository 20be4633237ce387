"""What happened to the counts: one :class:`DriftEvent` per change of the drift, one :class:`SkippedUpdate` per
update the engine counted but did not apply, and the :class:`NonFiniteUpdate` after which the weights were not
finite."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Optional, Tuple


class Cause(str, Enum):
    """Why the two counters diverged."""

    INHERITED = "inherited when training began (a resumed checkpoint, or an engine reused by a second train())"
    PARTIAL_WINDOW = "partial window at an epoch end"
    TINY_EPOCH = "tiny epoch (N <= G)"
    ENGINE_AHEAD = "engine ahead (its windows cross epoch ends)"
    OUTSIDE_ACCUMULATE = "backward outside accelerator.accumulate()"
    CAUGHT_UP = "the two counts agree again"
    ENGINE_NOT_STEPPED = "the engine's step() is never called (Fabric's optimizer.step() bypasses it)"
    TWO_GS = "the engine accumulates another number of micro-batches per update than the framework counts"
    BACKWARDS_PER_STEP = ("your loop calls backward() several times per step() while the engine counts its windows "
                          "in step() calls")
    UNEXPLAINED = "unexplained"


class Counted:
    """Both counts at one point, the framework's (``trainer_steps``) and the engine's (``engine_steps``), and the
    drift between them, defined here once for everything that holds both: an event, an epoch's forecast, a
    forecast, a report, a checkpoint's record."""

    __slots__ = ()

    @property
    def drift(self) -> int:
        """The framework's count less the engine's: positive where the framework is ahead."""
        return self.trainer_steps - self.engine_steps  # type: ignore[attr-defined]  # every subclass has both


# Where a check found a drift, as a message says it (the event keeps the short name).
WHERE_IN_WORDS = {"train_begin": "as training began", "step_end": "at an update", "batch_end": "after a micro-batch",
                  "epoch_end": "at the epoch's end", "forecast": "as forecast, before the first micro-batch"}


@dataclass(frozen=True)
class DriftEvent(Counted):
    """One change of the drift, seen at a step end, an epoch end or the start of training.

    Attributes:
        epoch: 1-based epoch.
        micro_batch: 1-based micro-batch index inside the epoch (0 at the start of training).
        trainer_steps: ``state.global_step`` at that moment.
        engine_steps: ``engine.global_steps`` at that moment.
        previous_drift: the drift before this event.
        where: ``"train_begin"``, ``"step_end"`` (where the framework counted an update), ``"batch_end"`` (a
            micro-batch where it did not, checked by the Lightning callback), ``"epoch_end"``, or ``"forecast"``
            (the first drift the forecast predicts, at that epoch's end, for policy ``raise``'s stop at the start).
        counter: what ``trainer_steps`` counts (the Trainer's ``global_step``, or a custom loop's updates).
        changes: the changes of the drift this entry holds: a drift that changes again and again with one cause is
            one entry, said once where it started (the fields above); ``last`` is where it stood at its last change
            (epoch, micro-batch, both counts), None while it changed once.
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
    updates: str = "DeepSpeed engine global_steps"
    changes: int = 1
    last: Optional[Tuple[int, int, int, int]] = None

    @property
    def last_drift(self) -> int:
        """The drift at this entry's last change."""
        return self.drift if self.last is None else self.last[2] - self.last[3]

    def continued(self, epoch: int, micro_batch: int, trainer_steps: int, engine_steps: int) -> DriftEvent:
        """This entry, the drift having changed once more with the same cause, at that point."""
        return replace(self, changes=self.changes + 1, last=(epoch, micro_batch, trainer_steps, engine_steps))

    def message(self) -> str:
        since = "" if self.last is None else (
            f"; then {self.changes - 1} more change(s) with the same cause, to {self.last_drift:+d} at epoch "
            f"{self.last[0]}, micro-batch {self.last[1]} ({self.counter}={self.last[2]}, {self.updates}="
            f"{self.last[3]})")
        return (
            f"step drift {self.drift:+d} at epoch {self.epoch}, micro-batch {self.micro_batch} "
            f"({WHERE_IN_WORDS.get(self.where, self.where)}): "
            f"{self.counter}={self.trainer_steps}, {self.updates}={self.engine_steps}{since}; "
            f"cause: {self.cause.value}; remedy: {self.remedy}"
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["cause"] = self.cause.name
        data["drift"] = self.drift
        return data

    @classmethod
    def from_dict(cls, data: dict) -> DriftEvent:
        fields = {k: v for k, v in data.items() if k != "drift"}
        fields["cause"] = Cause[fields["cause"]]
        if fields.get("last") is not None:
            fields["last"] = tuple(fields["last"])
        return cls(**fields)


@dataclass(frozen=True)
class SkippedUpdate:
    """An update the engine counted in ``global_steps`` but did not apply: its window trained nothing.

    Attributes:
        epoch: 1-based epoch.
        micro_batch: the micro-batch of that epoch at which the engine closed the window.
        engine_steps: the engine's count with this update in it.
        by_design: fp16's dynamic loss scale skipped it while searching for a scale (DeepSpeed's "OVERFLOW!
            Skipping step"), which it does by design; otherwise (bf16, fp32, or fp16 at its minimum scale) a
            gradient was not finite and the window's data is lost.
        at_minimum_scale: fp16's loss scale was already at its minimum, so the search could go no lower.
        loss_scale: fp16's loss scale after the skip (None in bf16 and fp32).
    """

    epoch: int
    micro_batch: int
    engine_steps: int
    by_design: bool = False
    at_minimum_scale: bool = False
    loss_scale: Optional[float] = None

    def __str__(self) -> str:
        if self.by_design:
            why = "fp16's loss scale was searching (by design)"
        elif self.at_minimum_scale:
            why = ("a gradient was not finite at fp16's minimum loss scale, which can go no lower; the window's "
                   "micro-batches trained nothing")
        else:
            why = "a gradient was not finite; the window's micro-batches trained nothing"
        return f"update {self.engine_steps} at epoch {self.epoch}, micro-batch {self.micro_batch}: {why}"


@dataclass(frozen=True)
class NonFiniteUpdate:
    """An update the engine applied with a gradient that was not finite: the weights are no longer finite, and
    every later update trains nothing (the engine does not check its gradients in this precision).

    Attributes:
        epoch: 1-based epoch.
        micro_batch: the micro-batch of that epoch at which it was found.
        engine_steps: the engine's count when it was found.
        each_update: the weights were checked after every update, so ``engine_steps`` is the very update; else
            they were checked at epoch ends only and the update is at or before it.
        why: why the engine applied it (what it does not check).
    """

    epoch: int
    micro_batch: int
    engine_steps: int
    each_update: bool = True
    why: str = ""

    def __str__(self) -> str:
        where = (f"update {self.engine_steps}" if self.each_update else
                 f"an update at or before update {self.engine_steps} (checked at epoch ends)")
        return (f"{where} at epoch {self.epoch}, micro-batch {self.micro_batch} left weights that are not finite"
                + (f": {self.why}" if self.why else ""))


@dataclass(frozen=True)
class RanksApart:
    """The ranks' copies of the weights no longer agree: a fault on one rank (a gradient left out of the average
    across ranks, a weight restored or written on one rank only, a hardware error) trains each rank apart. Found by
    comparing a fingerprint of every rank's copy at train begin, epoch ends and checkpoints.

    Attributes:
        epoch: 1-based epoch.
        micro_batch: the micro-batch of that epoch at which it was found.
        engine_steps: the engine's count when it was found: the copies parted at or before this update.
        agreed_at: the engine's count at the last comparison where they agreed (None: none did on this run).
        where: the comparison that found it ("train begin", "epoch end", "checkpoint").
        ranks: the ranks compared.
    """

    epoch: int
    micro_batch: int
    engine_steps: int
    agreed_at: Optional[int]
    where: str
    ranks: int

    def __str__(self) -> str:
        since = (f"they agreed after update {self.agreed_at}" if self.agreed_at is not None else
                 "no comparison on this run found them agreeing")
        return (f"the {self.ranks} ranks' copies of the weights differ at update {self.engine_steps} (found at the "
                f"{self.where}, epoch {self.epoch}, micro-batch {self.micro_batch}; {since})")


@dataclass(frozen=True)
class LostGradients:
    """An update the engine applied without some of the micro-batches of the window the loop closed: on ZeRO 1
    and 2 every backward() at an accumulation boundary replaces the gradients reduced before it, so a loop that
    calls backward() several times per step() keeps only those after the last boundary but one.

    Attributes:
        epoch: 1-based epoch.
        micro_batch: the micro-batch of that epoch at which the loop called step().
        engine_steps: the number of that update (the engine's count once it is made; policy 'raise' stops before
            it is).
        backwards: the loop's backward() calls since the engine's last update.
        lost: of those, the ones whose gradients the update does not hold.
        stage: the ZeRO stage.
    """

    epoch: int
    micro_batch: int
    engine_steps: int
    backwards: int
    lost: int
    stage: int

    def __str__(self) -> str:
        return (f"update {self.engine_steps} at epoch {self.epoch}, micro-batch {self.micro_batch} holds "
                f"{self.backwards - self.lost} of the {self.backwards} micro-batches your loop's backward() calls "
                f"gave it: on ZeRO-{self.stage} each backward() at a boundary of the engine replaced the gradients "
                f"before it, so {self.lost} micro-batch(es) trained nothing")

    @property
    def kept(self) -> Tuple[int, int]:
        """(micro-batches the update holds, micro-batches the loop gave it)."""
        return self.backwards - self.lost, self.backwards


@dataclass(frozen=True)
class UnsyncedUpdate:
    """An update whose gradients are not those of the window the loop closed, because of where the gradient sync
    was on: FSDP2 (``set_requires_gradient_sync``) and DDP (``no_sync()``) keep a micro-batch's gradient unreduced
    until a backward with the sync on, so an update holds, averaged across ranks, what was reduced since the last one.
    The window's micro-batches after its last synced backward wait for a later update under FSDP2 (or for none); DDP
    applies them at once, each on its own rank alone, so the ranks' weights part.

    Attributes:
        epoch: 1-based epoch.
        micro_batch: the micro-batch of that epoch at which the loop called ``optimizer.step()``.
        update: the number of that update (policy 'raise' stops before it is made).
        window: the micro-batches the loop gave it (its backward() calls since its last step).
        held: of those, the ones the update holds, reduced across ranks.
        from_earlier: micro-batches of earlier windows it holds as well (FSDP2).
        applied_alone: the window's micro-batches it does not hold are applied on their own rank only (DDP).
        cleared: the window's micro-batches an ``optimizer.zero_grad()`` inside it cleared before the update.
    """

    epoch: int
    micro_batch: int
    update: int
    window: int
    held: int
    from_earlier: int
    applied_alone: bool = False
    cleared: int = 0

    @property
    def left(self) -> int:
        """The window's micro-batches the update neither holds reduced nor lost to a zero_grad(): left for a later
        update (or none, where the sync never comes), or applied unreduced on their own rank (DDP)."""
        return self.window - self.held - self.cleared

    def __str__(self) -> str:
        where = f"update {self.update} at epoch {self.epoch}, micro-batch {self.micro_batch}"
        fix = ("run each window's other micro-batches under model.no_sync() and its last without it"
               if self.applied_alone else "model.set_requires_gradient_sync(is_last) before its forward")
        if self.cleared:
            parts = [f"optimizer.zero_grad() inside the window cleared {self.cleared} of the {self.window} "
                     "micro-batches your loop gave it before the update (call it after optimizer.step(), or before "
                     "the window's first micro-batch)"]
            if self.left:
                parts.append(f"{self.left} more are " + ("applied unreduced, each on its own rank alone"
                                                          if self.applied_alone else "left unreduced for later"))
            return f"{where}: " + "; ".join(parts)
        if not self.held and not self.from_earlier:
            applied = ("each rank applied its own micro-batches alone, unreduced, and the ranks' weights part"
                       if self.applied_alone else "the optimizer applied nothing")
            return (f"{where} received no reduced gradient: the gradient sync was off for all {self.window} "
                    f"micro-batches your loop gave it, so {applied}; turn the sync on for the last micro-batch of "
                    f"each window ({fix})")
        parts = []
        if self.left and self.applied_alone:
            parts.append(f"{self.left} of the {self.window} micro-batches your loop gave it are applied unreduced, "
                         "each on its own rank alone (the sync was off after its last synced backward), and the "
                         "ranks' weights part")
        elif self.left:
            parts.append(f"{self.left} of the {self.window} micro-batches your loop gave it wait unreduced for a "
                         "later update (the sync was off after its last synced backward)")
        if self.from_earlier:
            parts.append(f"it holds {self.from_earlier} micro-batch(es) of earlier windows")
        return (f"{where}: " + "; ".join(parts) + "; turn the sync on for the last micro-batch of each window only "
                f"({fix})")


@dataclass(frozen=True)
class DroppedWindow:
    """A window the loop closed (its last backward reduced it) whose gradients an ``optimizer.zero_grad()`` cleared
    with no ``optimizer.step()`` after it: its micro-batches trained nothing. fp16's ``GradScaler`` does it by design
    where a window's gradients are not finite (``scaler.step`` skips the step while it searches for a scale).

    Attributes:
        epoch: 1-based epoch.
        micro_batch: the micro-batch of that epoch at which the window was cleared.
        after_update: the optimizer's steps before it.
        micro_batches: the window's micro-batches, trained for nothing.
    """

    epoch: int
    micro_batch: int
    after_update: int
    micro_batches: int

    def __str__(self) -> str:
        return (f"the window of {self.micro_batches} micro-batch(es) ending at epoch {self.epoch}, micro-batch "
                f"{self.micro_batch} was cleared by optimizer.zero_grad() with no optimizer.step() after update "
                f"{self.after_update}: it trained nothing (fp16's GradScaler skips the step of a window whose "
                "gradients are not finite while it searches for a loss scale; elsewhere step before zero_grad)")

