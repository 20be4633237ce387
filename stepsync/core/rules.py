"""Closed-form counting of accumulation boundaries inside one epoch.

Positions are 1-based micro-batch counts inside an epoch of ``n`` micro-batches: the boundary at
position ``p`` is the update made after the ``p``-th micro-batch. ``t_before`` is the Trainer's
cross-epoch micro-batch counter before the epoch (only ``GLOBAL_COUNTER`` reads it) and
``micro_before`` the engine's ``micro_steps`` before the epoch. Everything is O(1).
"""
from __future__ import annotations

from .versions import TrainerRule


def is_trainer_boundary(rule: TrainerRule, position: int, n: int, g: int, t_before: int = 0) -> bool:
    """Whether the Trainer counts an update after micro-batch ``position`` (1-based) of the epoch."""
    tiny_epoch_end = n <= g and position == n
    if rule is TrainerRule.WHOLE_WINDOWS:
        return position % g == 0
    if rule is TrainerRule.EPOCH_END:
        return position % g == 0 or position == n
    if rule is TrainerRule.EPOCH_WINDOW:
        return position % g == 0 or tiny_epoch_end
    return (t_before + position) % g == 0 or tiny_epoch_end


def _regular_count(rule: TrainerRule, m: int, g: int, t_before: int) -> int:
    if rule is TrainerRule.GLOBAL_COUNTER:
        return (t_before + m) // g - t_before // g
    return m // g


def _forced_at_end(rule: TrainerRule, n: int, g: int, t_before: int) -> bool:
    """Whether position ``n`` is a boundary that the regular multiples of ``g`` do not give."""
    return is_trainer_boundary(rule, n, n, g, t_before) and _regular_count(rule, n, g, t_before) == _regular_count(
        rule, n - 1, g, t_before
    )


def trainer_updates(rule: TrainerRule, m: int, n: int, g: int, t_before: int = 0) -> int:
    """Updates the Trainer counts over the first ``m`` micro-batches of an epoch of ``n``."""
    return _regular_count(rule, m, g, t_before) + (m == n and _forced_at_end(rule, n, g, t_before))


def trainer_boundary_position(rule: TrainerRule, j: int, n: int, g: int, t_before: int = 0) -> int:
    """Position of the Trainer's ``j``-th boundary (``1 <= j <= trainer_updates(rule, n, ...)``)."""
    regular = _regular_count(rule, n, g, t_before)
    if j <= regular:
        offset = t_before if rule is TrainerRule.GLOBAL_COUNTER else 0
        return (offset // g + j) * g - offset
    return n


def next_trainer_boundary(rule: TrainerRule, position: int, n: int, g: int, t_before: int = 0):
    """The first Trainer boundary at ``position`` or later in the epoch, or None."""
    j = trainer_updates(rule, position - 1, n, g, t_before) + 1
    if j > trainer_updates(rule, n, n, g, t_before):
        return None
    return trainer_boundary_position(rule, j, n, g, t_before)


def engine_updates(m: int, g: int, micro_before: int = 0) -> int:
    """Updates a counter-driven engine makes over ``m`` micro-batches after ``micro_before``."""
    return (micro_before + m) // g - micro_before // g


def engine_boundary_position(k: int, g: int, micro_before: int = 0) -> int:
    """Micro-batches after ``micro_before`` until a counter-driven engine's ``k``-th update."""
    return (micro_before // g + k) * g - micro_before


def planned_updates_per_epoch(planned: str, n: int, g: int) -> int:
    """The framework's updates per epoch as it plans them (``PlannedSteps``' values: "ceil", "floor", "whole")."""
    if planned == "ceil":
        return -(-n // g)
    return n // g if planned == "whole" else max(n // g, 1)
