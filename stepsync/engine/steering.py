"""What a policy says to the run, and when the run asks: the vocabulary every action and the run share.

The run asks its action at fixed points; the action answers with a :class:`Steering` (what the framework must
change) or None, and never touches the framework itself. Actions read the run through :class:`RunView`, the part
of :class:`stepsync.engine.run.Run` they need.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Optional, Protocol

from ..core.choices import Policy
from ..core.events import Cause, DriftEvent, LostGradients, NonFiniteUpdate, RanksApart, SkippedUpdate, UnsyncedUpdate
from ..core.plan import RunPlan
from ..core.report import SyncReport
from ..core.versions import StackBehaviour
from .deepspeed import EngineFacts
from .messages import Voice


class Steers(IntEnum):
    """When the run asks an action about a micro-batch it finished (the hot path asks only where it must)."""

    NEVER = 0  # watching only
    AT_DRIFT = 1  # where the framework counted an update and the counts differ
    AT_UPDATES = 2  # where the framework counted an update
    EVERY_MICRO_BATCH = 3


# Plain ints for the run's hot path: CPython's fast comparison is for exact ints, not an IntEnum's members.
NEVER, AT_DRIFT, AT_UPDATES, EVERY_MICRO_BATCH = (int(member) for member in Steers)


class RunView(Protocol):
    """What an action reads and says of the run it serves; :class:`stepsync.engine.run.Run` is the one."""

    engine: Any
    facts: EngineFacts
    behaviour: StackBehaviour
    report: SyncReport
    plan: Optional[RunPlan]
    n: Optional[int]
    g: int
    epoch: int
    position: int
    t_before_epoch: int
    engine_steps_seen: int
    engine_moved_in_window: bool
    voice: Voice
    known_cause: Optional[Cause]
    remedy: str

    @property
    def policy(self) -> Policy: ...

    def drop(self, epoch: int, micro_batches: int) -> None: ...


@dataclass(frozen=True)
class Steering:
    """What the framework must change in its own loop, decided by the policy.

    Attributes:
        trainer_steps: set the framework's update count to this (``realign``).
        decide_flow_again: the framework's log/evaluate/save decision was taken on the old count: take it again
            on the new one (``realign``, when the engine made an update).
        end_epoch: end the epoch now (``drop_last``).
        max_steps: set the framework's planned updates to this (``realign`` and ``drop_last`` at the start).
        replacement: the action that acts from now on (a fallback, or a remedy with nothing to do here).
    """

    trainer_steps: Optional[int] = None
    decide_flow_again: bool = False
    end_epoch: bool = False
    max_steps: Optional[int] = None
    replacement: Optional[PolicyAction] = None


class PolicyAction:
    """Watch only. Subclasses override the points where they act."""

    policy = Policy.WARN
    steers = Steers.NEVER  # when the run calls after_micro_batch

    def begin(self, run: RunView) -> Optional[Steering]:
        """At the start of training, after the forecast."""
        return None

    def before_micro_batch(self, run: RunView, ends_window: bool) -> None:
        """Before a loop's micro-batch, with the loop's own word on whether it ends the loop's window."""

    def sets_the_boundary(self) -> bool:
        """Whether it decides the engine's boundary now (so a loop must make the engine step)."""
        return False

    def closes_late(self, run: RunView) -> bool:
        """The loop's window ends at a step() whose last backward ran at no boundary of the engine's (the loop
        said where its window ends only by stepping): whether the action makes the engine close it there."""
        return False

    def before_epoch(self, run: RunView) -> None:
        """Before the epoch's first micro-batch (at ``run.position + 1``) runs."""

    def after_micro_batch(self, run: RunView, trainer_updated: bool, engine_updated: bool,
                          trainer_steps: int) -> Optional[Steering]:
        """After a micro-batch (each one under ``EVERY_MICRO_BATCH``, those where the framework counted an update
        under ``AT_UPDATES``), before the drift check. An action that steers every micro-batch prepares the next
        one here."""
        return None

    def at_epoch_end(self, run: RunView, trainer_steps: int) -> Optional[Steering]:
        """At the epoch's end, before the drift check."""
        return None

    def on_drift(self, event: DriftEvent) -> None:
        """When the drift changes."""

    def on_skipped_update(self, skip: SkippedUpdate) -> None:
        """When the engine counted an update it did not apply."""

    def on_non_finite_update(self, update: NonFiniteUpdate) -> None:
        """When the weights are no longer finite after an update the engine applied."""

    def on_lost_gradients(self, lost: LostGradients) -> None:
        """Before an update that would leave out micro-batches the loop gave it."""

    def on_ranks_apart(self, apart: RanksApart) -> None:
        """When the ranks' copies of the weights are found to differ."""

    def on_unsynced_update(self, found: UnsyncedUpdate) -> None:
        """Before an update whose gradients are not those of the window the loop closed."""

    def end(self, run: RunView) -> None:
        """At the end of training or when stepsync switches itself off: leave the engine as it was."""

    def last_position(self, run: RunView) -> Optional[int]:
        """The position after which the epoch ends (``run.n`` unless the policy ends it earlier)."""
        return run.n
