"""Where every run opens and closes, whichever framework drives it: a :class:`RunStart` in, the report out.

An adapter gathers what its framework knows when training starts into a :class:`RunStart`; :func:`open_run`
builds the run and its report, starts the policy, announces the forecast, carries a resumed record on and checks
the counts training begins with; :func:`close_run` gives the engine back and makes the report final. A run that
cannot start (no DeepSpeed, an unsupported release) gets an :func:`idle_report` that says why.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

from ..core.choices import FaultAnswer, Policy
from ..core.errors import StepDriftError, StepSyncConfigError
from ..core.events import Cause, DriftEvent
from ..core.forecast import forecast
from ..core.frameworks import BackwardCall, Framework
from ..core.plan import RunPlan
from ..core.prediction import Forecast, what_the_updates_miss
from ..core.record import ResumeRecord, step_of
from ..core.relayout import Layout, ResumeShift
from ..core.report import LoadedCheckpoint, SyncReport
from ..core.tokens import Normalisation
from ..core.versions import StackBehaviour
from ..core.weights import weight_faults
from ..display.output import ConsoleOutput, logger
from .outputs import watch_outputs
from .policies import action_for
from .resume import Schedule, check_the_schedules, continue_from
from .run import Run
from .steering import PolicyAction, Steering
from .tokens import watch_tokens


@dataclass
class RunStart:
    """What an adapter knows when training starts: everything a run opens from.

    Attributes:
        framework: who keeps the count the engine's is held against.
        policy: the user's policy.
        engine: the DeepSpeed engine.
        behaviour: what the installed releases do.
        n: micro-batches per epoch on one rank (None without a dataloader length).
        g: gradient accumulation steps.
        output: where the rich views are drawn.
        is_main: whether this rank speaks.
        trainer_steps: the framework's count when training begins (a resume's).
        planned_steps: the updates the framework planned (its LR schedule's length); None for none.
        plan: what the forecast is made from (None: no forecast).
        start_epoch, skip: where a resumed run starts (0-based epoch, micro-batches already done in it).
        layout: how the run splits its data, kept in every record.
        action: what acts for the policy (default: the policy's own action).
        record: the record of the checkpoint this run resumes from, if any; ``record_problem`` why it could not
            be read.
        shift: what a resume on another layout skips and trains twice.
        inherited_remedy: what the event of a drift found at the start tells the user (default: the run's remedy).
        asked_clip: the gradient clipping norm the user asked of the framework (the Trainer's ``max_grad_norm``),
            held against the one the engine applies; None where the framework asks none. ``clip_fix``: what to
            change where they differ.
        asked_g: each place the user set G that the framework may have overridden: (where, value, the fix when
            it is not the G in force).
        loss_normalisation: how the user means each window's loss to weigh its trained tokens; ``loss_fix`` how to
            make it so in this run (default: the framework's).
        client_faults: what the framework's client does to every update that stepsync cannot undo (TRL's GRPO
            dividing by a generation batch's tokens), said before the first micro-batch.
        schedules: the LR schedulers the run steps, held at the start against the updates made (a resume's must
            stand where its checkpoint left them).
    """

    framework: Framework
    policy: Policy
    engine: Any
    behaviour: StackBehaviour
    n: Optional[int]
    g: int
    output: ConsoleOutput
    is_main: bool = True
    trainer_steps: int = 0
    planned_steps: Optional[int] = None
    plan: Optional[RunPlan] = None
    start_epoch: int = 0
    skip: int = 0
    layout: Optional[Layout] = None
    action: Optional[PolicyAction] = None
    record: Optional[ResumeRecord] = None
    record_problem: Optional[str] = None
    shift: Optional[ResumeShift] = None
    inherited_remedy: Optional[str] = None
    asked_clip: Optional[float] = None
    clip_fix: str = 'set "gradient_clipping": "auto" in the DeepSpeed config'
    asked_g: Tuple[Tuple[str, int, str], ...] = ()
    loss_normalisation: Normalisation = Normalisation.TOKEN_MEAN
    loss_fix: Optional[str] = None
    client_faults: Tuple[str, ...] = ()
    schedules: Tuple[Schedule, ...] = ()


def idle_report(framework: Framework, policy: Policy, reason: str = "", level: int = logging.INFO,
                speaks: bool = True) -> SyncReport:
    """The report of a run stepsync does not watch (before training, or with nothing to check), saying why."""
    report = SyncReport(policy, framework=framework, inactive_reason=reason)
    if reason and speaks:
        logger.log(level, "%s", reason)
    return report


def open_run(start: RunStart, built: Optional[Callable[[Run], None]] = None,
             training_starts: bool = True) -> Tuple[Run, Optional[Steering]]:
    """Open the run ``start`` describes; returns it with what its policy asks of the framework at the start.

    ``built`` receives the run as soon as it exists (the adapter keeps it, so that a failure from then on
    switches it off, and adds what only it knows) before the policy starts. ``training_starts=False`` leaves the
    forecast, a resumed record and the starting check to :func:`start_training`, for a loop that may still load a
    checkpoint before its first micro-batch.
    """
    report = SyncReport(start.policy, framework=start.framework, planned_steps=start.planned_steps)
    run = Run(start.engine, start.behaviour, start.n, start.g, report, start.output,
              start.action or action_for(start.policy), start_epoch=start.start_epoch, skip=start.skip,
              is_main=start.is_main, plan=start.plan, checks_every_micro_batch=start.framework.checks_every_micro_batch,
              layout=start.layout)
    if built is not None:
        built(run)
    report.active = True
    if not run.facts.deepspeed:
        report.updater = "optimizer"
    if not run.facts.deepspeed and "deepspeed" in start.framework.packages:  # a run that could have had DeepSpeed
        saved = ", the record in every checkpoint and the resume check" if start.framework.checkpoints else ""
        run.voice.note(f"no DeepSpeed: {start.framework.name}'s count is held against its optimizer's steps; the "
                       f"forecast{saved} ran, DeepSpeed's own checks (its counter's boundary, each micro-batch's "
                       "weight, skipped and non-finite updates, clipping) did not")
    _state_what_differs(run, start.framework)
    if start.record_problem:
        run.voice.error(f"{start.record_problem}; the report covers this run only")
    say_the_shift(run, start.shift)
    say_the_clip(run, start.asked_clip, start.clip_fix, "before the first micro-batch")
    in_force = run.g_in_force
    _say_the_weight_faults(run, start.behaviour.stack, in_force, start.framework.backward_call)
    for fault in start.client_faults:
        run.report.weight_faults.append(fault)
        repair = f"; policy '{run.policy.value}' cannot repair it from outside" if run.policy.interferes else ""
        run.object_to(f"{fault}{repair}", "before the first micro-batch")
    run.token_weights = watch_tokens(run, start.loss_normalisation, start.loss_fix or start.framework.loss_fix)
    for where, asked, fix in start.asked_g:
        if asked != in_force:
            run.report.g_in_force = in_force
            run.object_to(f"{where} asks gradient_accumulation_steps={asked} but the engine accumulates "
                                 f"{in_force} micro-batches per update; {fix}", "before the first micro-batch")
    _count_from(run, start.trainer_steps)
    steering = run.begin()
    if training_starts:
        start_training(run, start)
    return run, steering


def _state_what_differs(run: Run, framework: Framework) -> None:
    """Say once, at the start, what makes this run differ from what the forecast assumes."""
    if run.n is None:
        run.voice.note(framework.no_length)
    engine_g = run.facts.gradient_accumulation_steps
    if engine_g not in (None, run.g):
        run.known_cause, run.remedy = Cause.TWO_GS, framework.g_fix
        run.object_to(f"the engine's gradient_accumulation_steps={engine_g} differs from {framework.whose_g} "
                             f"{run.g}: {framework.g_fix}", "before the first micro-batch", error=True)
    if not run.facts.managed_accumulation:
        run.voice.note("DeepSpeed's managed_gradient_accumulation is false: the engine updates at every step() call, "
                       "not at its own boundaries; the forecast assumes managed accumulation and will differ")
    for caveat in run.behaviour.caveats:
        run.voice.note(caveat)


def _count_from(run: Run, trainer_steps: int) -> None:
    """The counts training begins with: the framework's, and the engine's as read now."""
    report = run.report
    report.trainer_steps, report.engine_steps = trainer_steps, run.engine_steps_seen
    report.engine_skipped = run.updates.skipped_seen
    report.inherited_drift = report.drift


def start_training(run: Run, start: RunStart, resumed: bool = False, forecast_now: bool = True) -> None:
    """Training begins where ``start`` says: the forecast, the record a resume carries on, and the check of the
    counts it begins with. ``resumed``: the engine was loaded after the run opened (a loop's ``load_state``), so its
    counts are read again and the run starts at ``start``'s position. ``forecast_now=False`` leaves the forecast to
    :func:`make_forecast`, for a loop whose windows are known only at its first update."""
    if resumed:
        run.epoch, run.start_epoch, run.skip = start.start_epoch - 1, start.start_epoch, start.skip
        run.plan = start.plan
        run.engine_steps_seen = run.engine_at_last_update = run.engine.global_steps
        run.updates.skipped_seen = run.engine.skipped_steps if run.counts_skips else 0
        _count_from(run, start.trainer_steps)
    if forecast_now:
        make_forecast(run, start)
    if start.record is not None:
        continue_from(run, start.record)
        _say_a_resume_that_trains_nothing(run, start.record)
    check_the_schedules(run, start.schedules, start.trainer_steps,
                        "after the resume" if start.trainer_steps or run.engine_steps_seen else "at the start")
    run.check(start.trainer_steps, "train_begin", start.inherited_remedy)
    run.updates.compare_ranks(run, "train begin")


def _say_a_resume_that_trains_nothing(run: Run, record: ResumeRecord) -> None:
    """The checkpoint already stands at the plan's end: the resumed run trains nothing (and a job that reports
    'training finished' would say so with no update made)."""
    predicted = run.report.forecast
    if predicted is None or any(row.micro_batches for row in predicted.epochs):
        return
    run.object_to(f"the resumed run trains nothing: its checkpoint holds {record.trainer_steps} update(s) "
                         f"({run.report.counter}; the plan has {predicted.planned_steps}), already the end of the "
                         "plan: resume from an earlier checkpoint, or raise the epochs or max_steps to train on",
                    "before the first micro-batch")


def make_forecast(run: Run, start: RunStart) -> None:
    """The forecast of ``start``'s plan, announced (none without a plan, or where the two counts have two Gs)."""
    report = run.report
    if start.plan is not None and run.known_cause is Cause.TWO_GS:
        engine_g = run.facts.gradient_accumulation_steps
        run.voice.note(f"no forecast: the engine's gradient_accumulation_steps is {engine_g} and "
                       f"{start.framework.name} counts with {run.g}, and a forecast counts both with one G")
    elif start.plan is not None:
        predicted = forecast(start.plan, start.behaviour, run.policy)
        predicted.resume_shift = start.shift
        if start.framework.plans_by_forecast:
            report.planned_steps = predicted.planned_steps
        elif report.planned_steps is not None and predicted.planned_steps != report.planned_steps:
            run.voice.note(f"{start.framework.name} planned max_steps={report.planned_steps}, the forecast "
                           f"{predicted.planned_steps}: the forecast may be off for this release")
        run.voice.announce(predicted)
        if run.policy.stops and not predicted.aligned:
            _stop_at_the_forecast(run, predicted)


def _stop_at_the_forecast(run: Run, predicted: Forecast) -> None:
    """Policy 'raise' and a forecast whose counts part: every rank stops before the first micro-batch, with the
    forecast's words and its first drift as the event."""
    kept = predicted.inherited_drift
    row = next((row for row in predicted.epochs if row.drift != kept), None)
    if row is None:
        return
    event = DriftEvent(epoch=row.epoch, micro_batch=row.micro_batches, trainer_steps=row.trainer_steps,
                       engine_steps=row.engine_steps, previous_drift=run.last_drift,
                       cause=run.cause_of("forecast", row.drift, row.micro_batches), remedy=run.remedy,
                       where="forecast", counter=run.report.framework.counter, updates=run.updates_counted)
    raise StepDriftError(event, f"the forecast: {predicted.verdict()}. Policy 'raise' stops every rank before the "
                                f"first micro-batch; the first drift would be {event.message()}")


def _say_the_weight_faults(run: Run, stack: Any, g: int, call: BackwardCall) -> None:
    """What the installed DeepSpeed does to each micro-batch's weight in this configuration, as probed: warned, or
    refused before the first micro-batch under raise, and under sync where stepsync cannot repair it from outside.
    The faults that need the model's output are read at its first forward (:mod:`stepsync.engine.outputs`)."""
    facts = run.facts
    deepspeed = getattr(stack, "deepspeed", None)
    if deepspeed is None or facts.zero_stage is None:
        return
    faults = weight_faults(deepspeed, facts.zero_stage, facts.offloads_optimizer, facts.precision, g, call,
                           through_outputs=None, accelerate=getattr(stack, "accelerate", None),
                           world_size=facts.data_parallel_size, accumulation=facts.accumulation)
    for fault in faults:
        if fault.through_outputs:
            continue
        text = fault.message(deepspeed, g)
        run.report.weight_faults.append(text)
        policy = run.policy
        answer = policy.answer_to_weight_fault(fault.repairable)
        if answer is FaultAnswer.REPAIR:
            run.voice.note(f"{text}; policy '{policy.value}' multiplies the loss's gradient by {g}, so that each "
                           "micro-batch weighs 1/G")
        elif answer is FaultAnswer.REFUSE:
            raise StepSyncConfigError(f"{text}; policy '{policy.value}' stops before the first micro-batch "
                                      "(stepsync cannot make these updates right from outside DeepSpeed)")
        else:
            run.voice.warn(text)
    run.output_hooks = watch_outputs(run, faults, deepspeed, g)


def say_the_shift(run: Run, shift: Optional[ResumeShift]) -> None:
    """A resume on another layout: said as a note where it lands exactly, else warned, or refused under raise."""
    if shift is None:
        return
    run.report.resume_shift = shift
    if shift.exact:
        run.voice.note(shift.message())
    else:
        run.object_to(shift.message(), "every rank before the first micro-batch")


def say_the_clip(run: Run, asked: Optional[float], fix: str, where: str) -> None:
    """The clip norm in force against the one asked: a warning naming ``fix``, or, under raise, a stop ``where``
    it is found."""
    applied = run.facts.gradient_clipping
    if asked is None or applied is None or abs(applied - asked) <= 1e-12:
        return
    text = (f"{run.report.framework.name} asks to clip gradients at {asked:g} but the DeepSpeed engine "
            + (f"clips at {applied:g}" if applied else "does not clip at all")
            + f" (the DeepSpeed config's gradient_clipping, or this DeepSpeed release's default where the config "
              f"has none, wins); {fix}")
    run.report.clip_in_force = applied
    run.object_to(text, where)


def say_switched_off(report: SyncReport, policy: Policy, reason: str, exc_info: Optional[BaseException] = None) -> None:
    """Mark ``report`` inactive for ``reason`` and say so once, with the traceback that caused it."""
    report.active = False
    report.inactive_reason = reason
    outcome = f"policy '{policy.value}' stops the run" if policy.stops else "training goes on"
    logger.error("switched itself off for this run; %s. %s", outcome, reason, exc_info=exc_info)


def close_run(report: SyncReport, run: Optional[Run], trainer_steps: int,
              loaded_folder: Optional[str] = None) -> SyncReport:
    """Training ended: give the engine its own boundary back and make the report final (once observing ended, its
    counts stay those of the last check). ``loaded_folder``: the checkpoint the framework loaded after training."""
    report.finished = True
    if run is None:
        return report
    if run.finish(trainer_steps):
        # The framework loaded a checkpoint into the engine after training (the Trainer's load_best_model_at_end):
        # the report keeps the counts of the training that happened.
        report.loaded_checkpoint = LoadedCheckpoint(loaded_folder, step_of(loaded_folder), run.engine.global_steps)
        run.voice.note(f"after training {report.framework.name} loaded {report.loaded_checkpoint}; this report "
                       "describes the training that happened")
    if run.observing:
        if report.forecast is not None:  # the resume's shift has its own line
            report.update_flaws = what_the_updates_miss(replace(report.forecast, resume_shift=None))
        run.voice.summarize()
    return report
