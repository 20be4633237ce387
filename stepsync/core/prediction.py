"""What a forecast says: its rows per epoch, its verdict in words (why it drifts, whether the run ends early, what
the updates themselves get wrong) and its JSON. The simulation that makes one is :mod:`stepsync.core.forecast`."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from .choices import Policy
from .events import Counted
from .plan import RunPlan, resume_position, updates_per_epoch
from .relayout import ResumeShift
from .versions import EngineBoundary, PlannedSteps, StackBehaviour


@dataclass(frozen=True)
class EpochForecast(Counted):
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


@dataclass
class Forecast(Counted):
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
        untrained_after_stop: the micro-batches of the planned epochs after that stop (never trained).
        micro_batch_weight: what each micro-batch weighs in its update (1/G when the loss is divided once).
        straddling: the 1-based epochs that begin inside an engine window the previous epoch opened.
        resume_shift: the data a resume on another layout skips or trains twice (set by the adapter that saw it).
        wiped_micro_batches: micro-batches whose gradients the framework's own zero_grad clears while the engine
            still accumulates them (ZeRO 0, 1 and 3, when the windows differ): trained, never applied; those of the
            engine's last window, which never closes, are counted in ``unapplied_micro_batches`` instead.
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
    untrained_after_stop: int = 0
    micro_batch_weight: float = 1.0
    straddling: List[int] = field(default_factory=list)
    wiped_micro_batches: int = 0
    resume_shift: Optional[ResumeShift] = None

    @property
    def trainer_steps(self) -> int:
        return self.epochs[-1].trainer_steps if self.epochs else self.plan.trainer_steps_at_start

    @property
    def engine_steps(self) -> int:
        return self.epochs[-1].engine_steps if self.epochs else self.plan.engine_steps_at_start

    @property
    def inherited_drift(self) -> int:
        return self.plan.trainer_steps_at_start - self.plan.engine_steps_at_start

    @property
    def aligned(self) -> bool:
        """No epoch ends with a drift other than the one inherited at the start (under ``realign``, other than none:
        it adopts the engine's count)."""
        kept = 0 if self.policy.follows_the_engine else self.inherited_drift
        return all(row.drift == kept for row in self.epochs) and self.drift == kept

    @property
    def micro_batches(self) -> int:
        return sum(row.micro_batches for row in self.epochs)

    @property
    def dropped_micro_batches(self) -> int:
        return sum(row.dropped for row in self.epochs)

    @property
    def sound(self) -> bool:
        """Both sides agree, every update is what the framework means by one, and the run ends where asked."""
        return self.aligned and not what_the_updates_miss(self) and self.ends_early() is None

    def ends_early(self) -> Optional[str]:
        """Why the run ends before the epochs (or the ``max_steps``) asked for, in words; None when it does not."""
        return ends_early(self)

    def verdict(self) -> str:
        """One line: aligned, or affected with the reason and the remedy; then an early end, if any."""
        return verdict(self)

    def to_dict(self) -> dict:
        """A JSON-ready summary (the shape ``stepsync check --json`` prints)."""
        return forecast_dict(self)


SHOWN_EPOCHS = 20  # a forecast table longer than this shows its first and last epochs only


def shown_epochs(forecast: Forecast) -> List[EpochForecast]:
    """The epochs a table of ``forecast`` shows: every one, or the first and last ``SHOWN_EPOCHS // 2`` of a longer
    run (the rows between are left out after the first half)."""
    epochs = forecast.epochs
    return epochs if len(epochs) <= SHOWN_EPOCHS else epochs[:SHOWN_EPOCHS // 2] + epochs[-SHOWN_EPOCHS // 2:]


def ends_early(forecast: Forecast) -> Optional[str]:
    """Why the run ends before the epochs (or the ``max_steps``) asked for, or None when it does not.

    It happens when the Trainer's plan (``max_steps`` from the epochs) disagrees with how it counts, or
    when it cuts epochs short; only the Trainer's own plan is judged (``realign`` and ``drop_last`` end
    where they are meant to and say so).
    """
    if forecast.policy.lowers_the_plan or not forecast.epochs:
        return None
    if forecast.behaviour.planned_steps is PlannedSteps.WHOLE:  # it runs its epochs whatever it counts
        return None
    plan, last = forecast.plan, forecast.epochs[-1]
    counted = [row.trainer_updates for row in forecast.epochs]
    per_epoch = updates_per_epoch(forecast.behaviour, plan.micro_batches_per_epoch,
                                  plan.gradient_accumulation_steps)
    if all(count == per_epoch for count in counted):
        counts = (f"its count reaches the planned max_steps={forecast.planned_steps} before the data of the epoch ends "
                  "(its windows restart each epoch and the leftover micro-batches spill into the next)")
    else:
        counts = (f"it plans {per_epoch} update(s) per epoch ({forecast.planned_steps} in all) but counts "
                  f"{_listed(counted)} in epoch(s) {forecast.epochs[0].epoch} to {last.epoch}")
    cut = [row.epoch for row in forecast.epochs if row.cut]
    cuts = (f"; it also cuts epoch(s) {_listed(cut)} to {forecast.epochs[0].micro_batches} of "
            f"{plan.micro_batches_per_epoch} micro-batches ({forecast.behaviour.stack.transformers} sizes the last "
            "window from num_examples % G)") if cut else ""
    if plan.max_steps > 0 or not forecast.stopped_by_plan:
        if forecast.stopped_by_plan or forecast.trainer_steps >= forecast.planned_steps:
            return None
        return (f"the Trainer will run out of epochs at {forecast.trainer_steps} update(s), before max_steps="
                f"{forecast.planned_steps}: {counts}{cuts}")
    requested = math.ceil(plan.num_train_epochs)
    full_epoch = plan.micro_batches_per_epoch - last.cut
    start_epoch, start_position = resume_position(plan, forecast.behaviour)
    first = start_position if last.epoch - 1 == start_epoch else 0
    ran_to_end = first + last.micro_batches >= full_epoch
    if last.epoch == requested and (ran_to_end or plan.num_train_epochs != requested):
        return None
    if ran_to_end:
        where = f"after {last.epoch} of {requested} epochs"
    else:
        where = (f"inside epoch {last.epoch} of {requested}, after {last.micro_batches} of its {full_epoch} "
                 "micro-batches")
    return f"the Trainer will stop {where}: {counts}{cuts}"


def verdict(forecast: Forecast) -> str:
    """One line: aligned, or affected with the reason and the remedy; then what goes wrong in the updates
    themselves and an early end, if any."""
    early = ends_early(forecast)
    wrong = what_the_updates_miss(forecast)
    tail = "".join(f"; {fact}" for fact in wrong) + (f"; and {early}" if early else "")
    framework = forecast.behaviour.framework.name
    if forecast.aligned and not wrong:
        inherited = forecast.inherited_drift
        if forecast.drift:  # the drift a checkpoint carried in stays; no new one
            return (f"aligned: {framework} counts {forecast.trainer_steps} updates, the engine makes "
                    f"{forecast.engine_steps}: the drift {inherited:+d} inherited at the start stays, no new one under "
                    f"policy '{forecast.policy.value}'{tail}")
        adopted = f" (the drift {inherited:+d} inherited at the start is taken back)" if inherited else ""
        return (f"aligned: both sides count {forecast.trainer_steps} updates under policy "
                f"'{forecast.policy.value}'{adopted}{tail}")
    if forecast.aligned:  # the shift's fact carries its own fix
        shift = forecast.resume_shift
        remedy = "" if shift is not None and wrong == [shift_fact(shift)] else f"; {forecast.behaviour.remedy}"
        return (f"affected: both sides count {forecast.trainer_steps} updates under policy "
                f"'{forecast.policy.value}'{tail}{remedy}")
    reason = drift_reason(forecast)
    return (
        f"affected: {framework} counts {forecast.trainer_steps} updates, the engine makes {forecast.engine_steps} "
        f"(drift {forecast.drift:+d}); {reason}; {forecast.behaviour.remedy}{tail}"
    )


def what_the_updates_miss(forecast: Forecast) -> List[str]:
    """What the updates themselves get wrong, beyond the counts: the weight of each micro-batch, gradients
    cleared before the engine applied them, windows that cross epoch ends."""
    g = forecast.plan.gradient_accumulation_steps
    framework, facts = forecast.behaviour.framework.name, []
    if g > 1 and abs(forecast.micro_batch_weight - 1 / g) > 1e-12:
        facts.append(f"each micro-batch weighs 1/{round(1 / forecast.micro_batch_weight)} of its update, not 1/{g} "
                     f"({framework} and DeepSpeed both divide the loss by G)")
    if forecast.wiped_micro_batches:
        facts.append(f"{framework}'s zero_grad clears {forecast.wiped_micro_batches} micro-batch(es) the engine is "
                     f"still accumulating (ZeRO-{forecast.plan.zero_stage}): trained, never applied")
    shift = forecast.resume_shift
    if shift is not None and not shift.exact:
        facts.append(shift_fact(shift))
    after = forecast.unapplied_micro_batches + forecast.untrained_after_stop
    if forecast.reachable_steps is not None and forecast.untrained_after_stop:
        g = forecast.plan.gradient_accumulation_steps
        fewer = "; fewer than G: no update would apply them" if after < g else ""
        facts.append(f"the run ends at the engine's last update (max_steps={forecast.reachable_steps}): the {after} "
                     f"micro-batch(es) after it never reach an update ({forecast.unapplied_micro_batches} trained but "
                     f"never applied, {forecast.untrained_after_stop} never trained{fewer})")
    if forecast.straddling and forecast.behaviour.zero_grad_at_its_windows:
        facts.append(f"the engine's windows cross into epoch(s) {_listed(forecast.straddling)}")
    return facts


def shift_fact(shift: ResumeShift) -> str:
    """A resume's shift in a few words, with its fix."""
    fix = (f"resume with {', or '.join(shift.fixes)}" if shift.fixes else
           shift.advice or f"no layout on {shift.resumed.world_size} rank(s) lands there")
    return (f"the resume on another layout skips {sum(shift.skipped.values())} and trains "
            f"{sum(shift.repeated.values())} sample(s) twice ({fix})")


def forecast_dict(forecast: Forecast) -> dict:
    """A JSON-ready summary (the shape ``stepsync check --json`` prints)."""
    return {
        "trainer_steps": forecast.trainer_steps,
        "engine_steps": forecast.engine_steps,
        "drift": forecast.drift,
        "inherited_drift": forecast.inherited_drift,
        "aligned": forecast.aligned,
        "sound": forecast.sound,
        "planned_steps": forecast.planned_steps,
        "policy": forecast.policy.value,
        "micro_batches": forecast.micro_batches,
        "dropped_micro_batches": forecast.dropped_micro_batches,
        "unapplied_micro_batches": forecast.unapplied_micro_batches,
        "ends_early": ends_early(forecast),
        "micro_batch_weight": forecast.micro_batch_weight,
        "straddling": list(forecast.straddling),
        "wiped_micro_batches": forecast.wiped_micro_batches,
        "resume_shift": forecast.resume_shift.to_dict() if forecast.resume_shift else None,
        "stack": {
            **asdict(forecast.behaviour.stack),
            "framework": forecast.behaviour.framework.name,
            "trainer_rule": forecast.behaviour.trainer_rule.value,
            "engine_boundary": forecast.behaviour.engine_boundary.value,
            "measured": forecast.behaviour.measured,
            "caveats": list(forecast.behaviour.caveats),
        },
        "verdict": verdict(forecast),
        "epochs": [{**asdict(row), "drift": row.drift} for row in forecast.epochs],
    }


def _listed(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " and " + values[-1]


def drift_reason(forecast: Forecast) -> str:
    """Why a forecast drifts, in words a user can act on."""
    plan, behaviour = forecast.plan, forecast.behaviour
    n, g = plan.micro_batches_per_epoch, plan.gradient_accumulation_steps
    if behaviour.engine_boundary is EngineBoundary.NEVER_STEPPED:
        return behaviour.engine_reason
    if forecast.drift < forecast.inherited_drift:
        shape = f"the engine is ahead: its windows cross epoch ends while {behaviour.framework.name}'s restart"
    elif n <= g:
        shape = f"tiny epochs: N={n} <= G={g} forces a Trainer update at every epoch end"
    else:
        shape = f"every epoch ends with a partial window of {n % g} micro-batch(es) the engine does not close"
    return f"{shape} ({behaviour.engine_reason})"
