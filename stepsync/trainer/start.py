"""The Trainer's run before its first micro-batch: the run built from the Trainer's state (a resume's record
included), the forecast, TRL's generation buffer, and one agreement across ranks."""
from __future__ import annotations

import math
from typing import Any, Tuple

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.forecast import forecast
from ..core.plan import RunPlan, resume_position
from ..core.report import SyncReport
from ..core.versions import StackBehaviour
from ..display.output import ConsoleOutput
from ..engine.deepspeed import spread_across_ranks
from ..engine.loop_objects import length_of
from ..engine.resume import continue_from
from ..engine.run import Run
from . import trainer as trainer_facts

INHERITED_REMEDY = ("resume from a checkpoint whose folder and DeepSpeed tag agree (see `stepsync inspect`), "
                    "or use policy='realign' to adopt the engine's count")
REUSED_ENGINE_REMEDY = ("the engine kept its count from an earlier train() of this Trainer while the Trainer started "
                        "again from 0: build a new Trainer for a new run")


def start_run(trainer: Any, args: Any, state: Any, engine: Any, train_dataloader: Any, behaviour: StackBehaviour,
              report: SyncReport, output: ConsoleOutput, is_main: bool, keep: Any) -> Run:
    """Build the run of ``trainer``, hand it to ``keep`` (so that a failure from here on can switch it off), start
    its policy, announce the forecast and check the counts training begins with."""
    n = length_of(train_dataloader) or None
    g = args.gradient_accumulation_steps
    record, record_problem = trainer_facts.saved_record(state, trainer_facts.resume_checkpoint(trainer))
    examples = trainer_facts.examples_of(trainer, train_dataloader)
    layout = trainer_facts.layout_of(args, engine, examples)
    shift = None if record is None or layout is None else record.resume_on(
        layout, state.global_step, behaviour.planned_steps, math.ceil(args.num_train_epochs))
    resume_steps = None
    if record is not None and record.resume_steps == state.global_step != record.trainer_steps:
        # The checkpoint holds the data position's count for the Trainer's resume; restore the real one.
        resume_steps = state.global_step
        trainer_facts.set_global_step(trainer, state, record.trainer_steps)
    plan = None
    start_epoch, skip = 0, 0
    if n is not None:
        plan = RunPlan(n, g, args.num_train_epochs, args.max_steps, state.global_step, engine.global_steps,
                       resume_steps, examples)
        start_epoch, skip = resume_position(plan, behaviour)
    run = Run(engine, behaviour, n, g, report, output, start_epoch=start_epoch, skip=skip, is_main=is_main,
              plan=plan, layout=layout)
    serve_a_generation_buffer(args, run, report.policy)
    keep(run)
    report.active = True
    report.planned_steps = state.max_steps
    run.state_what_differs("the Trainer's")
    if record_problem:
        run.error(f"{record_problem}; the report covers this run only")
    if shift is not None:
        report.resume_shift = shift
        if shift.exact:
            run.note(shift.message())
        elif report.policy is Policy.RAISE:
            raise StepSyncConfigError(f"{shift.message()}; policy 'raise' stops every rank before the first "
                                      "micro-batch")
        else:
            run.warn(shift.message())
    report.trainer_steps, report.engine_steps = state.global_step, engine.global_steps
    report.inherited_drift = report.drift
    steering = run.begin()
    if steering is not None and steering.max_steps is not None:
        state.max_steps = steering.max_steps
    if plan is not None:
        predicted = forecast(plan, behaviour, report.policy)
        predicted.resume_shift = shift
        if predicted.planned_steps != report.planned_steps:
            run.note(f"the Trainer planned max_steps={report.planned_steps}, the forecast "
                     f"{predicted.planned_steps}: the forecast may be off for this release")
        run.announce(predicted)
    if record is not None:
        continue_from(run, record)
    run.check(state.global_step, "train_begin", REUSED_ENGINE_REMEDY if state.global_step == 0 else INHERITED_REMEDY)
    return run


def serve_a_generation_buffer(args: Any, run: Run, policy: Policy) -> None:
    """TRL's GRPO-style Trainers serve micro-batches from a buffer of ``steps_per_generation`` of them: one
    that is not a multiple of G cuts windows across generations, and ending an epoch early only shifts the
    buffer (what goes untrained is not the epoch's tail)."""
    per_generation = getattr(args, "steps_per_generation", None)
    if not isinstance(per_generation, int) or per_generation <= 1 or per_generation % run.g == 0:
        return
    fix = f"set steps_per_generation to a multiple of gradient_accumulation_steps={run.g} (it is {per_generation})"
    run.remedy = f"{run.remedy}; or {fix}"
    if policy is Policy.DROP_LAST:
        raise StepSyncConfigError(
            f"policy 'drop_last' cannot drop the right micro-batches here: this Trainer serves them from a "
            f"generation buffer of steps_per_generation={per_generation}, so ending an epoch early shifts the "
            f"buffer and other micro-batches go untrained; {fix}, or use policy='sync'")


def how_the_ranks_started(args: Any, state: Any, before: Tuple[int, int], failed_here: bool) -> Tuple[str, str]:
    """One collective before the first micro-batch, on every rank: ``(verdict, reason)``.

    ``verdict`` is ``"together"`` (every rank starts as this one), ``"resumed_apart"`` (the ranks resumed from
    checkpoints that differ: they would train different micro-batches and wait on each other), or
    ``"failed"`` (stepsync failed to start on some rank: none may steer). A rank whose start differs from the
    others' (a record that could not be written on one node, a fault on one rank) would otherwise train
    different micro-batches than its peers.
    """
    after = (state.global_step, state.max_steps)
    spread = spread_across_ranks((*before, *after, failed_here), getattr(args, "device", "cpu"))
    if any(low != high for low, high in spread[:2]):
        (step_low, step_high), (plan_low, plan_high) = spread[:2]
        return "resumed_apart", (
            f"the ranks resumed at different points (global_step {step_low}..{step_high}, max_steps "
            f"{plan_low}..{plan_high}): every node must resume from the same checkpoint; with "
            "save_on_each_node, make each node's checkpoint-N/trainer_state.json the same (copy node 0's)")
    if any(low != high for low, high in spread[2:]) or failed_here:
        return "failed", "stepsync failed to start on another rank (its log says why)"
    return "together", ""
