"""The wording of verdicts: why a forecast drifts, whether the run ends early, and the JSON of a forecast."""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, List, Optional

from .choices import Policy
from .plan import resume_position, updates_per_epoch
from .versions import PlannedSteps

if TYPE_CHECKING:  # pragma: no cover
    from .forecast import Forecast


def ends_early(forecast: Forecast) -> Optional[str]:
    """Why the run ends before the epochs (or the ``max_steps``) asked for, or None when it does not.

    It happens when the Trainer's plan (``max_steps`` from the epochs) disagrees with how it counts, or
    when it cuts epochs short; only the Trainer's own plan is judged (``realign`` and ``drop_last`` end
    where they are meant to and say so).
    """
    if forecast.policy in (Policy.REALIGN, Policy.DROP_LAST) or not forecast.epochs:
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
    framework = forecast.behaviour.framework
    if forecast.aligned and not wrong:
        inherited = f" (inherited drift {forecast.inherited_drift:+d} stays)" if forecast.inherited_drift else ""
        return (f"aligned: both sides count {forecast.trainer_steps} updates under policy "
                f"'{forecast.policy.value}'{inherited}{tail}")
    if forecast.aligned:
        return (f"affected: both sides count {forecast.trainer_steps} updates under policy "
                f"'{forecast.policy.value}'{tail}; {forecast.behaviour.remedy}")
    reason = drift_reason(forecast)
    return (
        f"affected: {framework} counts {forecast.trainer_steps} updates, the engine makes {forecast.engine_steps} "
        f"(drift {forecast.drift:+d}); {reason}; {forecast.behaviour.remedy}{tail}"
    )


def what_the_updates_miss(forecast: Forecast) -> List[str]:
    """What the updates themselves get wrong, beyond the counts: the weight of each micro-batch, gradients
    cleared before the engine applied them, windows that cross epoch ends."""
    g = forecast.plan.gradient_accumulation_steps
    framework, facts = forecast.behaviour.framework, []
    if g > 1 and abs(forecast.micro_batch_weight - 1 / g) > 1e-12:
        facts.append(f"each micro-batch weighs 1/{round(1 / forecast.micro_batch_weight)} of its update, not 1/{g} "
                     f"({framework} and DeepSpeed both divide the loss by G)")
    if forecast.wiped_micro_batches:
        facts.append(f"{framework}'s zero_grad clears {forecast.wiped_micro_batches} micro-batch(es) the engine is "
                     f"still accumulating (ZeRO-{forecast.plan.zero_stage}): trained, never applied")
    shift = forecast.resume_shift
    if shift is not None and not shift.exact:
        facts.append(f"the resume on another layout skips {sum(shift.skipped.values())} and trains "
                     f"{sum(shift.repeated.values())} sample(s) twice")
    if forecast.straddling and forecast.behaviour.zero_grad_at_its_windows:
        facts.append(f"the engine's windows cross into epoch(s) {_listed(forecast.straddling)}")
    return facts


def forecast_dict(forecast: Forecast) -> dict:
    """A JSON-ready summary (the shape ``stepsync check --json`` prints)."""
    return {
        "trainer_steps": forecast.trainer_steps,
        "engine_steps": forecast.engine_steps,
        "drift": forecast.drift,
        "inherited_drift": forecast.inherited_drift,
        "aligned": forecast.aligned,
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
            "framework": forecast.behaviour.framework,
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
    if forecast.drift < forecast.inherited_drift:
        shape = f"the engine is ahead: its windows cross epoch ends while {behaviour.framework}'s restart"
    elif n <= g:
        shape = f"tiny epochs: N={n} <= G={g} forces a Trainer update at every epoch end"
    else:
        shape = f"every epoch ends with a partial window of {n % g} micro-batch(es) the engine does not close"
    return f"{shape} ({behaviour.engine_reason})"
