"""Forecast of both counters, epoch by epoch, in closed form (O(epochs), never O(micro-batches)).

Pure: imports neither torch, transformers nor deepspeed. The callback compares the real run
with it and ``stepsync check`` prints it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from . import rules
from .choices import Policy
from .versions import EngineBoundary, PlannedSteps, StackBehaviour, TrainerRule


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
    """

    micro_batches_per_epoch: int
    gradient_accumulation_steps: int
    num_train_epochs: float = 1.0
    max_steps: int = -1
    trainer_steps_at_start: int = 0
    engine_steps_at_start: int = 0
    resume_steps: Optional[int] = None
    examples_per_epoch: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.micro_batches_per_epoch, int) or self.micro_batches_per_epoch < 1:
            raise ValueError(
                f"micro_batches_per_epoch must be a positive integer, got {self.micro_batches_per_epoch!r}: "
                "pass len(train_dataloader) on one rank"
            )
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be an integer >= 1, got {self.gradient_accumulation_steps!r}"
            )
        if self.max_steps <= 0 and not (self.num_train_epochs > 0):
            raise ValueError(f"num_train_epochs must be > 0 when max_steps is not set, got {self.num_train_epochs!r}")
        if self.trainer_steps_at_start < 0 or self.engine_steps_at_start < 0:
            raise ValueError("the step counts at start must be >= 0")
        if self.examples_per_epoch is not None and (
                not isinstance(self.examples_per_epoch, int) or self.examples_per_epoch < 1):
            raise ValueError(f"examples_per_epoch must be a positive integer, got {self.examples_per_epoch!r}: "
                             "pass len(train_dataset)")


@dataclass(frozen=True)
class EpochForecast:
    """One epoch of a forecast. ``epoch`` is 1-based; step counts are cumulative at the epoch's end.

    ``partial_window`` is the size of the Trainer's short last window (0 when N is a multiple of G
    or the epoch stopped early); ``dropped`` the micro-batches ``drop_last`` leaves untrained; ``cut`` the
    micro-batches the Trainer itself never reaches (transformers 4.46-4.51, see :func:`trainer_epoch_length`).
    """

    epoch: int
    micro_batches: int
    trainer_updates: int
    engine_updates: int
    trainer_steps: int
    engine_steps: int
    partial_window: int = 0
    dropped: int = 0
    cut: int = 0

    @property
    def drift(self) -> int:
        return self.trainer_steps - self.engine_steps


@dataclass
class Forecast:
    """The predicted counts of a run under one policy.

    Attributes:
        planned_steps: the ``max_steps`` the Trainer plans (and the LR schedule is built for).
        epochs: one row per epoch that runs.
        unapplied_micro_batches: micro-batches the engine accumulated but never applied at the end.
        reachable_steps: under ``realign`` and ``drop_last``, the count the run ends at when that is below
            ``planned_steps``: stepsync lowers the Trainer's ``max_steps`` to it so the run ends like a normal
            one (None otherwise).
        epochs_to_run: the epochs the Trainer's loop runs at most.
        stopped_by_plan: the run ends because the Trainer's count reached its ``max_steps`` (not the data's end).
    """

    plan: RunPlan
    behaviour: StackBehaviour
    policy: Policy
    planned_steps: int
    epochs: List[EpochForecast] = field(default_factory=list)
    unapplied_micro_batches: int = 0
    reachable_steps: Optional[int] = None
    epochs_to_run: int = 0
    stopped_by_plan: bool = False

    @property
    def trainer_steps(self) -> int:
        return self.epochs[-1].trainer_steps if self.epochs else self.plan.trainer_steps_at_start

    @property
    def engine_steps(self) -> int:
        return self.epochs[-1].engine_steps if self.epochs else self.plan.engine_steps_at_start

    @property
    def drift(self) -> int:
        return self.trainer_steps - self.engine_steps

    @property
    def inherited_drift(self) -> int:
        return self.plan.trainer_steps_at_start - self.plan.engine_steps_at_start

    @property
    def aligned(self) -> bool:
        """No epoch ends with a drift other than the one inherited at the start."""
        return all(row.drift == self.inherited_drift for row in self.epochs) and self.drift == self.inherited_drift

    @property
    def micro_batches(self) -> int:
        return sum(row.micro_batches for row in self.epochs)

    @property
    def dropped_micro_batches(self) -> int:
        return sum(row.dropped for row in self.epochs)

    def ends_early(self) -> Optional[str]:
        """Why the run ends before the epochs (or the ``max_steps``) asked for, or None when it does not.

        It happens when the Trainer's plan (``max_steps`` from the epochs) disagrees with how it counts, or
        when it cuts epochs short; only the Trainer's own plan is judged (``realign`` and ``drop_last`` end
        where they are meant to and say so).
        """
        if self.policy in (Policy.REALIGN, Policy.DROP_LAST) or not self.epochs:
            return None
        plan, last = self.plan, self.epochs[-1]
        counted = [row.trainer_updates for row in self.epochs]
        per_epoch = updates_per_epoch(self.behaviour, plan.micro_batches_per_epoch, plan.gradient_accumulation_steps)
        if all(count == per_epoch for count in counted):
            counts = (f"its count reaches the planned max_steps={self.planned_steps} before the data of the epoch ends "
                      "(its windows restart each epoch and the leftover micro-batches spill into the next)")
        else:
            counts = (f"it plans {per_epoch} update(s) per epoch ({self.planned_steps} in all) but counts "
                      f"{_listed(counted)} in epoch(s) {self.epochs[0].epoch} to {last.epoch}")
        cut = [row.epoch for row in self.epochs if row.cut]
        cuts = (f"; it also cuts epoch(s) {_listed(cut)} to {self.epochs[0].micro_batches} of "
                f"{plan.micro_batches_per_epoch} micro-batches ({self.behaviour.stack.transformers} sizes the last "
                "window from num_examples % G)") if cut else ""
        if plan.max_steps > 0 or not self.stopped_by_plan:
            if self.stopped_by_plan or self.trainer_steps >= self.planned_steps:
                return None
            return (f"the Trainer will run out of epochs at {self.trainer_steps} update(s), before max_steps="
                    f"{self.planned_steps}: {counts}{cuts}")
        requested = math.ceil(plan.num_train_epochs)
        full_epoch = plan.micro_batches_per_epoch - last.cut
        start_epoch, start_position = resume_position(plan, self.behaviour)
        first = start_position if last.epoch - 1 == start_epoch else 0
        ran_to_end = first + last.micro_batches >= full_epoch
        if last.epoch == requested and (ran_to_end or plan.num_train_epochs != requested):
            return None
        if ran_to_end:
            where = f"after {last.epoch} of {requested} epochs"
        else:
            where = f"inside epoch {last.epoch} of {requested}, after {last.micro_batches} of its {full_epoch} micro-batches"
        return f"the Trainer will stop {where}: {counts}{cuts}"

    def verdict(self) -> str:
        """One line: aligned, or affected with the reason and the remedy; then an early end, if any."""
        early = self.ends_early()
        tail = f"; and {early}" if early else ""
        if self.aligned:
            inherited = f" (inherited drift {self.inherited_drift:+d} stays)" if self.inherited_drift else ""
            return (f"aligned: both sides count {self.trainer_steps} updates under policy "
                    f"'{self.policy.value}'{inherited}{tail}")
        reason = drift_reason(self)
        return (
            f"affected: the Trainer counts {self.trainer_steps} updates, the engine makes {self.engine_steps} "
            f"(drift {self.drift:+d}); {reason}; {self.behaviour.remedy}{tail}"
        )

    def to_dict(self) -> dict:
        """A JSON-ready summary (the shape ``stepsync check --json`` prints)."""
        return {
            "trainer_steps": self.trainer_steps,
            "engine_steps": self.engine_steps,
            "drift": self.drift,
            "inherited_drift": self.inherited_drift,
            "aligned": self.aligned,
            "planned_steps": self.planned_steps,
            "policy": self.policy.value,
            "micro_batches": self.micro_batches,
            "dropped_micro_batches": self.dropped_micro_batches,
            "unapplied_micro_batches": self.unapplied_micro_batches,
            "ends_early": self.ends_early(),
            "stack": {
                "transformers": self.behaviour.stack.transformers,
                "accelerate": self.behaviour.stack.accelerate,
                "deepspeed": self.behaviour.stack.deepspeed,
                "trainer_rule": self.behaviour.trainer_rule.value,
                "engine_boundary": self.behaviour.engine_boundary.value,
                "measured": self.behaviour.measured,
                "caveats": list(self.behaviour.caveats),
            },
            "verdict": self.verdict(),
            "epochs": [
                {
                    "epoch": row.epoch,
                    "micro_batches": row.micro_batches,
                    "trainer_updates": row.trainer_updates,
                    "engine_updates": row.engine_updates,
                    "trainer_steps": row.trainer_steps,
                    "engine_steps": row.engine_steps,
                    "drift": row.drift,
                    "partial_window": row.partial_window,
                    "dropped": row.dropped,
                    "cut": row.cut,
                }
                for row in self.epochs
            ],
        }


def _listed(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " and " + values[-1]


def drift_reason(forecast: Forecast) -> str:
    """Why a forecast drifts, in words a user can act on."""
    plan, behaviour = forecast.plan, forecast.behaviour
    n, g = plan.micro_batches_per_epoch, plan.gradient_accumulation_steps
    if forecast.drift < forecast.inherited_drift:
        shape = "the engine is ahead: its windows cross epoch ends while the Trainer's restart"
    elif n <= g:
        shape = f"tiny epochs: N={n} <= G={g} forces a Trainer update at every epoch end"
    else:
        shape = f"every epoch ends with a partial window of {n % g} micro-batch(es) the engine does not close"
    return f"{shape} ({behaviour.engine_reason})"


@dataclass
class _Counters:
    trainer_steps: int
    engine_steps: int
    trainer_micro: int = 0  # the Trainer's cross-epoch micro-batch counter (GLOBAL_COUNTER)
    engine_micro: int = 0  # the engine's micro_steps since it was built


def updates_per_epoch(behaviour: StackBehaviour, n: int, g: int) -> int:
    """The Trainer's ``num_update_steps_per_epoch`` on this release."""
    return rules.planned_updates_per_epoch(behaviour.planned_steps is PlannedSteps.CEIL, n, g)


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
    per_epoch = updates_per_epoch(behaviour, plan.micro_batches_per_epoch, plan.gradient_accumulation_steps)
    return math.ceil(plan.num_train_epochs * per_epoch)


def resume_position(plan: RunPlan, behaviour: StackBehaviour):
    """(epochs trained, micro-batches to skip in that epoch) as the Trainer computes them on resume."""
    per_epoch = updates_per_epoch(behaviour, plan.micro_batches_per_epoch, plan.gradient_accumulation_steps)
    steps = plan.trainer_steps_at_start if plan.resume_steps is None else plan.resume_steps
    return steps // per_epoch, (steps % per_epoch) * plan.gradient_accumulation_steps


def resume_steps_for(epoch: int, skip: int, n: int, g: int, behaviour: StackBehaviour) -> Optional[int]:
    """The ``global_step`` from which the Trainer's resume lands at 0-based ``epoch`` after ``skip``
    micro-batches, or None when its arithmetic (``global_step // updates per epoch``) cannot reach there."""
    per_epoch = updates_per_epoch(behaviour, n, g)
    if skip % g or skip // g >= per_epoch:
        return None
    return epoch * per_epoch + skip // g


def forecast(plan: RunPlan, behaviour: StackBehaviour, policy: Policy = Policy.WARN) -> Forecast:
    """Predict both counters for ``plan`` on ``behaviour``'s stack under ``policy``."""
    policy = Policy.parse(policy)
    planned = planned_steps(plan, behaviour)
    result = _simulate(plan, behaviour, policy, planned, planned)
    # realign and drop_last lower the Trainer's max_steps to the count they reach, so the run ends (saves,
    # evaluates, fills its progress bar) at its last update instead of never reaching its plan.
    made_updates = result.engine_steps > plan.engine_steps_at_start
    if policy is Policy.REALIGN and made_updates and result.engine_steps < planned:
        reachable = result.engine_steps
        result = _simulate(plan, behaviour, policy, planned, reachable)  # stops at the engine's last update
        result.reachable_steps = reachable
    elif policy is Policy.DROP_LAST and plan.trainer_steps_at_start < result.trainer_steps < planned:
        result.reachable_steps = result.trainer_steps  # its last update already ends the last epoch
    return result


def _simulate(plan: RunPlan, behaviour: StackBehaviour, policy: Policy, planned: int, target: int) -> Forecast:
    """The run whose epoch loop is sized by ``planned`` and which stops once its count reaches ``target``."""
    n, g = plan.micro_batches_per_epoch, plan.gradient_accumulation_steps
    rule = behaviour.trainer_rule
    engine_follows = policy is Policy.SYNC or behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER
    per_epoch = updates_per_epoch(behaviour, n, g)
    epochs_to_run = -(-planned // per_epoch) if plan.max_steps > 0 else math.ceil(plan.num_train_epochs)
    start_epoch, start_position = resume_position(plan, behaviour)
    length = trainer_epoch_length(plan, behaviour)
    last_position = min(length, (n // g) * g) if policy is Policy.DROP_LAST else length

    counters = _Counters(plan.trainer_steps_at_start, plan.engine_steps_at_start)
    result = Forecast(plan, behaviour, policy, planned, epochs_to_run=epochs_to_run)
    since_trainer_boundary = 0  # micro-batches after the Trainer's last update (unapplied when the engine follows)
    for epoch in range(start_epoch, epochs_to_run):
        first = start_position if epoch == start_epoch else 0
        if first >= last_position:
            continue
        t_before = counters.trainer_micro - first  # the Trainer's counter before position 0 of this epoch
        end, stopped = _epoch_end(policy, rule, engine_follows, counters, target, first, last_position, n, g)
        ran = end - first
        done_before = rules.trainer_updates(rule, first, n, g, t_before)
        trainer_made = rules.trainer_updates(rule, end, n, g, t_before) - done_before
        engine_made = trainer_made if engine_follows else rules.engine_updates(ran, g, counters.engine_micro)
        if trainer_made:
            last_boundary = rules.trainer_boundary_position(rule, done_before + trainer_made, n, g, t_before)
            since_trainer_boundary = end - last_boundary
        else:
            since_trainer_boundary += ran
        counters.engine_steps += engine_made
        counters.trainer_steps = counters.engine_steps if policy is Policy.REALIGN else counters.trainer_steps + trainer_made
        counters.trainer_micro += ran
        counters.engine_micro += ran
        result.epochs.append(
            EpochForecast(
                epoch=epoch + 1,
                micro_batches=ran,
                trainer_updates=engine_made if policy is Policy.REALIGN else trainer_made,
                engine_updates=engine_made,
                trainer_steps=counters.trainer_steps,
                engine_steps=counters.engine_steps,
                partial_window=n % g if end == n and rule is TrainerRule.EPOCH_END else 0,
                dropped=length - last_position if policy is Policy.DROP_LAST and not stopped else 0,
                cut=n - length if not stopped and end == last_position else 0,
            )
        )
        if stopped:
            result.stopped_by_plan = True
            break
    result.unapplied_micro_batches = since_trainer_boundary if engine_follows else counters.engine_micro % g
    return result


def _epoch_end(policy, rule, engine_follows, counters, target, first, last, n, g):
    """(position where the epoch's run stops, whether training stops there)."""
    t_before = counters.trainer_micro - first  # the Trainer's counter before position 0 of this epoch
    if policy is Policy.REALIGN and not engine_follows:
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
    checked = counters.engine_steps if policy is Policy.REALIGN else counters.trainer_steps
    remaining = max(target - checked, 1)
    done_before = rules.trainer_updates(rule, first, n, g, t_before)
    available = rules.trainer_updates(rule, last, n, g, t_before) - done_before
    if remaining <= available:
        return rules.trainer_boundary_position(rule, done_before + remaining, n, g, t_before), True
    return last, False
