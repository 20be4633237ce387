"""The Trainer's run before its first micro-batch: what the Trainer's state says of it (a resume's record
included), TRL's generation buffer, and one agreement across ranks."""
from __future__ import annotations

import math
from enum import Enum
from typing import Any, Callable, Optional, Tuple

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.frameworks import COMPUTE_LOSS_FUNC_FIX, COMPUTE_LOSS_FUNC_FIX_OLDER, TRAINER
from ..core.plan import RunPlan, resume_position
from ..core.record import record_from_files
from ..core.tokens import Normalisation, trl_generation_scale
from ..core.versions import LOSS_FUNC_GETS_ITEMS, StackBehaviour, installed_version
from ..display.output import ConsoleOutput
from ..engine.deepspeed import engine_facts, spread_across_ranks
from ..engine.lifecycle import RunStart, open_run
from ..engine.loop_objects import length_of
from ..engine.resume import engines_schedule
from ..engine.run import Run
from . import trainer as trainer_facts

INHERITED_REMEDY = ("resume from a checkpoint whose folder and DeepSpeed tag agree (see `stepsync inspect`), "
                    "or use policy='realign' to adopt the engine's count")
REUSED_ENGINE_REMEDY = ("the engine kept its count from an earlier train() of this Trainer while the Trainer started "
                        "again from 0: build a new Trainer for a new run")


class StartVerdict(Enum):
    """How the ranks started a run, as every rank learns it from one collective."""

    TOGETHER = "every rank starts as this one"
    RESUMED_APART = "the ranks resumed from checkpoints that differ: they would train different micro-batches"
    FAILED = "stepsync failed to start on some rank: none may steer"


def start_run(trainer: Any, args: Any, state: Any, engine: Any, train_dataloader: Any, behaviour: StackBehaviour,
              policy: Policy, output: ConsoleOutput, is_main: bool, keep: Callable[[Run], None],
              loss_normalisation: Normalisation = Normalisation.TOKEN_MEAN) -> Run:
    """Open the run of ``trainer`` from its state; ``keep`` gets it as soon as it exists (so that a failure from
    then on switches it off). The plan a policy lowers is set in ``state``."""
    n = length_of(train_dataloader) or None
    g = args.gradient_accumulation_steps
    folder = trainer_facts.resume_checkpoint(trainer)
    record, record_problem = trainer_facts.saved_record(state, folder)
    examples = trainer_facts.examples_of(trainer, train_dataloader)
    layout = trainer_facts.layout_of(args, engine, examples)
    saved, read_from_files = record, ""
    if (record is None or record.layout is None) and folder and state.global_step > 0 and layout is not None:
        saved, read_from_files = record_from_files(folder, state.global_step, layout, behaviour.planned_steps)
    layout_unknown = read_from_files if saved is None else ""  # why the files do not tell it
    shift = None if saved is None or layout is None else saved.resume_on(
        layout, state.global_step, behaviour.planned_steps, math.ceil(args.num_train_epochs))
    if shift is not None and saved is not record:
        shift.read_from_files = read_from_files
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
    dropped = trainer_facts.sharding_asked_and_dropped(trainer, args)

    def built(run: Run) -> None:
        keep(run)
        if dropped:
            run.voice.note(dropped)
        if layout_unknown:
            run.voice.note(f"{layout_unknown}: a resume on another layout cannot be told")
        serve_a_generation_buffer(args, run, policy)

    run, steering = open_run(RunStart(
        TRAINER, policy, engine, behaviour, n, g, output, is_main=is_main, trainer_steps=state.global_step,
        planned_steps=state.max_steps, plan=plan, start_epoch=start_epoch, skip=skip, layout=layout, record=record,
        record_problem=record_problem, shift=shift,
        inherited_remedy=REUSED_ENGINE_REMEDY if state.global_step == 0 else INHERITED_REMEDY,
        asked_clip=trainer_facts.asked_clip(args), loss_normalisation=loss_normalisation,
        loss_fix=loss_fix_of(trainer),
        client_faults=client_faults(args),
        schedules=engines_schedule(engine) if engine_facts(engine).deepspeed else ()), built)
    if steering is not None and steering.max_steps is not None:
        state.max_steps = steering.max_steps
    return run


def loss_fix_of(trainer: Any) -> Optional[str]:
    """How to make each window's loss a token mean in this Trainer: with a compute_loss_func, in that function (in the
    words that hold on the installed release); else the framework's own fix (None)."""
    if getattr(trainer, "compute_loss_func", None) is None:
        return None
    return (COMPUTE_LOSS_FUNC_FIX if LOSS_FUNC_GETS_ITEMS.covers(installed_version("transformers") or "0")
            else COMPUTE_LOSS_FUNC_FIX_OLDER)


def client_faults(args: Any) -> Tuple[str, ...]:
    """What a Trainer built on this one (TRL's) does to each update, as probed: said before the first micro-batch."""
    scaled = trl_generation_scale(installed_version("trl"), getattr(args, "loss_type", None),
                                  getattr(args, "steps_per_generation", None), args.gradient_accumulation_steps)
    return (scaled,) if scaled else ()


def serve_a_generation_buffer(args: Any, run: Run, policy: Policy) -> None:
    """TRL's GRPO-style Trainers serve micro-batches from a buffer of ``steps_per_generation`` of them: one
    that is not a multiple of G cuts windows across generations, and ending an epoch early only shifts the
    buffer (what goes untrained is not the epoch's tail)."""
    per_generation = getattr(args, "steps_per_generation", None)
    if not isinstance(per_generation, int) or per_generation <= 1 or per_generation % run.g == 0:
        return
    fix = f"set steps_per_generation to a multiple of gradient_accumulation_steps={run.g} (it is {per_generation})"
    run.remedy = f"{run.remedy}; or {fix}"
    if policy.ends_epochs_early:
        raise StepSyncConfigError(
            f"policy 'drop_last' cannot drop the right micro-batches here: this Trainer serves them from a "
            f"generation buffer of steps_per_generation={per_generation}, so ending an epoch early shifts the "
            f"buffer and other micro-batches go untrained; {fix}, or use policy='sync'")


def how_the_ranks_started(args: Any, state: Any, before: Tuple[int, int],
                          failed_here: bool) -> Tuple[StartVerdict, str]:
    """One collective before the first micro-batch, on every rank: the :class:`StartVerdict` and its reason in
    words. A rank whose start differs from the others' (a record that could not be written on one node, a fault on
    one rank) would otherwise train different micro-batches than its peers and wait on them."""
    after = (state.global_step, state.max_steps)
    spread = spread_across_ranks((*before, *after, failed_here), getattr(args, "device", "cpu"))
    if any(low != high for low, high in spread[:2]):
        (step_low, step_high), (plan_low, plan_high) = spread[:2]
        return StartVerdict.RESUMED_APART, (
            f"the ranks resumed at different points (global_step {step_low}..{step_high}, max_steps "
            f"{plan_low}..{plan_high}): every node must resume from the same checkpoint; with "
            "save_on_each_node, make each node's checkpoint-N/trainer_state.json the same (copy node 0's)")
    if any(low != high for low, high in spread[2:]) or failed_here:
        return StartVerdict.FAILED, "stepsync failed to start on another rank (its log says why)"
    return StartVerdict.TOGETHER, ""
