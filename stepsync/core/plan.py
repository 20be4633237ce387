"""The Trainer's plan arithmetic: what decides a run's counts, and how each release derives max_steps, the
length of an epoch and the position a resume lands at. Pure."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from . import rules
from .errors import StepSyncConfigError
from .versions import StackBehaviour


@dataclass(frozen=True)
class RunPlan:
    """What decides the counts of one run, per rank.

    Attributes:
        micro_batches_per_epoch: ``len(train_dataloader)`` on one rank (N).
        gradient_accumulation_steps: G.
        num_train_epochs: epochs asked for (may be fractional, as in ``TrainingArguments``).
        max_steps: ``TrainingArguments.max_steps``; > 0 overrides the epochs.
        trainer_steps_at_start: ``state.global_step`` when training begins (> 0 after a resume).
        engine_steps_at_start: ``engine.global_steps`` when training begins.
        resume_steps: the ``global_step`` the Trainer computed its resume position from, when stepsync
            saved one that differs from ``trainer_steps_at_start`` (see :func:`resume_steps_for`).
        examples_per_epoch: the Trainer's ``num_examples`` (the dataset's length); transformers 4.46-4.51
            size an epoch's last window from it. None: assumed N (batch size 1).
        zero_stage: DeepSpeed's ZeRO stage, when known (whether a framework's zero_grad reaches the engine's
            gradients).
        start: (0-based epoch, micro-batches done in it) where a resumed run starts, when the framework says
            so itself (Lightning); None: the Trainer's own resume arithmetic from ``trainer_steps_at_start``.
    """

    micro_batches_per_epoch: int
    gradient_accumulation_steps: int
    num_train_epochs: float = 1.0
    max_steps: int = -1
    trainer_steps_at_start: int = 0
    engine_steps_at_start: int = 0
    resume_steps: Optional[int] = None
    examples_per_epoch: Optional[int] = None
    zero_stage: Optional[int] = None
    start: Optional[Tuple[int, int]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.micro_batches_per_epoch, int) or self.micro_batches_per_epoch < 1:
            raise StepSyncConfigError(
                f"micro_batches_per_epoch must be a positive integer, got {self.micro_batches_per_epoch!r}: "
                "pass len(train_dataloader) on one rank"
            )
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            raise StepSyncConfigError(
                f"gradient_accumulation_steps must be an integer >= 1, got {self.gradient_accumulation_steps!r}"
            )
        if self.max_steps <= 0 and not (self.num_train_epochs > 0):
            raise StepSyncConfigError("num_train_epochs must be > 0 when max_steps is not set, got "
                                      f"{self.num_train_epochs!r}")
        if self.trainer_steps_at_start < 0 or self.engine_steps_at_start < 0:
            raise StepSyncConfigError("the step counts at start must be >= 0")
        if self.examples_per_epoch is not None and (
                not isinstance(self.examples_per_epoch, int) or self.examples_per_epoch < 1):
            raise StepSyncConfigError("examples_per_epoch must be a positive integer, got "
                                      f"{self.examples_per_epoch!r}: pass len(train_dataset)")


def updates_per_epoch(behaviour: StackBehaviour, n: int, g: int) -> int:
    """The Trainer's ``num_update_steps_per_epoch`` on this release."""
    return rules.planned_updates_per_epoch(behaviour.planned_steps.value, n, g)


def trainer_epoch_length(plan: RunPlan, behaviour: StackBehaviour) -> int:
    """Micro-batches the Trainer runs in a whole epoch: N, except on transformers 4.46-4.51, which split the
    epoch into N // G + 1 windows, the last one ``num_examples % G`` long (G when that is 0), whatever is left."""
    n, g = plan.micro_batches_per_epoch, plan.gradient_accumulation_steps
    if not behaviour.remainder_cut or plan.examples_per_epoch is None:
        return n
    return min(n, (n // g) * g + (plan.examples_per_epoch % g or g))


def planned_steps(plan: RunPlan, behaviour: StackBehaviour) -> int:
    """The Trainer's ``max_steps``: given, or derived from the epochs as this release does."""
    if plan.max_steps > 0:
        return plan.max_steps
    if plan.num_train_epochs <= 0:
        return 0
    per_epoch = updates_per_epoch(behaviour, plan.micro_batches_per_epoch, plan.gradient_accumulation_steps)
    return math.ceil(plan.num_train_epochs * per_epoch)


def resume_position(plan: RunPlan, behaviour: StackBehaviour):
    """(epochs trained, micro-batches to skip in that epoch) as the framework computes them on resume."""
    if plan.start is not None:
        return plan.start
    per_epoch = updates_per_epoch(behaviour, plan.micro_batches_per_epoch, plan.gradient_accumulation_steps)
    steps = plan.trainer_steps_at_start if plan.resume_steps is None else plan.resume_steps
    if per_epoch == 0:  # a framework that counts nothing in an epoch cannot place a resume by its count
        return 0, 0
    return steps // per_epoch, (steps % per_epoch) * plan.gradient_accumulation_steps


def resume_steps_for(epoch: int, skip: int, n: int, g: int, behaviour: StackBehaviour) -> Optional[int]:
    """The ``global_step`` from which the Trainer's resume lands at 0-based ``epoch`` after ``skip``
    micro-batches, or None when its arithmetic (``global_step // updates per epoch``) cannot reach there."""
    per_epoch = updates_per_epoch(behaviour, n, g)
    if skip % g or skip // g >= per_epoch:
        return None
    return epoch * per_epoch + skip // g
