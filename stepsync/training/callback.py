"""``StepSyncCallback``: wires Trainer events to the run tracker (``run.py``), the forecast and a policy."""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Optional, Union

from transformers import TrainerCallback

from ..core.choices import Policy
from ..core.forecast import RunPlan, forecast, resume_position
from ..core.report import LoadedCheckpoint, StepDriftError, StepSyncConfigError, SyncReport
from ..core.versions import Stack, StackBehaviour, UnsupportedVersion, behaviour_of
from ..display.output import ConsoleOutput
from . import checkpoint
from . import engine as engine_adapter
from . import resume
from .policies import action_for
from .run import RunTracker, logger

try:  # transformers >= 4.41 saves an ExportableState callback's state() in trainer_state.json
    from transformers.trainer_callback import ExportableState
    _CALLBACK_BASES: tuple = (TrainerCallback, ExportableState)
except ImportError:  # older releases: stepsync writes its own file into the checkpoint
    _CALLBACK_BASES = (TrainerCallback,)
STORED_BY_TRAINER = len(_CALLBACK_BASES) == 2

METRIC_KEYS = ("stepsync/trainer_steps", "stepsync/engine_steps", "stepsync/drift")
INHERITED_REMEDY = ("resume from a checkpoint whose folder and DeepSpeed tag agree (see `stepsync inspect`), "
                    "or use policy='realign' to adopt the engine's count")
REUSED_ENGINE_REMEDY = ("the engine kept its count from an earlier train() of this Trainer while the Trainer started "
                        "again from 0: build a new Trainer for a new run")


# Which instance acts when a Trainer holds several: a remedy over 'raise' over 'warn', then the first.
_PRECEDENCE = {Policy.WARN: 0, Policy.RAISE: 1, Policy.SYNC: 2, Policy.REALIGN: 2, Policy.DROP_LAST: 2}


def elect(trainer) -> "StepSyncCallback":
    """The one StepSyncCallback that acts for ``trainer``."""
    ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StepSyncCallback)]
    return max(ours, key=lambda cb: _PRECEDENCE[cb.policy])


def _guarded(hook):
    """Run a hook; an internal failure ends stepsync's observation of the run instead of killing it."""

    # These run without an active run: they start one, or record that training ended.
    starts_a_run = hook.__name__ in ("on_init_end", "on_train_begin", "on_train_end")

    @functools.wraps(hook)
    def wrapper(self: "StepSyncCallback", args, state, control, **kwargs):
        if self._run is None and not starts_a_run:
            return None
        try:
            return hook(self, args, state, control, **kwargs)
        except (StepDriftError, StepSyncConfigError):
            raise
        except Exception as exc:
            self._failed(hook.__name__, exc)
            return None

    return wrapper


def _is_main(args, state) -> bool:
    """Whether this rank speaks: where the Trainer's own logs go (each node's local rank 0 with
    ``log_on_each_node``, the default; global rank 0 otherwise)."""
    return bool(getattr(args, "should_log", state.is_world_process_zero))


class StepSyncCallback(*_CALLBACK_BASES):
    """Keeps ``state.global_step`` and the DeepSpeed engine's ``global_steps`` in agreement.

    Before training it forecasts both counts per epoch; at every step end and epoch end it
    compares them, logs each change of the drift (logger ``stepsync``, rich output on rank 0),
    adds ``stepsync/*`` metrics to every log record, and applies ``policy``.

    Args:
        policy: ``"warn"`` (default; report only), ``"raise"`` (stop at the first divergence),
            ``"sync"`` (DeepSpeed's boundary follows the Trainer's), ``"realign"`` (the Trainer's count
            follows the engine's) or ``"drop_last"`` (train only full accumulation windows); a
            :class:`stepsync.Policy` member works too.
        console: a ``rich.console.Console`` for tables and panels on rank 0, ``None`` for one on
            stderr, or ``False`` for none (the logger still speaks).

    Raises:
        ValueError: for an unknown policy or a console that is not a rich Console.
        StepDriftError: with ``policy="raise"``, at the first divergence, on every rank.

    A failure inside stepsync itself is logged once with its traceback and switches stepsync off;
    training goes on, except under ``policy="raise"``, where the failure is re-raised.

    Example::

        from stepsync import StepSyncCallback
        trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed=ds_config,
                          gradient_accumulation_steps=2), train_dataset=data,
                          callbacks=[StepSyncCallback(policy="sync")])
        trainer.train()
        print(trainer.callback_handler.callbacks[-1].report.drift)
    """

    def __new__(cls, *args, **kwargs):
        # With restore_callback_states_from_checkpoint=True the Trainer rebuilds every stateful callback from
        # the checkpoint (`type(callback)(**saved_args)`) and drops the user's instance. Hand it the user's
        # instance instead, so that the object the user holds keeps the report.
        restoring = engine_adapter.callback_being_restored(cls)
        if restoring is not None:
            restoring._restored_with = kwargs
            return restoring
        return super().__new__(cls)

    def __init__(self, policy: Union[str, Policy] = Policy.WARN, console: Any = None) -> None:
        if self.__dict__.pop("_restored_with", None) is not None:
            return  # the Trainer is restoring this very instance: keep the user's choices
        self.policy = Policy.parse(policy)
        self.output = ConsoleOutput(console)
        self._report = SyncReport(self.policy)
        self._action = action_for(self.policy)
        self._run: Optional[RunTracker] = None
        self._observing = False  # checks, events, messages and metrics (the steering needs only _run)
        self._leader: Optional["StepSyncCallback"] = None

    @property
    def report(self) -> SyncReport:
        """What stepsync saw in the last run (:class:`stepsync.SyncReport`); the acting instance's report when
        another ``StepSyncCallback`` of the same Trainer acts."""
        return self._leader.report if self._leader is not None else self._report

    @report.setter
    def report(self, value: SyncReport) -> None:
        self._report = value

    # ----------------------------------------------------------------- hooks

    @_guarded
    def on_init_end(self, args, state, control, **kwargs):
        trainer = engine_adapter.find_trainer(self)
        if trainer is not None:  # before the progress bar and the reporters read the plan at on_train_begin
            engine_adapter.run_after_the_flow_callback(trainer, self)

    @_guarded
    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self._run = None
        self._leader = None
        self._observing = False
        self.report = SyncReport(self.policy)
        self._action = action_for(self.policy)
        checkpoint.keep_a_place_in(state, type(self).__name__, self.state)
        trainer = engine_adapter.find_trainer(self)
        if trainer is None:
            return self._deactivate("could not find the Trainer that runs this callback", logging.WARNING, args, state)
        leader = elect(trainer)
        if leader is not self:
            return self._follow(leader, args, state)
        if not engine_adapter.uses_deepspeed(trainer, args):
            return self._deactivate("the Trainer does not use DeepSpeed: nothing to check", logging.INFO, args, state)
        engine = engine_adapter.find_engine(trainer)
        if engine is None:
            return self._deactivate("DeepSpeed is configured but no engine with global_steps was found "
                                    "(trainer.model_wrapped); stepsync cannot check this run", logging.WARNING,
                                    args, state)
        try:
            behaviour = behaviour_of(Stack.installed())
        except UnsupportedVersion as exc:
            return self._deactivate(f"{exc}; stepsync cannot check this run", logging.WARNING, args, state)
        before = (state.global_step, state.max_steps)
        failure = None
        try:
            self._begin(args, state, engine, train_dataloader, trainer, behaviour)
        except (StepDriftError, StepSyncConfigError):
            raise
        except Exception as exc:
            failure = exc
        self._agree_on_the_start(trainer, state, before, failure)
        engine_adapter.run_after_the_flow_callback(trainer, self)

    # A hook's work is of two kinds. Steering (positions, the policy's effect on training) reads only counters
    # that are equal on every rank and touches no file, logger or console: a fault there is the same on every
    # rank. Observing (checks, events, messages, metrics, records) is where a rank's disk, terminal or
    # handlers can fail alone: a fault there ends observing on that rank and never changes the steering.

    @_guarded
    def on_epoch_begin(self, args, state, control, **kwargs):
        try:
            self._run.begin_epoch()
            self._action.before_micro_batch(self._run)
        except (StepDriftError, StepSyncConfigError):
            raise
        except Exception as exc:
            self._failed("on_epoch_begin", exc, steering=True)

    # The two hooks of every micro-batch skip _guarded (an extra call and **kwargs pass, microseconds each):
    # _after_micro_batch guards itself.
    def on_substep_end(self, args, state, control, **kwargs):
        if self._run is not None:
            self._after_micro_batch(args, state, control, False)

    def on_step_end(self, args, state, control, **kwargs):
        if self._run is not None:
            self._after_micro_batch(args, state, control, True)

    @_guarded
    def on_epoch_end(self, args, state, control, **kwargs):
        run = self._run
        try:
            run.engine_steps_seen = run.engine.global_steps
            self._action.at_epoch_end(run, args, state, control)
        except (StepDriftError, StepSyncConfigError):
            raise
        except Exception as exc:
            return self._failed("on_epoch_end", exc, steering=True)
        if self._observing:
            run.check(state.global_step, "epoch_end")
            run.end_epoch(state.global_step)

    @_guarded
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self._observing:
            return
        metrics = self._metrics(state)
        logs.update(metrics)
        # The Trainer appended this record to log_history before calling us: complete it there too.
        if state.log_history and all(state.log_history[-1].get(k) == v for k, v in logs.items() if k in state.log_history[-1]):
            state.log_history[-1].update(metrics)

    @_guarded
    def on_save(self, args, state, control, **kwargs):
        record = resume.record_of(self._run)
        if record is None or not getattr(args, "should_save", state.is_world_process_zero):
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(folder):
            self._run.note(f"no checkpoint folder {folder}: stepsync's record was not saved with it")
            return
        try:
            checkpoint.save_record(folder, record, STORED_BY_TRAINER, state)
        except OSError as exc:  # this checkpoint lacks the record; the run and its steering go on
            if self.policy is Policy.RAISE:
                raise
            self._run.error(f"could not write stepsync's record into {folder} ({exc}); "
                            f"{self._what_a_resume_loses(record)}; training goes on")
            return
        if record.resume_steps is None:
            self._run.note(f"{folder}: no global_step makes the Trainer resume at epoch {record.next_epoch + 1}, "
                           f"micro-batch {record.next_skip}; a resume from it repeats or skips micro-batches")

    @staticmethod
    def _what_a_resume_loses(record) -> str:
        lost = [] if STORED_BY_TRAINER else ["a resume from it starts a new report"]
        if record.resume_steps not in (None, record.trainer_steps):
            lost.append(f"its trainer_state.json keeps global_step {record.trainer_steps}, so a resume from it "
                        f"does not land at epoch {record.next_epoch + 1}, micro-batch {record.next_skip}")
        return "; ".join(lost) or "a resume from it loses nothing"

    def state(self) -> dict:
        """``ExportableState`` (transformers >= 4.41): the record the Trainer saves in ``trainer_state.json``."""
        try:
            record = resume.record_of((self._leader or self)._run)
        except Exception:  # never break the Trainer's save
            logger.debug("stepsync: could not build the resume record", exc_info=True)
            record = None
        return {"args": {"policy": self.policy.value},
                "attributes": {"saved_record": record.to_dict() if record else None}}

    @_guarded
    def on_train_end(self, args, state, control, **kwargs):
        run = self._run
        if self._leader is None:
            self.report.finished = True
        if run is None:
            return
        try:
            self._action.end(run)
        except Exception as exc:
            return self._failed("on_train_end", exc, steering=True)
        if not self._observing:
            return
        # The counts of the training that happened: with load_best_model_at_end the Trainer has already
        # loaded the best checkpoint into the engine, which took that checkpoint's count back.
        self.report.trainer_steps = state.global_step
        self.report.engine_steps = run.engine_steps_seen
        self.report.unapplied_micro_batches = run.since_engine_update
        engine_now = run.engine.global_steps
        if engine_now != run.engine_steps_seen:
            folder = getattr(state, "best_model_checkpoint", None)
            self.report.loaded_checkpoint = LoadedCheckpoint(folder, checkpoint.step_of(folder), engine_now)
            run.note(f"after training the Trainer loaded {self.report.loaded_checkpoint}; this report describes "
                     "the training that happened")
        run.summarize()

    # ----------------------------------------------------------------- logic

    def _begin(self, args, state, engine, train_dataloader, trainer, behaviour: StackBehaviour) -> None:
        try:
            n = len(train_dataloader)
        except TypeError:
            n = None
        g = args.gradient_accumulation_steps
        record, record_problem = resume.saved_record(state, engine_adapter.resume_checkpoint(trainer))
        resume_steps = None
        if record is not None and record.resume_steps == state.global_step != record.trainer_steps:
            # The checkpoint holds the data position's count for the Trainer's resume; restore the real one.
            resume_steps = state.global_step
            engine_adapter.set_global_step(trainer, state, record.trainer_steps)
        plan = None
        start_epoch, skip = 0, 0
        if n is not None and n > 0:
            plan = RunPlan(n, g, args.num_train_epochs, args.max_steps, state.global_step, engine.global_steps,
                           resume_steps, engine_adapter.examples_of(trainer, train_dataloader))
            start_epoch, skip = resume_position(plan, behaviour)
        else:
            n = None
        run = self._run = RunTracker(self, engine, behaviour, n, g, start_epoch, skip, _is_main(args, state))
        run.plan, run.state, run.trainer = plan, state, trainer
        self._serve_a_generation_buffer(args, run)
        self._observing = True
        self.report.active = True
        self.report.planned_steps = state.max_steps
        run.state_what_differs("the Trainer's")
        if record_problem:
            run.error(f"{record_problem}; the report covers this run only")
        self.report.trainer_steps, self.report.engine_steps = state.global_step, engine.global_steps
        self.report.inherited_drift = self.report.drift
        self._action.begin(run)
        if plan is not None:
            predicted = forecast(plan, behaviour, self.report.policy)
            if predicted.planned_steps != self.report.planned_steps:
                run.note(f"the Trainer planned max_steps={self.report.planned_steps}, the forecast "
                         f"{predicted.planned_steps}: the forecast may be off for this release")
            run.announce(predicted)
        if record is not None:
            resume.continue_from(run, record)
        run.check(state.global_step, "train_begin",
                  REUSED_ENGINE_REMEDY if state.global_step == 0 else INHERITED_REMEDY)

    def _serve_a_generation_buffer(self, args, run: RunTracker) -> None:
        """TRL's GRPO-style Trainers serve micro-batches from a buffer of ``steps_per_generation`` of them: one
        that is not a multiple of G cuts windows across generations, and ending an epoch early only shifts the
        buffer (what goes untrained is not the epoch's tail)."""
        per_generation = getattr(args, "steps_per_generation", None)
        if not isinstance(per_generation, int) or per_generation <= 1 or per_generation % run.g == 0:
            return
        fix = (f"set steps_per_generation to a multiple of gradient_accumulation_steps={run.g} (it is "
               f"{per_generation})")
        run.remedy = f"{run.remedy}; or {fix}"
        if self.policy is Policy.DROP_LAST:
            raise StepSyncConfigError(
                f"policy 'drop_last' cannot drop the right micro-batches here: this Trainer serves them from a "
                f"generation buffer of steps_per_generation={per_generation}, so ending an epoch early shifts the "
                f"buffer and other micro-batches go untrained; {fix}, or use policy='sync'")

    def _agree_on_the_start(self, trainer, state, before: tuple, failure: Optional[Exception]) -> None:
        """One collective before the first micro-batch: every rank steers this run the same way, or none does.

        A rank whose checkpoint files or start differ from the others' (a record that could not be written on
        one node, a fault on one rank) would otherwise train different micro-batches than its peers.
        """
        after = (state.global_step, state.max_steps)
        spread = engine_adapter.spread_across_ranks(trainer, (*before, *after, failure is not None))
        resumed_apart = any(low != high for low, high in spread[:2])
        started_apart = any(low != high for low, high in spread[2:])
        if not (resumed_apart or started_apart or failure):
            return
        if resumed_apart:
            (step_low, step_high), (plan_low, plan_high) = spread[:2]
            reason = (f"the ranks resumed at different points (global_step {step_low}..{step_high}, max_steps "
                      f"{plan_low}..{plan_high}): every node must resume from the same checkpoint; with "
                      "save_on_each_node, make each node's checkpoint-N/trainer_state.json the same (copy node 0's)")
        elif failure is None:
            reason = "stepsync failed to start on another rank (its log says why)"
        else:
            reason = f"internal error in on_train_begin: {failure!r}"
        if resumed_apart:  # the ranks would train different micro-batches and wait on each other: stop them all
            self._switch_off(reason)
            raise StepSyncConfigError(f"{reason}; stepsync stops every rank before the first micro-batch")
        if self.policy is Policy.RAISE:
            if failure is not None:
                self._switch_off(reason, exc_info=failure)
                raise failure
            raise StepSyncConfigError(f"{reason}; policy 'raise' stops every rank before the first micro-batch")
        # Every rank takes the Trainer's own start back: none of them steers.
        engine_adapter.set_global_step(trainer, state, before[0])
        state.max_steps = before[1]
        self._switch_off(f"{reason}; no rank steers this run", exc_info=failure)

    def _after_micro_batch(self, args, state, control, trainer_updated: bool) -> None:
        run = self._run
        try:
            engine_updated = run.micro_batch_done()
            action = self._action
            if action.acts_per_micro_batch:  # warn and raise skip two calls on every micro-batch
                action.after_micro_batch(run, trainer_updated, engine_updated, args, state, control)
                self._action.before_micro_batch(run)  # a fallback may have replaced the action
        except (StepDriftError, StepSyncConfigError):
            raise
        except Exception as exc:
            return self._failed("on_step_end" if trainer_updated else "on_substep_end", exc, steering=True)
        if trainer_updated and self._observing:
            try:
                run.check(state.global_step, "step_end")
            except (StepDriftError, StepSyncConfigError):
                raise
            except Exception as exc:
                self._failed("on_step_end", exc)

    def _metrics(self, state) -> dict:
        # The count after the last micro-batch: the final log record comes after load_best_model_at_end
        # has taken the engine back to the best checkpoint's count.
        engine_steps = self._run.engine_steps_seen
        return {METRIC_KEYS[0]: state.global_step, METRIC_KEYS[1]: engine_steps,
                METRIC_KEYS[2]: state.global_step - engine_steps}

    def _follow(self, leader: "StepSyncCallback", args, state) -> None:
        """Another instance acts for this Trainer: stay silent, and share its report."""
        self._leader = leader
        if _is_main(args, state):
            level = logging.WARNING if self.policy is not leader.policy else logging.INFO
            logger.log(level, "stepsync: this Trainer has two StepSyncCallbacks; the one with policy '%s' acts and "
                       "this one (policy '%s') stays silent; both give the same report", leader.policy.value,
                       self.policy.value)

    def _deactivate(self, reason: str, level: int, args, state) -> None:
        self.report.active = False
        self.report.inactive_reason = reason
        if _is_main(args, state):
            logger.log(level, "stepsync: %s", reason)

    def _failed(self, hook: str, exc: Exception, steering: bool = False) -> None:
        """A failure inside stepsync. Under policy 'raise' it stops the run. Otherwise a fault of the steering
        (the same on every rank) switches stepsync off, and a fault of the observing ends only the observing:
        the policy keeps acting on training, so that this rank keeps taking its peers' decisions."""
        reason = f"internal error in {hook}: {exc!r}"
        if self.policy is Policy.RAISE:
            self._switch_off(reason, exc_info=exc)
            raise exc
        if steering:
            return self._switch_off(reason, exc_info=exc)
        self._observing = False
        self.report.active = False
        self.report.inactive_reason = f"{reason}; stopped observing, policy '{self.report.policy.value}' still acts"
        logger.error("stepsync stopped observing this run on this rank (no more checks, messages or metrics); "
                     "its policy '%s' goes on acting on training as on every other rank. %s",
                     self.report.policy.value, reason, exc_info=exc)

    def _switch_off(self, reason: str, exc_info: Optional[BaseException] = None) -> None:
        run, self._run = self._run, None
        self._observing = False
        self.report.active = False
        self.report.inactive_reason = reason
        outcome = "policy 'raise' stops the run" if self.policy is Policy.RAISE else "training goes on"
        logger.error("stepsync switched itself off for this run; %s. %s", outcome, reason, exc_info=exc_info)
        if run is None:
            return
        planned = self.report.planned_steps
        if run.state is not None and planned is not None and run.state.max_steps < planned:
            run.state.max_steps = planned  # a lowered plan would now end the run early
        try:
            self._action.end(run)
        except Exception:  # the engine is already broken; nothing more to restore
            logger.debug("stepsync: could not restore the engine", exc_info=True)
