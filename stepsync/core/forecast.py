"""Forecast of both counters, epoch by epoch, in closed form (O(epochs), never O(micro-batches)); what it says
(its rows, verdict and JSON) is :mod:`stepsync.core.prediction`.

Pure: imports neither torch, transformers nor deepspeed. The callback compares the real run
with it and ``stepsync check`` prints it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from . import rules
from .choices import Policy
from .plan import RunPlan, planned_steps, resume_position, trainer_epoch_length, updates_per_epoch
from .prediction import EpochForecast, Forecast
from .versions import EngineBoundary, PlannedSteps, StackBehaviour, TrainerRule


@dataclass
class _Counters:
    trainer_steps: int
    engine_steps: int
    trainer_micro: int = 0  # the Trainer's cross-epoch micro-batch counter (GLOBAL_COUNTER)
    engine_micro: int = 0  # the engine's micro_steps since it was built


def forecast(plan: RunPlan, behaviour: StackBehaviour, policy: Policy = Policy.WARN) -> Forecast:
    """Predict both counters for ``plan`` on ``behaviour``'s stack under ``policy``."""
    policy = Policy.parse(policy)
    planned = planned_steps(plan, behaviour)
    result = _simulate(plan, behaviour, policy, planned, planned)
    # realign and drop_last lower the Trainer's max_steps to the count they reach, so the run ends (saves,
    # evaluates, fills its progress bar) at its last update instead of never reaching its plan.
    made_updates = result.engine_steps > plan.engine_steps_at_start
    if policy.follows_the_engine and made_updates and result.engine_steps < planned:
        reachable = result.engine_steps
        result = _simulate(plan, behaviour, policy, planned, reachable)  # stops at the engine's last update
        result.reachable_steps = reachable
    elif policy.ends_epochs_early and plan.trainer_steps_at_start < result.trainer_steps < planned:
        result.reachable_steps = result.trainer_steps  # its last update already ends the last epoch
    return result


def _simulate(plan: RunPlan, behaviour: StackBehaviour, policy: Policy, planned: int,
              target: Optional[int]) -> Forecast:
    """The run whose epoch loop is sized by ``planned`` and which stops once its count reaches ``target``."""
    n, g = plan.micro_batches_per_epoch, plan.gradient_accumulation_steps
    rule = behaviour.trainer_rule
    engine_follows = policy.steers_the_boundary or behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER
    # the engine closes windows of its own by its counter, unless it follows the framework or never steps (a loop
    # that steps the optimizer itself, Fabric's: the weights move at its count, the engine's count never)
    own_windows = not engine_follows and behaviour.engine_boundary is not EngineBoundary.NEVER_STEPPED
    per_epoch = updates_per_epoch(behaviour, n, g)
    every_epoch = behaviour.planned_steps is PlannedSteps.WHOLE  # Lightning runs its epochs; max_steps alone stops it
    if every_epoch:
        target = plan.max_steps if plan.max_steps > 0 else None
        bound = plan.max_steps // per_epoch + 1 if per_epoch and plan.max_steps > 0 else 1
        epochs_to_run = math.ceil(plan.num_train_epochs) if plan.num_train_epochs > 0 else bound
    else:
        epochs_to_run = -(-planned // per_epoch) if plan.max_steps > 0 else math.ceil(plan.num_train_epochs)
    start_epoch, start_position = resume_position(plan, behaviour)
    length = trainer_epoch_length(plan, behaviour)
    # where the framework (or stepsync for it) ends each epoch after its last whole window
    drops = behaviour.ends_epochs_under(policy)
    last_position = min(length, (n // g) * g) if drops else length
    wipes = behaviour.zero_grad_at_its_windows and plan.zero_stage in (0, 1, 3) and not engine_follows

    counters = _Counters(plan.trainer_steps_at_start, plan.engine_steps_at_start)
    result = Forecast(plan, behaviour, policy, planned, epochs_to_run=epochs_to_run,
                      micro_batch_weight=1 / g ** (1 if policy.steers_the_boundary else behaviour.loss_divisions))
    since_trainer_boundary = 0  # micro-batches after the Trainer's last update (unapplied when the engine follows)
    last_clear = -1  # the engine's micro-batch count at the framework's last zero_grad
    for epoch in range(start_epoch, epochs_to_run):
        first = start_position if epoch == start_epoch else 0
        if first >= last_position:
            continue
        open_window = counters.engine_micro % g if own_windows else 0
        if open_window and epoch > start_epoch:
            result.straddling.append(epoch + 1)
        t_before = counters.trainer_micro - first  # the Trainer's counter before position 0 of this epoch
        end, stopped = _epoch_end(policy, rule, engine_follows, counters, target, first, last_position, n, g)
        ran = end - first
        if wipes:
            last_clear = _clear_windows(result, counters.engine_micro, first, end, g, last_clear)
        done_before = rules.trainer_updates(rule, first, n, g, t_before)
        trainer_made = rules.trainer_updates(rule, end, n, g, t_before) - done_before
        engine_made = (trainer_made if engine_follows else
                       rules.engine_updates(ran, g, counters.engine_micro) if own_windows else 0)
        if trainer_made:
            last_boundary = rules.trainer_boundary_position(rule, done_before + trainer_made, n, g, t_before)
            since_trainer_boundary = end - last_boundary
        else:
            since_trainer_boundary += ran
        counters.engine_steps += engine_made
        realigned = policy.follows_the_engine
        counters.trainer_steps = counters.engine_steps if realigned else counters.trainer_steps + trainer_made
        counters.trainer_micro += ran
        counters.engine_micro += ran
        result.epochs.append(
            EpochForecast(
                epoch=epoch + 1,
                micro_batches=ran,
                trainer_updates=engine_made if realigned else trainer_made,
                engine_updates=engine_made,
                trainer_steps=counters.trainer_steps,
                engine_steps=counters.engine_steps,
                partial_window=n % g if end == n and rule is TrainerRule.EPOCH_END else 0,
                dropped=length - last_position if drops and not stopped else 0,
                cut=n - length if not stopped and end == last_position else 0,
            )
        )
        if stopped:
            result.stopped_by_plan = True
            result.untrained_after_stop = last_position - end + (epochs_to_run - epoch - 1) * last_position
            break
    result.unapplied_micro_batches = counters.engine_micro % g if own_windows else since_trainer_boundary
    opened_at = counters.engine_micro - result.unapplied_micro_batches
    if wipes and last_clear > opened_at:  # the engine's last window never closes: its cleared ones count there
        result.wiped_micro_batches -= last_clear - opened_at
    return result


def _clear_windows(result: Forecast, engine_micro: int, first: int, end: int, g: int, last_clear: int) -> int:
    """Count what the framework's zero_grad clears in one epoch (before each of its window starts p, p % G == 0,
    in [first, end)) of what a counter-driven engine still accumulates; returns the engine's count at the last.

    At a clear, the engine holds the micro-batches since its own window began (its count rounded down to G) or
    since the previous clear, whichever is later. Inside an epoch the clears are G apart, so each but the first
    clears the engine's count modulo G.
    """
    clears = (end - 1) // g - (first - 1) // g
    if not clears:
        return last_clear
    at = engine_micro + (-(-first // g) * g - first)  # the engine's count at the epoch's first clear
    result.wiped_micro_batches += at - max(at // g * g, last_clear) + (clears - 1) * (at % g)
    return at + (clears - 1) * g


def _epoch_end(policy, rule, engine_follows, counters, target, first, last, n, g):
    """(position where the epoch's run stops, whether training stops there); ``target`` None: nothing stops it."""
    if target is None:
        return last, False
    t_before = counters.trainer_micro - first  # the Trainer's counter before position 0 of this epoch
    if policy.follows_the_engine and not engine_follows:
        # The Trainer stops at its first boundary once the engine has made `target` updates.
        # The Trainer checks `max_steps` only after an update, so at least one more comes.
        remaining = max(target - counters.engine_steps, 1)
        available = rules.engine_updates(last - first, g, counters.engine_micro)
        if remaining <= available:
            reach = first + rules.engine_boundary_position(remaining, g, counters.engine_micro)
        else:
            return last, False
        stop_at = rules.next_trainer_boundary(rule, reach, n, g, t_before)
        if stop_at is None or stop_at > last:
            return last, False
        return stop_at, True
    checked = counters.engine_steps if policy.follows_the_engine else counters.trainer_steps
    remaining = max(target - checked, 1)
    done_before = rules.trainer_updates(rule, first, n, g, t_before)
    available = rules.trainer_updates(rule, last, n, g, t_before) - done_before
    if remaining <= available:
        return rules.trainer_boundary_position(rule, done_before + remaining, n, g, t_before), True
    return last, False
