"""Brute-force simulation of the Trainer loop and the engine, one micro-batch at a time.

It follows the Trainer's loop as written upstream (docs/releases.md, "What each release does, probed"), with no closed form,
so that the forecast's arithmetic can be checked against it.
"""
from __future__ import annotations

import math

from stepsync.core.choices import Policy
from stepsync.core.versions import EngineBoundary, PlannedSteps, TrainerRule


def trainer_boundary(rule, s, t, n, g):
    if rule is TrainerRule.EPOCH_END:
        return (s + 1) % g == 0 or s + 1 == n
    if rule is TrainerRule.EPOCH_WINDOW:
        return (s + 1) % g == 0 or (n <= g and s + 1 == n)
    return t % g == 0 or (n <= g and s + 1 == n)


def epoch_length(n, g, examples, behaviour):
    """The Trainer 4.46-4.51 loop, literally: N // G + 1 windows of G, the last one `examples % G` (or G)
    long, each taking what the dataloader has left."""
    if not behaviour.remainder_cut or examples is None:
        return n
    remainder = examples % g or g
    total_updates = n // g + 1
    taken = 0
    for update_step in range(total_updates):
        wanted = g if update_step != total_updates - 1 else remainder
        taken += min(wanted, n - taken)
    return taken


def simulate(n, g, epochs, max_steps, behaviour, policy, trainer_start=0, engine_start=0, examples=None):
    """Returns (rows, trainer_updates_at, engine_updates_at, unapplied); rows like EpochForecast.

    Under ``realign`` stepsync lowers the Trainer's ``max_steps`` to the engine's final count when the
    engine cannot reach the plan: the run is simulated once to learn that count, then again with it.
    """
    policy = Policy(policy)
    per_epoch = -(-n // g) if behaviour.planned_steps is PlannedSteps.CEIL else max(n // g, 1)
    planned = max_steps if max_steps > 0 else math.ceil(epochs * per_epoch)
    length = epoch_length(n, g, examples, behaviour)
    result = _simulate(n, g, epochs, max_steps, behaviour, policy, trainer_start, engine_start, planned, length)
    engine_final = result[0][-1][5] if result[0] else engine_start
    if policy is Policy.REALIGN and engine_start < engine_final < planned:
        result = _simulate(n, g, epochs, max_steps, behaviour, policy, trainer_start, engine_start, engine_final,
                           length)
    return result


def _simulate(n, g, epochs, max_steps, behaviour, policy, trainer_start, engine_start, target, length):
    per_epoch = -(-n // g) if behaviour.planned_steps is PlannedSteps.CEIL else max(n // g, 1)
    epochs_to_run = (max_steps // per_epoch + int(max_steps % per_epoch > 0)) if max_steps > 0 else math.ceil(epochs)
    follows = policy is Policy.SYNC or behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER
    trainer_steps, engine_steps = trainer_start, engine_start
    start_epoch = trainer_steps // per_epoch
    skip = (trainer_steps % per_epoch) * g
    t = 0
    micro = 0
    global_micro = 0
    rows, trainer_at, engine_at = [], [], []
    since_trainer = 0
    stop = False
    for epoch in range(start_epoch, epochs_to_run):
        first = skip if epoch == start_epoch else 0
        ran = tu = eu = 0
        dropped = 0
        for s in range(first, length):  # the Trainer never reaches past `length`
            if policy is Policy.DROP_LAST and s >= (n // g) * g:
                dropped = length - s
                break
            t += 1
            global_micro += 1
            ran += 1
            tb = trainer_boundary(behaviour.trainer_rule, s, t, n, g)
            eb = tb if follows else (micro + 1) % g == 0
            micro += 1
            since_trainer += 1
            if eb:
                engine_steps += 1
                eu += 1
                engine_at.append(global_micro)
            if tb:
                since_trainer = 0
                tu += 1
                trainer_at.append(global_micro)
                if policy is Policy.REALIGN:
                    trainer_steps = engine_steps
                else:
                    trainer_steps += 1
                if trainer_steps >= target:
                    stop = True
                    break
        if policy is Policy.REALIGN:
            tu = eu
            trainer_steps = engine_steps
        if ran == 0 and not stop:
            continue  # a resumed epoch with nothing left to run
        if ran == 0:
            break
        ran_to_epoch_end = s + 1 == n  # s: the last micro-batch index this epoch ran
        has_partial_window = behaviour.trainer_rule is TrainerRule.EPOCH_END and policy is not Policy.DROP_LAST
        partial = n % g if ran_to_epoch_end and has_partial_window else 0
        cut = 0 if stop else n - length  # the Trainer never reaches these (transformers 4.46-4.51)
        rows.append((epoch + 1, ran, tu, eu, trainer_steps, engine_steps, partial, 0 if stop else dropped, cut))
        if stop:
            break
    unapplied = since_trainer if follows else micro % g
    return rows, trainer_at, engine_at, unapplied
