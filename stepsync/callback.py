"""``StepSyncCallback``: wires Trainer events to the forecast, the drift check and a policy."""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Optional, Union

from transformers import TrainerCallback

from . import checkpoint
from . import engine as engine_adapter
from .choices import Policy
from .forecast import Forecast, RunPlan, forecast, resume_position, resume_steps_for
from .output import logging_reaches
from .policies import PolicyAction, RealignAction, action_for
from .report import (Cause, DriftEvent, EpochCount, LoadedCheckpoint, ResumeRecord, StepDriftError, StepSyncConfigError,
                     SyncReport)
from .versions import Stack, StackBehaviour, UnsupportedVersion, behaviour_of

try:  # transformers >= 4.41 saves an ExportableState callback's state() in trainer_state.json
    from transformers.trainer_callback import ExportableState
    _CALLBACK_BASES: tuple = (TrainerCallback, ExportableState)
except ImportError:  # older releases: stepsync writes its own file into the checkpoint
    _CALLBACK_BASES = (TrainerCallback,)
STORED_BY_TRAINER = len(_CALLBACK_BASES) == 2

logger = logging.getLogger("stepsync")

METRIC_KEYS = ("stepsync/trainer_steps", "stepsync/engine_steps", "stepsync/drift")
INHERITED_REMEDY = ("resume from a checkpoint whose folder and DeepSpeed tag agree (see `stepsync inspect`), "
                    "or use policy='realign' to adopt the engine's count")
REUSED_ENGINE_REMEDY = ("the engine kept its count from an earlier train() of this Trainer while the Trainer started "
                        "again from 0: build a new Trainer for a new run")


class RunTracker:
    """Where the run is, as stepsync counts it: epoch, position in the epoch, engine counters.

    Attributes:
        epoch: 0-based epoch now running (``-1`` before the first ``on_epoch_begin``).
        position: micro-batches done in this epoch (the Trainer's ``step + 1``).
        micro_batches: micro-batches done since ``on_train_begin``.
        t_before_epoch: the Trainer's cross-epoch micro-batch counter before this epoch's position 0.
        engine_steps_seen: ``engine.global_steps`` after the last micro-batch.
        since_engine_update: micro-batches the engine accumulated since its last update.
    """

    __slots__ = ("callback", "engine", "facts", "behaviour", "n", "g", "is_main", "report", "epoch", "start_epoch",
                 "skip", "position", "micro_batches", "t_before_epoch", "engine_steps_seen", "since_engine_update",
                 "plan", "state")

    def __init__(self, callback: "StepSyncCallback", engine: Any, behaviour: StackBehaviour,
                 n: Optional[int], g: int, start_epoch: int, skip: int, is_main: bool) -> None:
        self.callback = callback
        self.engine = engine
        self.facts = engine_adapter.engine_facts(engine)
        self.behaviour = behaviour
        self.n = n
        self.g = g
        self.is_main = is_main
        self.report = callback.report
        self.epoch = start_epoch - 1
        self.start_epoch = start_epoch
        self.skip = skip
        self.position = 0
        self.micro_batches = 0
        self.t_before_epoch = 0
        self.engine_steps_seen = engine.global_steps
        self.since_engine_update = 0
        self.plan: Optional[RunPlan] = None  # None when the dataloader has no length
        self.state: Any = None  # the Trainer's TrainerState of this run

    def note(self, text: str) -> None:
        self.report.notes.append(text)
        if self.is_main:
            logger.info("stepsync: %s", text)

    def error(self, text: str) -> None:
        self.report.notes.append(text)
        logger.error("stepsync: %s", text)

    def replace_action(self, action: PolicyAction) -> PolicyAction:
        self.callback._action = action
        return action

    def next_position(self) -> tuple:
        """(0-based epoch, micro-batches done in it) of the next micro-batch the run will train."""
        if self.n is not None and self.position >= self.callback._action.last_position(self):
            return self.epoch + 1, 0
        return self.epoch, self.position

    def fall_back(self, reason: Optional[str]) -> PolicyAction:
        """Switch to ``realign`` for the rest of the run, never silently drifting on."""
        if reason:
            self.error(f"{reason}; falling back to policy 'realign'")
        self.report.policy = Policy.REALIGN
        action = RealignAction()
        action.begin(self)
        return self.replace_action(action)


# Which instance acts when a Trainer holds several: a remedy over 'raise' over 'warn', then the first.
_PRECEDENCE = {Policy.WARN: 0, Policy.RAISE: 1, Policy.SYNC: 2, Policy.REALIGN: 2, Policy.DROP_LAST: 2}


def elect(trainer) -> "StepSyncCallback":
    """The one StepSyncCallback that acts for ``trainer``."""
    ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StepSyncCallback)]
    return max(ours, key=lambda cb: _PRECEDENCE[cb.policy])


def _guarded(hook):
    """Run a hook; an internal failure switches stepsync off for the run instead of killing it."""

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
        if console is not None and console is not False and not hasattr(console, "print"):
            raise ValueError(f"console must be a rich.console.Console, None or False, got {type(console).__name__}")
        self._console_choice = console
        self._report = SyncReport(self.policy)
        self._action = action_for(self.policy)
        self._run: Optional[RunTracker] = None
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
            self._run_before_reporters(trainer)

    @_guarded
    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self._run = None
        self._leader = None
        self.report = SyncReport(self.policy)
        self._action = action_for(self.policy)
        checkpoint.keep_a_place_in(state, type(self).__name__, self.state)
        trainer = engine_adapter.find_trainer(self)
        if trainer is None:
            return self._deactivate("could not find the Trainer that runs this callback", logging.WARNING, state)
        leader = elect(trainer)
        if leader is not self:
            return self._follow(leader, state)
        if not engine_adapter.uses_deepspeed(trainer, args):
            return self._deactivate("the Trainer does not use DeepSpeed: nothing to check", logging.INFO, state)
        engine = engine_adapter.find_engine(trainer)
        if engine is None:
            return self._deactivate("DeepSpeed is configured but no engine with global_steps was found "
                                    "(trainer.model_wrapped); stepsync cannot check this run", logging.WARNING, state)
        try:
            behaviour = behaviour_of(Stack.installed())
        except UnsupportedVersion as exc:
            return self._deactivate(f"{exc}; stepsync cannot check this run", logging.WARNING, state)
        self._begin(args, state, engine, train_dataloader, trainer, behaviour)
        self._run_before_reporters(trainer)

    @_guarded
    def on_epoch_begin(self, args, state, control, **kwargs):
        run = self._run
        run.epoch += 1
        run.position = run.skip if run.epoch == run.start_epoch else 0
        run.t_before_epoch = run.micro_batches - run.position
        self._action.before_micro_batch(run)

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
        run.engine_steps_seen = run.engine.global_steps
        self._action.at_epoch_end(run, args, state, control)
        self._check(state, "epoch_end")
        first = run.skip if run.epoch == run.start_epoch else 0
        self.report.epochs.append(EpochCount(run.epoch + 1, run.position - first, state.global_step,
                                             run.engine_steps_seen))
        self._compare_with_forecast(state)

    @_guarded
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        metrics = self._metrics(state)
        logs.update(metrics)
        # The Trainer appended this record to log_history before calling us: complete it there too.
        if state.log_history and all(state.log_history[-1].get(k) == v for k, v in logs.items() if k in state.log_history[-1]):
            state.log_history[-1].update(metrics)

    @_guarded
    def on_save(self, args, state, control, **kwargs):
        record = self._record()
        if record is None or not getattr(args, "should_save", state.is_world_process_zero):
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(folder):
            self._run.note(f"no checkpoint folder {folder}: stepsync's record was not saved with it")
            return
        checkpoint.save_record(folder, record, STORED_BY_TRAINER)
        if record.resume_steps is None:
            self._run.note(f"{folder}: no global_step makes the Trainer resume at epoch {record.next_epoch + 1}, "
                           f"micro-batch {record.next_skip}; a resume from it repeats or skips micro-batches")

    def state(self) -> dict:
        """``ExportableState`` (transformers >= 4.41): the record the Trainer saves in ``trainer_state.json``."""
        try:
            record = (self._leader or self)._record()
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
        self._action.end(run)
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
        if run.is_main:
            logger.info("stepsync: Trainer counted %d updates, engine made %d (drift %+d)",
                        self.report.trainer_steps, self.report.engine_steps, self.report.drift)
            self._show("summary_view", self.report, logging.INFO)

    # ----------------------------------------------------------------- logic

    def _begin(self, args, state, engine, train_dataloader, trainer, behaviour: StackBehaviour) -> None:
        try:
            n = len(train_dataloader)
        except TypeError:
            n = None
        g = args.gradient_accumulation_steps
        record, record_problem = self._saved_record(state, trainer)
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
        run = self._run = RunTracker(self, engine, behaviour, n, g, start_epoch, skip, state.is_world_process_zero)
        run.plan, run.state = plan, state
        self.report.active = True
        self.report.planned_steps = state.max_steps
        if n is None:
            run.note("the train dataloader has no length: no forecast, and 'sync'/'drop_last' cannot plan windows")
        if run.facts.gradient_accumulation_steps not in (None, g):
            run.error(f"the engine's gradient_accumulation_steps={run.facts.gradient_accumulation_steps} differs "
                      f"from the Trainer's {g}: fix the DeepSpeed config (use \"auto\")")
        if not run.facts.managed_accumulation:
            run.note("DeepSpeed's managed_gradient_accumulation is false: the engine updates at every step() call, "
                     "not at its own boundaries; the forecast assumes managed accumulation and will differ")
        if record_problem:
            run.error(f"{record_problem}; the report covers this run only")
        for caveat in behaviour.caveats:
            run.note(caveat)
        self._read_counts(state)
        self.report.inherited_drift = self.report.drift
        self._action.begin(run)
        if plan is not None:
            self.report.forecast = forecast(plan, behaviour, self.report.policy)
            if self.report.forecast.planned_steps != self.report.planned_steps:
                run.note(f"the Trainer planned max_steps={self.report.planned_steps}, the forecast "
                         f"{self.report.forecast.planned_steps}: the forecast may be off for this release")
            if run.is_main:
                logger.info("stepsync forecast: %s", self.report.forecast.verdict())
                self._show("forecast_view", self.report.forecast, logging.INFO)
            early = self.report.forecast.ends_early()
            if early:
                self.report.notes.append(early)
                if run.is_main:
                    logger.warning("stepsync: %s", early)
        self._last_drift = 0
        if record is not None:
            self._continue(record)
        self._check(state, "train_begin")

    def _saved_record(self, state, trainer):
        """(the record of the checkpoint this run resumed from or None, a problem reading it or "")."""
        if state.global_step <= 0:
            return None, ""
        try:
            raw = checkpoint.record_in_trainer_state(getattr(state, "stateful_callbacks", None) or {})
            if raw is not None:
                record = ResumeRecord.from_dict(raw)
            else:
                folder = engine_adapter.resume_checkpoint(trainer)
                record = checkpoint.load_record(folder) if folder else None
        except ValueError as exc:
            return None, f"stepsync's record in the checkpoint is unreadable ({exc})"
        if record is not None and state.global_step not in (record.trainer_steps, record.resume_steps):
            return None, (f"stepsync's record is for global_step {record.trainer_steps}, the resumed run is at "
                          f"{state.global_step}")
        return record, ""

    def _continue(self, record: ResumeRecord) -> None:
        """Carry the saved run's report on: its events open this one's."""
        report = self.report
        report.resumed_from = record
        report.events = list(record.events)
        report.corrections = record.corrections
        report.dropped_micro_batches = dict(record.dropped_micro_batches)
        self._last_drift = record.drift
        text = (f"resumed from a checkpoint saved at Trainer/engine {record.trainer_steps}/{record.engine_steps} "
                f"under policy '{record.policy}'; the report continues it")
        self._run.note(text + (f" (drift {record.drift:+d} carried over)" if record.drift else ""))
        if record.unapplied_at_save:
            self._run.note(f"the checkpoint was saved with {record.unapplied_at_save} micro-batch(es) in DeepSpeed's "
                           "open window; DeepSpeed saves neither their gradients nor its micro-step counter, so they "
                           "are lost and the engine's windows restart here")

    def _record(self) -> Optional[ResumeRecord]:
        run = self._run
        if run is None:
            return None
        epoch, skip = run.next_position()
        return ResumeRecord(
            policy=self.report.policy.value,
            trainer_steps=self.report.trainer_steps,
            engine_steps=run.engine_steps_seen,
            resume_steps=resume_steps_for(epoch, skip, run.n, run.g, run.behaviour) if run.n else None,
            next_epoch=epoch,
            next_skip=skip,
            unapplied_at_save=run.since_engine_update,
            events=list(self.report.events),
            corrections=self.report.corrections,
            dropped_micro_batches=dict(self.report.dropped_micro_batches),
        )

    def _after_micro_batch(self, args, state, control, trainer_updated: bool) -> None:
        try:
            run = self._run
            run.position += 1
            run.micro_batches += 1
            engine_steps = run.engine.global_steps
            engine_updated = engine_steps != run.engine_steps_seen
            run.since_engine_update = 0 if engine_updated else run.since_engine_update + 1
            run.engine_steps_seen = engine_steps
            action = self._action
            if action.acts_per_micro_batch:  # warn and raise skip two calls on every micro-batch
                action.after_micro_batch(run, trainer_updated, engine_updated, args, state, control)
            if trainer_updated:
                self._check(state, "step_end")
            if self._action.acts_per_micro_batch:  # a fallback may have replaced the action
                self._action.before_micro_batch(run)
        except (StepDriftError, StepSyncConfigError):
            raise
        except Exception as exc:
            self._failed("on_step_end" if trainer_updated else "on_substep_end", exc)

    def _check(self, state, where: str) -> None:
        run, report = self._run, self.report
        report.trainer_steps = trainer_steps = state.global_step
        report.engine_steps = run.engine_steps_seen
        drift = trainer_steps - run.engine_steps_seen
        if drift == self._last_drift:
            return
        event = DriftEvent(
            epoch=max(run.epoch, 0) + 1,
            micro_batch=run.position if where != "train_begin" else 0,
            trainer_steps=state.global_step,
            engine_steps=run.engine_steps_seen,
            previous_drift=self._last_drift,
            cause=self._cause(where, drift),
            remedy=self._inherited_remedy(state) if where == "train_begin" else run.behaviour.remedy,
            where=where,
        )
        self._last_drift = drift
        self.report.events.append(event)
        if run.is_main:
            logger.warning("stepsync: %s", event.message())
            self._show("drift_panel", event, logging.WARNING)
        self._action.on_drift(event)

    @staticmethod
    def _inherited_remedy(state) -> str:
        return REUSED_ENGINE_REMEDY if state.global_step == 0 else INHERITED_REMEDY

    def _cause(self, where: str, drift: int) -> Cause:
        run = self._run
        if where == "train_begin":
            return Cause.INHERITED
        if drift < self._last_drift:
            return Cause.ENGINE_AHEAD
        if run.n is not None and run.position == run.n:
            return Cause.TINY_EPOCH if run.n <= run.g else Cause.PARTIAL_WINDOW
        return Cause.UNEXPLAINED

    def _compare_with_forecast(self, state) -> None:
        predicted: Optional[Forecast] = self.report.forecast
        if predicted is None:
            return
        epoch = self._run.epoch + 1
        row = next((r for r in predicted.epochs if r.epoch == epoch), None)
        seen = (state.global_step, self._run.engine_steps_seen)
        if row is None or (row.trainer_steps, row.engine_steps) != seen:
            expected = "no such epoch" if row is None else f"{row.trainer_steps}/{row.engine_steps}"
            text = (f"epoch {epoch}: counts Trainer/engine {seen[0]}/{seen[1]} differ from the forecast {expected}")
            self.report.forecast_mismatches.append(text)
            if len(self.report.forecast_mismatches) == 1 and self._run.is_main:
                logger.warning("stepsync: %s; please report this stack", text)

    def _read_counts(self, state) -> None:
        self.report.trainer_steps = state.global_step
        self.report.engine_steps = self._run.engine.global_steps

    def _metrics(self, state) -> dict:
        # The count after the last micro-batch: the final log record comes after load_best_model_at_end
        # has taken the engine back to the best checkpoint's count.
        engine_steps = self._run.engine_steps_seen
        return {METRIC_KEYS[0]: state.global_step, METRIC_KEYS[1]: engine_steps,
                METRIC_KEYS[2]: state.global_step - engine_steps}

    def _run_before_reporters(self, trainer) -> None:
        """Move this callback just after the Trainer's flow callback.

        The reporting callbacks (TensorBoard, W&B, ...) get ``on_log`` before user callbacks; running
        before them lets every record carry the stepsync metrics. A new list leaves the loop that is
        calling us untouched.
        """
        handler = getattr(trainer, "callback_handler", None)
        if handler is None:
            return
        others = [cb for cb in handler.callbacks if cb is not self]
        flow = [i for i, cb in enumerate(others) if type(cb).__name__ == "DefaultFlowCallback"]
        at = flow[0] + 1 if flow else 0
        handler.callbacks = others[:at] + [self] + others[at:]

    def _follow(self, leader: "StepSyncCallback", state) -> None:
        """Another instance acts for this Trainer: stay silent, and share its report."""
        self._leader = leader
        if state.is_world_process_zero:
            level = logging.WARNING if self.policy is not leader.policy else logging.INFO
            logger.log(level, "stepsync: this Trainer has two StepSyncCallbacks; the one with policy '%s' acts and "
                       "this one (policy '%s') stays silent; both give the same report", leader.policy.value,
                       self.policy.value)

    def _deactivate(self, reason: str, level: int, state) -> None:
        self.report.active = False
        self.report.inactive_reason = reason
        if state.is_world_process_zero:
            logger.log(level, "stepsync: %s", reason)

    def _failed(self, hook: str, exc: Exception) -> None:
        """A failure inside stepsync: switch off (training goes on), or re-raise under policy 'raise'."""
        self._switch_off(f"internal error in {hook}: {exc!r}")
        if self.policy is Policy.RAISE:
            raise exc

    def _switch_off(self, reason: str) -> None:
        run, self._run = self._run, None
        self.report.active = False
        self.report.inactive_reason = reason
        outcome = "policy 'raise' stops the run" if self.policy is Policy.RAISE else "training goes on"
        logger.error("stepsync switched itself off for this run; %s. %s", outcome, reason, exc_info=True)
        if run is None:
            return
        planned = self.report.planned_steps
        if run.state is not None and planned is not None and run.state.max_steps < planned:
            run.state.max_steps = planned  # a lowered plan would now end the run early
        try:
            self._action.end(run)
        except Exception:  # the engine is already broken; nothing more to restore
            logger.debug("stepsync: could not restore the engine", exc_info=True)

    def _show(self, view: str, data: Any, level: int) -> None:
        """Draw ``view`` on the console, unless the logger already said the same there (once per destination)."""
        if self._console_choice is False:
            return
        from . import render

        console = self._console_choice
        if console is None:
            from rich.console import Console

            console = self._console_choice = Console(stderr=True)
        if logging_reaches(console.file, logger, level):
            return
        console.print(getattr(render, view)(data))
