"""One small class per policy; the callback calls them at fixed points of every micro-batch.

Each action gets the :class:`~stepsync.training.run.RunTracker` (positions, engine, report) and the
Trainer's ``args``/``state``/``control`` where it must act on them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..core import rules
from ..core.choices import Policy
from .engine import BoundaryOverride, move_global_step_back
from ..core.forecast import forecast
from ..core.report import StepDriftError, StepSyncConfigError
from ..core.versions import EngineBoundary

if TYPE_CHECKING:  # pragma: no cover
    from .run import RunTracker


class PolicyAction:
    """Watch only. Subclasses override the points where they act."""

    policy = Policy.WARN
    acts_per_micro_batch = False  # True when before/after_micro_batch do something

    def begin(self, run: "RunTracker") -> None:
        """At ``on_train_begin``, after the forecast."""

    def before_micro_batch(self, run: "RunTracker") -> None:
        """Before the micro-batch at ``run.position + 1`` runs."""

    def after_micro_batch(self, run: "RunTracker", trainer_updated: bool, engine_updated: bool, args, state, control):
        """After a micro-batch, before the drift check."""

    def at_epoch_end(self, run: "RunTracker", args, state, control) -> None:
        """At ``on_epoch_end``, before the drift check."""

    def on_drift(self, event) -> None:
        """When the drift changes."""

    def end(self, run: "RunTracker") -> None:
        """At ``on_train_end`` or when stepsync switches itself off: leave the engine as it was."""

    def last_position(self, run: "RunTracker") -> int:
        """The position after which the epoch ends (``run.n`` unless the policy ends it earlier)."""
        return run.n


def lower_the_plan(run: "RunTracker", policy: Policy, reaching: str) -> None:
    """Set the Trainer's ``max_steps`` to the count ``policy`` ends at, when that is below the plan.

    The Trainer's end of training (last save and evaluation, a full progress bar) waits for
    ``global_step >= max_steps``; a count that stops short would end the run without them.
    """
    if run.plan is None:
        return
    reachable = forecast(run.plan, run.behaviour, policy).reachable_steps
    if reachable is not None:
        run.note(f"policy '{policy.value}': {reaching} {reachable} of the {run.state.max_steps} updates the Trainer "
                 f"planned; its max_steps is lowered to {reachable} so that the run ends (last checkpoint, "
                 "evaluation, progress bar) at its last update")
        run.state.max_steps = reachable


class WarnAction(PolicyAction):
    policy = Policy.WARN


class RaiseAction(PolicyAction):
    policy = Policy.RAISE

    def on_drift(self, event) -> None:
        # Every rank reads the same counters at the same step, so every rank raises here.
        raise StepDriftError(event)


class RealignAction(PolicyAction):
    """The Trainer follows DeepSpeed: ``state.global_step`` is set to ``engine.global_steps``."""

    policy = Policy.REALIGN
    acts_per_micro_batch = True
    _FLOW_FLAGS = ("should_log", "should_evaluate", "should_save", "should_training_stop")

    def __init__(self) -> None:
        self.engine_at_last_step_end = None

    def begin(self, run: "RunTracker") -> None:
        self.engine_at_last_step_end = run.engine_steps_seen
        if run.behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER and not run.report.inherited_drift:
            run.note("policy 'realign' does nothing here: this accelerate already makes the engine update where "
                     "the Trainer counts (accelerate >= 1.8.0); it would only correct a drift from a checkpoint")
            return
        lower_the_plan(run, self.policy, "the engine can make")

    def after_micro_batch(self, run, trainer_updated, engine_updated, args, state, control):
        if not trainer_updated:
            return
        engine_steps = run.engine_steps_seen
        made_update = engine_steps != self.engine_at_last_step_end
        self.engine_at_last_step_end = engine_steps
        if state.global_step == engine_steps:
            return
        move_global_step_back(run.trainer, state, engine_steps)
        run.report.corrections += 1
        # DefaultFlowCallback decided logging/saving on the Trainer's count: decide again on the engine's.
        for flag in self._FLOW_FLAGS:
            setattr(control, flag, False)
        if made_update:
            from transformers.trainer_callback import DefaultFlowCallback

            DefaultFlowCallback().on_step_end(args, state, control)

    def at_epoch_end(self, run, args, state, control) -> None:
        if state.global_step != run.engine_steps_seen:
            move_global_step_back(run.trainer, state, run.engine_steps_seen)
            run.report.corrections += 1


class SyncAction(PolicyAction):
    """DeepSpeed follows the Trainer: the engine's boundary is set before every micro-batch."""

    policy = Policy.SYNC
    acts_per_micro_batch = True

    def __init__(self) -> None:
        self.override = None
        self.expected = False

    def begin(self, run: "RunTracker") -> None:
        if run.behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER:
            run.note("policy 'sync' does nothing here: this accelerate already sets DeepSpeed's boundary "
                     "from the Trainer's (accelerate >= 1.8.0)")
            run.replace_action(WatchOnly(Policy.SYNC))
        elif not run.facts.can_override_boundary:
            run.fall_back(f"policy 'sync' cannot steer this engine: {run.facts.why_not}")
        elif run.n is None:
            run.fall_back("policy 'sync' needs len(train_dataloader) to know the Trainer's boundaries")
        else:
            self.override = BoundaryOverride(run.engine)

    def before_micro_batch(self, run: "RunTracker") -> None:
        self.expected = rules.is_trainer_boundary(
            run.behaviour.trainer_rule, run.position + 1, run.n, run.g, run.t_before_epoch
        )
        self.override.set(self.expected)

    def after_micro_batch(self, run, trainer_updated, engine_updated, args, state, control):
        if trainer_updated == self.expected == engine_updated:
            return
        run.error(
            f"policy 'sync' expected {'an' if self.expected else 'no'} update at epoch {run.epoch + 1}, "
            f"micro-batch {run.position}, but the Trainer {'did' if trainer_updated else 'did not'} count one "
            f"and the engine {'did' if engine_updated else 'did not'} make one; falling back to 'realign'"
        )
        self.end(run)
        realign = run.fall_back(None)
        realign.after_micro_batch(run, trainer_updated, engine_updated, args, state, control)

    def end(self, run: "RunTracker") -> None:
        if self.override is not None:
            self.override.restore()


class DropLastAction(PolicyAction):
    """Every epoch ends after its last full window: the trailing micro-batches are not trained."""

    policy = Policy.DROP_LAST
    acts_per_micro_batch = True

    def __init__(self) -> None:
        self.last_full_window = None

    def begin(self, run: "RunTracker") -> None:
        if run.n is None:
            run.note("policy 'drop_last' needs len(train_dataloader); without it no window is dropped")
            run.replace_action(WatchOnly(Policy.DROP_LAST))
        elif run.n < run.g:
            raise StepSyncConfigError(
                f"policy 'drop_last' would drop every micro-batch: an epoch has {run.n} micro-batches, fewer than "
                f"gradient_accumulation_steps={run.g}; lower gradient_accumulation_steps or use policy='sync'"
            )
        elif run.n % run.g == 0:
            run.note(f"policy 'drop_last' drops nothing: {run.n} micro-batches per epoch is a multiple of G={run.g}")
            run.replace_action(WatchOnly(Policy.DROP_LAST))
        else:
            self.last_full_window = (run.n // run.g) * run.g
            lower_the_plan(run, self.policy, "whole windows give")

    def last_position(self, run: "RunTracker") -> int:
        return self.last_full_window

    def after_micro_batch(self, run, trainer_updated, engine_updated, args, state, control):
        if trainer_updated and self.last_full_window <= run.position < run.n:
            control.should_epoch_stop = True
            run.report.dropped_micro_batches[run.epoch + 1] = run.n - run.position


class WatchOnly(PolicyAction):
    """A remedy with nothing to do on this run; it keeps its name in the report."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy


ACTIONS = {
    Policy.WARN: WarnAction,
    Policy.RAISE: RaiseAction,
    Policy.SYNC: SyncAction,
    Policy.REALIGN: RealignAction,
    Policy.DROP_LAST: DropLastAction,
}


def action_for(policy: Policy) -> PolicyAction:
    return ACTIONS[policy]()
