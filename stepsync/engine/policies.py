"""One small class per policy (the vocabulary they share is :mod:`stepsync.engine.steering`).

An action that cannot serve the run says so by returning a :class:`Steering` whose ``replacement`` is the
action that takes over from then on.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

from ..core import rules
from ..core.choices import Policy
from ..core.errors import (
    GradientsLostError,
    GradientSyncError,
    NonFiniteUpdateError,
    RanksApartError,
    StepDriftError,
    StepSyncConfigError,
    UpdateSkippedError,
)
from ..core.events import Cause, DriftEvent, LostGradients, NonFiniteUpdate, RanksApart, SkippedUpdate, UnsyncedUpdate
from ..core.forecast import forecast
from ..core.versions import EngineBoundary
from .deepspeed import BoundaryOverride
from .steering import PolicyAction, RunView, Steering, Steers


def lowered_plan(run: RunView, policy: Policy, reaching: str) -> Optional[Steering]:
    """The Trainer's ``max_steps`` lowered to the count ``policy`` ends at, when that is below the plan.

    The Trainer's end of training (last save and evaluation, a full progress bar) waits for
    ``global_step >= max_steps``; a count that stops short would end the run without them.
    """
    if run.plan is None:
        return None
    reachable = forecast(run.plan, run.behaviour, policy).reachable_steps
    if reachable is None:
        return None
    run.voice.note(f"policy '{policy.value}': {reaching} {reachable} of the {run.report.planned_steps} updates the "
                   f"Trainer planned; its max_steps is lowered to {reachable} so that the run ends (last checkpoint, "
                   "evaluation, progress bar) at its last update")
    return Steering(max_steps=reachable)


class WarnAction(PolicyAction):
    policy = Policy.WARN


class RaiseAction(PolicyAction):
    policy = Policy.RAISE

    def on_drift(self, event: DriftEvent) -> None:
        # Every rank reads the same counters at the same step, so every rank raises here.
        raise StepDriftError(event)

    def on_skipped_update(self, skip: SkippedUpdate) -> None:
        # DeepSpeed agrees on a skip across ranks (its overflow check is all-reduced): every rank raises here.
        if not skip.by_design:
            raise UpdateSkippedError(skip)

    def on_non_finite_update(self, update: NonFiniteUpdate) -> None:
        # Every rank holds the whole weights, or agrees on its part through one all-reduce: every rank raises here.
        raise NonFiniteUpdateError(update)

    def on_lost_gradients(self, lost: LostGradients) -> None:
        # Every rank counts the same backward() calls and reads the same boundary: every rank raises here.
        raise GradientsLostError(lost)

    def on_ranks_apart(self, apart: RanksApart) -> None:
        # Every rank took part in the comparison and read its one answer: every rank raises here.
        raise RanksApartError(apart)

    def on_unsynced_update(self, found: UnsyncedUpdate) -> None:
        # Every rank runs the same loop and sets the same sync: every rank raises here.
        raise GradientSyncError(found)


class RealignAction(PolicyAction):
    """The Trainer follows DeepSpeed: its count is set to ``engine.global_steps``."""

    policy = Policy.REALIGN
    steers = Steers.AT_DRIFT

    def begin(self, run: RunView) -> Optional[Steering]:
        if run.behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER and not run.report.inherited_drift:
            run.voice.note(f"policy 'realign' does nothing here: {already_follows(run)}; it would only correct a drift "
                           "from a checkpoint")
            return None
        return lowered_plan(run, self.policy, "the engine can make")

    def after_micro_batch(self, run, trainer_updated, engine_updated, trainer_steps):
        if not trainer_updated or trainer_steps == run.engine_steps_seen:
            return None
        # The flow callback decided on the Trainer's count: decide again when the engine made an update.
        return Steering(trainer_steps=run.engine_steps_seen, decide_flow_again=run.engine_moved_in_window)

    def at_epoch_end(self, run, trainer_steps):
        if trainer_steps == run.engine_steps_seen:
            return None
        return Steering(trainer_steps=run.engine_steps_seen)


class SyncAction(PolicyAction):
    """DeepSpeed follows the Trainer: the engine's boundary is set before every micro-batch."""

    policy = Policy.SYNC
    steers = Steers.EVERY_MICRO_BATCH

    def __init__(self) -> None:
        self.override: Optional[BoundaryOverride] = None
        self.expected = False  # whether the Trainer counts an update at the micro-batch now running
        self.next_update = 0  # the position (1-based, in this epoch) of the Trainer's next update
        self.n = 0

    def begin(self, run: RunView) -> Optional[Steering]:
        unsteered = leaves_the_engine_alone(run)
        if unsteered is not None:
            return unsteered
        if not run.facts.can_override_boundary:
            return fall_back(run, f"policy 'sync' cannot steer this engine: {run.facts.why_not}")
        if run.n is None:
            return fall_back(run, "policy 'sync' needs len(train_dataloader) to know the Trainer's boundaries")
        self.n = run.n
        self.override = BoundaryOverride(run.engine)
        return None

    def before_epoch(self, run: RunView) -> None:
        self.next_update = 0
        self._prepare(run)

    def _prepare(self, run: RunView) -> None:
        """Set the engine's boundary for the micro-batch at ``run.position + 1``."""
        override = self.override
        if override is None:  # begin() handed the run to another action
            return
        position = run.position + 1
        if position > self.next_update:  # a new window: find where it ends
            following = self.next_update + run.g
            if self.next_update and following <= self.n:  # a boundary before the epoch's end is G after the last
                self.next_update = following
            else:
                found = rules.next_trainer_boundary(run.behaviour.trainer_rule, position, self.n, run.g,
                                                    run.t_before_epoch)
                self.next_update = self.n + 1 if found is None else found
        self.expected = expected = position == self.next_update
        override.set(expected)

    def after_micro_batch(self, run, trainer_updated, engine_updated, trainer_steps):
        if trainer_updated == self.expected == engine_updated:
            self._prepare(run)
            return None
        run.voice.error(
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

    def sets_the_boundary(self) -> bool:
        return self.override is not None

    def end(self, run: RunView) -> None:
        if self.override is not None:
            self.override.restore()


class FollowTheLoop(SyncAction):
    """``sync`` for a loop that says itself where its windows end (accelerate's ``sync_gradients``, Fabric's
    ``no_backward_sync``): the engine's boundary is set from that word before each micro-batch. A loop's count
    cannot be realigned, so an engine that cannot be steered is refused at the start."""

    steers = Steers.NEVER

    def begin(self, run: RunView) -> Optional[Steering]:
        unsteered = leaves_the_engine_alone(run)
        if unsteered is not None:
            return unsteered
        if not run.facts.can_override_boundary:
            raise StepSyncConfigError(f"policy 'sync' cannot steer this engine: {run.facts.why_not}; use "
                                      "policy='warn'")
        self.override = BoundaryOverride(run.engine)
        return None

    def before_epoch(self, run: RunView) -> None:
        """The loop's own word comes before each micro-batch."""

    def before_micro_batch(self, run: RunView, ends_window: bool) -> None:
        if self.override is not None:
            self.override.set(ends_window)

    def closes_late(self, run: RunView) -> bool:
        if self.override is None:
            return False
        self.override.set(True)
        return True


class CloseAtTheLoopsStep(FollowTheLoop):
    """``sync`` for a loop that drives the engine itself: as :class:`FollowTheLoop`, the window closed at the loop's
    step() where its last backward() ran before the loop said it was the last. DeepSpeed's unmanaged accumulation
    already makes each step() the boundary of the backward() calls before it: nothing to steer there."""

    def begin(self, run: RunView) -> Optional[Steering]:
        if not run.facts.managed_accumulation:
            run.voice.note("policy 'sync' does nothing here: DeepSpeed's managed_gradient_accumulation is false, so "
                           f"each step() closes the window of {run.report.framework.name}'s backward() calls before it")
            return Steering(replacement=WatchOnly(Policy.SYNC))
        return super().begin(run)


def already_follows(run: RunView) -> str:
    """Why the updates already follow the framework's count, in words."""
    if not run.facts.deepspeed:
        return f"without DeepSpeed the optimizer steps where {run.report.framework.name} counts an update"
    return (f"this accelerate already makes DeepSpeed's boundary follow {run.report.framework.name} "
            "(accelerate >= 1.8.0)")


def leaves_the_engine_alone(run: RunView) -> Optional[Steering]:
    """Where sync has nothing to steer (the engine already follows) or must not (two Gs): watch only, saying why."""
    if run.behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER:
        return nothing_to_sync(run)
    if run.known_cause is Cause.TWO_GS:
        return not_one_g(run)
    return None


def not_one_g(run: RunView) -> Steering:
    """Two Gs (the framework's windows are not the engine's): steering the engine to the framework's windows would
    turn the engine's into the framework's (a loop counting every micro-batch would update at each), so sync
    watches only, and says what makes them one G."""
    run.voice.warn(f"policy 'sync' does not steer this run: the engine's gradient_accumulation_steps is "
                   f"{run.facts.gradient_accumulation_steps} and {run.report.framework.name} counts with {run.g}, and "
                   f"following its count would change what each update trains; make them one G first ({run.remedy})")
    return Steering(replacement=WatchOnly(Policy.SYNC))


def nothing_to_sync(run: RunView) -> Steering:
    run.voice.note(f"policy 'sync' does nothing here: {already_follows(run)}")
    return Steering(replacement=WatchOnly(Policy.SYNC))


class DropLastAction(PolicyAction):
    """Every epoch ends after its last full window: the trailing micro-batches are not trained."""

    policy = Policy.DROP_LAST
    steers = Steers.AT_UPDATES

    def __init__(self) -> None:
        self.last_full_window: Optional[int] = None

    def begin(self, run: RunView) -> Optional[Steering]:
        if run.n is None:
            run.voice.note("policy 'drop_last' needs len(train_dataloader); without it no window is dropped")
            return Steering(replacement=WatchOnly(Policy.DROP_LAST))
        last_full_window = last_whole_window(self.policy, run.n, run.g, run.report.framework.g_setting,
                                             " or use policy='sync'")
        if last_full_window == run.n:
            run.voice.note(f"policy 'drop_last' drops nothing: {run.n} micro-batches per epoch is a multiple of "
                           f"G={run.g}")
            return Steering(replacement=WatchOnly(Policy.DROP_LAST))
        self.last_full_window = last_full_window
        return lowered_plan(run, self.policy, "whole windows give")

    def last_position(self, run: RunView) -> Optional[int]:
        return self.last_full_window

    def after_micro_batch(self, run, trainer_updated, engine_updated, trainer_steps):
        if trainer_updated and self.last_full_window <= run.position < run.n:
            run.drop(run.epoch + 1, run.n - run.position)
            return Steering(end_epoch=True)
        return None


def last_whole_window(policy: Policy, n: int, g: int, setting: str, instead: str = "") -> int:
    """The micro-batches of an epoch of ``n`` that its whole windows of ``g`` hold; an epoch shorter than one window
    is refused (its every micro-batch would go untrained), naming ``setting`` and what to do ``instead``."""
    if n < g:
        raise StepSyncConfigError(f"policy '{policy.value}' would drop every micro-batch: an epoch has {n} "
                                  f"micro-batches, fewer than {setting}={g}; lower {setting}{instead}")
    return n - n % g


class WatchOnly(PolicyAction):
    """A remedy with nothing to do on this run; it keeps its name in the report."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy


def fall_back(run: RunView, reason: Optional[str]) -> Steering:
    """Hand the run to ``realign`` for the rest of it, never silently drifting on."""
    if reason:
        run.voice.error(f"{reason}; falling back to policy 'realign'")
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


def loop_action_for(policy: Policy) -> PolicyAction:
    """The action of a loop's run: ``sync`` follows the loop's own word on its windows; the others as anywhere."""
    return FollowTheLoop() if policy is Policy.SYNC else action_for(policy)


def engine_loop_action_for(policy: Policy) -> PolicyAction:
    """The action of a loop that drives the engine itself: ``sync`` also closes windows at its step()."""
    return CloseAtTheLoopsStep() if policy is Policy.SYNC else action_for(policy)
