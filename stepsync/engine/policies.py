"""One small class per policy. The run asks its action at fixed points; the action answers with a
:class:`Steering` (what the framework must change) or None, and never touches the framework itself.

An action that cannot serve the run says so by returning a :class:`Steering` whose ``replacement`` is the
action that takes over from then on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Type

from ..core import rules
from ..core.choices import Policy
from ..core.errors import StepDriftError, StepSyncConfigError
from ..core.forecast import forecast
from ..core.versions import EngineBoundary
from .deepspeed import BoundaryOverride

if TYPE_CHECKING:  # pragma: no cover
    from ..core.events import DriftEvent
    from .run import Run


NEVER, AT_DRIFT, AT_UPDATES, EVERY_MICRO_BATCH = 0, 1, 2, 3


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
    # When the run calls after_micro_batch: NEVER (watching only), AT_DRIFT (where the framework counted an update
    # and the counts differ), AT_UPDATES (where the framework counted an update), or EVERY_MICRO_BATCH.
    steers = NEVER

    def begin(self, run: Run) -> Optional[Steering]:
        """At the start of training, after the forecast."""
        return None

    def before_epoch(self, run: Run) -> None:
        """Before the epoch's first micro-batch (at ``run.position + 1``) runs."""

    def after_micro_batch(self, run: Run, trainer_updated: bool, engine_updated: bool,
                          trainer_steps: int) -> Optional[Steering]:
        """After a micro-batch (each one under ``EVERY_MICRO_BATCH``, those where the framework counted an update
        under ``AT_UPDATES``), before the drift check. An action that steers every micro-batch prepares the next
        one here."""
        return None

    def at_epoch_end(self, run: Run, trainer_steps: int) -> Optional[Steering]:
        """At the epoch's end, before the drift check."""
        return None

    def on_drift(self, event: DriftEvent) -> None:
        """When the drift changes."""

    def end(self, run: Run) -> None:
        """At the end of training or when stepsync switches itself off: leave the engine as it was."""

    def last_position(self, run: Run) -> Optional[int]:
        """The position after which the epoch ends (``run.n`` unless the policy ends it earlier)."""
        return run.n


def lowered_plan(run: Run, policy: Policy, reaching: str) -> Optional[Steering]:
    """The Trainer's ``max_steps`` lowered to the count ``policy`` ends at, when that is below the plan.

    The Trainer's end of training (last save and evaluation, a full progress bar) waits for
    ``global_step >= max_steps``; a count that stops short would end the run without them.
    """
    if run.plan is None:
        return None
    reachable = forecast(run.plan, run.behaviour, policy).reachable_steps
    if reachable is None:
        return None
    run.note(f"policy '{policy.value}': {reaching} {reachable} of the {run.report.planned_steps} updates the Trainer "
             f"planned; its max_steps is lowered to {reachable} so that the run ends (last checkpoint, "
             "evaluation, progress bar) at its last update")
    return Steering(max_steps=reachable)


class WarnAction(PolicyAction):
    policy = Policy.WARN


class RaiseAction(PolicyAction):
    policy = Policy.RAISE

    def on_drift(self, event: DriftEvent) -> None:
        # Every rank reads the same counters at the same step, so every rank raises here.
        raise StepDriftError(event)


class RealignAction(PolicyAction):
    """The Trainer follows DeepSpeed: its count is set to ``engine.global_steps``."""

    policy = Policy.REALIGN
    steers = AT_DRIFT

    def begin(self, run: Run) -> Optional[Steering]:
        if run.behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER and not run.report.inherited_drift:
            run.note("policy 'realign' does nothing here: this accelerate already makes the engine update where "
                     "the Trainer counts (accelerate >= 1.8.0); it would only correct a drift from a checkpoint")
            return None
        return lowered_plan(run, self.policy, "the engine can make")

    def after_micro_batch(self, run, trainer_updated, engine_updated, trainer_steps):
        if not trainer_updated or trainer_steps == run.engine_steps_seen:
            return None
        run.report.corrections += 1
        # The flow callback decided on the Trainer's count: decide again when the engine made an update.
        return Steering(trainer_steps=run.engine_steps_seen, decide_flow_again=run.engine_moved_in_window)

    def at_epoch_end(self, run, trainer_steps):
        if trainer_steps == run.engine_steps_seen:
            return None
        run.report.corrections += 1
        return Steering(trainer_steps=run.engine_steps_seen)


class SyncAction(PolicyAction):
    """DeepSpeed follows the Trainer: the engine's boundary is set before every micro-batch."""

    policy = Policy.SYNC
    steers = EVERY_MICRO_BATCH

    def __init__(self) -> None:
        self.override: Optional[BoundaryOverride] = None
        self.expected = False  # whether the Trainer counts an update at the micro-batch now running
        self.next_update = 0  # the position (1-based, in this epoch) of the Trainer's next update
        self.n = 0

    def begin(self, run: Run) -> Optional[Steering]:
        if run.behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER:
            run.note("policy 'sync' does nothing here: this accelerate already sets DeepSpeed's boundary "
                     "from the Trainer's (accelerate >= 1.8.0)")
            return Steering(replacement=WatchOnly(Policy.SYNC))
        if not run.facts.can_override_boundary:
            return fall_back(run, f"policy 'sync' cannot steer this engine: {run.facts.why_not}")
        if run.n is None:
            return fall_back(run, "policy 'sync' needs len(train_dataloader) to know the Trainer's boundaries")
        self.n = run.n
        self.override = BoundaryOverride(run.engine)
        return None

    def before_epoch(self, run: Run) -> None:
        self.next_update = 0
        self._prepare(run)

    def _prepare(self, run: Run) -> None:
        """Set the engine's boundary for the micro-batch at ``run.position + 1``."""
        override = self.override
        if override is None:  # begin() handed the run to another action
            return
        position = run.position + 1
        if position > self.next_update:  # a new window: find where it ends
            found = rules.next_trainer_boundary(run.behaviour.trainer_rule, position, self.n, run.g, run.t_before_epoch)
            self.next_update = self.n + 1 if found is None else found
        self.expected = expected = position == self.next_update
        override.set(expected)

    def after_micro_batch(self, run, trainer_updated, engine_updated, trainer_steps):
        if trainer_updated == self.expected == engine_updated:
            self._prepare(run)
            return None
        run.error(
            f"policy 'sync' expected {'an' if self.expected else 'no'} update at epoch {run.epoch + 1}, "
            f"micro-batch {run.position}, but the Trainer {'did' if trainer_updated else 'did not'} count one "
            f"and the engine {'did' if engine_updated else 'did not'} make one; falling back to 'realign'"
        )
        self.end(run)
        fallen = fall_back(run, None)
        realign = fallen.replacement
        assert realign is not None
        now = realign.after_micro_batch(run, trainer_updated, engine_updated, trainer_steps) or Steering()
        return Steering(now.trainer_steps, now.decide_flow_again, max_steps=fallen.max_steps, replacement=realign)

    def end(self, run: Run) -> None:
        if self.override is not None:
            self.override.restore()


class DropLastAction(PolicyAction):
    """Every epoch ends after its last full window: the trailing micro-batches are not trained."""

    policy = Policy.DROP_LAST
    steers = AT_UPDATES

    def __init__(self) -> None:
        self.last_full_window: Optional[int] = None

    def begin(self, run: Run) -> Optional[Steering]:
        if run.n is None:
            run.note("policy 'drop_last' needs len(train_dataloader); without it no window is dropped")
            return Steering(replacement=WatchOnly(Policy.DROP_LAST))
        if run.n < run.g:
            raise StepSyncConfigError(
                f"policy 'drop_last' would drop every micro-batch: an epoch has {run.n} micro-batches, fewer than "
                f"gradient_accumulation_steps={run.g}; lower gradient_accumulation_steps or use policy='sync'"
            )
        if run.n % run.g == 0:
            run.note(f"policy 'drop_last' drops nothing: {run.n} micro-batches per epoch is a multiple of G={run.g}")
            return Steering(replacement=WatchOnly(Policy.DROP_LAST))
        self.last_full_window = (run.n // run.g) * run.g
        return lowered_plan(run, self.policy, "whole windows give")

    def last_position(self, run: Run) -> Optional[int]:
        return self.last_full_window

    def after_micro_batch(self, run, trainer_updated, engine_updated, trainer_steps):
        if trainer_updated and self.last_full_window <= run.position < run.n:
            run.report.dropped_micro_batches[run.epoch + 1] = run.n - run.position
            return Steering(end_epoch=True)
        return None


class WatchOnly(PolicyAction):
    """A remedy with nothing to do on this run; it keeps its name in the report."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy


def fall_back(run: Run, reason: Optional[str]) -> Steering:
    """Hand the run to ``realign`` for the rest of it, never silently drifting on."""
    if reason:
        run.error(f"{reason}; falling back to policy 'realign'")
    run.report.policy = Policy.REALIGN
    realign = RealignAction()
    started = realign.begin(run) or Steering()
    return Steering(max_steps=started.max_steps, replacement=realign)


ACTIONS: Dict[Policy, Type[PolicyAction]] = {
    Policy.WARN: WarnAction,
    Policy.RAISE: RaiseAction,
    Policy.SYNC: SyncAction,
    Policy.REALIGN: RealignAction,
    Policy.DROP_LAST: DropLastAction,
}


def action_for(policy: Policy) -> PolicyAction:
    return ACTIONS[policy]()


def watching_action(policy: Policy) -> PolicyAction:
    """The action of a run whose adapter steers the engine itself: it only watches, and raises under 'raise'."""
    return action_for(Policy.RAISE if policy is Policy.RAISE else Policy.WARN)
