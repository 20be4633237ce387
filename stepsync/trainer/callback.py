"""``StepSyncCallback``: translates the Trainer's events into calls of one :class:`~stepsync.engine.run.Run`
and applies what the run decides to the Trainer's state and control."""
from __future__ import annotations

import logging
from typing import Any, Optional, Union

from transformers import TrainerCallback

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError, StepSyncError
from ..core.frameworks import TRAINER
from ..core.record import CALLBACK_NAME
from ..core.report import SyncReport
from ..core.tokens import Normalisation
from ..core.tracking import finding_metrics
from ..core.versions import EngineBoundary, without_an_engine
from ..display.output import logger
from ..engine.deepspeed import op_builds_of, starts_on_a_cpu
from ..engine.faults import guarded
from ..engine.lifecycle import close_run
from ..engine.optimizer import count_optimizer_steps
from ..engine.resume import record_of
from ..engine.run import Run
from ..engine.watch import FrameworkWatch
from . import trainer as trainer_facts
from .losses import UnappliedLosses
from .start import StartVerdict, how_the_ranks_started, start_run

try:  # transformers >= 4.41 saves an ExportableState callback's state() in trainer_state.json
    from transformers.trainer_callback import ExportableState
    _CALLBACK_BASES: tuple = (TrainerCallback, ExportableState)
except ImportError:  # older releases: stepsync writes its own file into the checkpoint
    _CALLBACK_BASES = (TrainerCallback,)
STORED_BY_TRAINER = len(_CALLBACK_BASES) == 2

def _micro_batch_hook(name: str, trainer_updated: bool):
    """The hook of every micro-batch (``on_substep_end``, or ``on_step_end`` where the Trainer counted an update).

    It guards itself: guarded()'s extra call and ``**kwargs`` pass cost microseconds on every micro-batch.
    """

    def hook(self: StepSyncCallback, args, state, control, **kwargs):
        run = self._run
        if run is None:
            return None
        try:
            # The Trainer's count matters only where it counted an update; elsewhere it is not even read.
            steering = run.after_micro_batch(trainer_updated, state.global_step if trainer_updated else 0)
        except StepSyncError:
            raise
        except Exception as exc:
            return self._failed(name, exc, True)
        if steering is not None:
            trainer_facts.steer(self._trainer, steering, args, state, control, at_step_end=True)
        if trainer_updated and self._losses is not None and control.should_training_stop:
            self._take_out_the_unapplied_losses(args)
        return None

    hook.__name__ = hook.__qualname__ = name
    return hook


class StepSyncCallback(*_CALLBACK_BASES, FrameworkWatch):  # type: ignore[misc]  # the bases depend on the release
    """Keeps ``state.global_step`` and the DeepSpeed engine's ``global_steps`` in agreement.

    Before training it forecasts both counts per epoch; at every step end and epoch end it
    compares them, logs each change of the drift (logger ``stepsync``, rich output where the Trainer's
    logs go), adds ``stepsync/*`` metrics to every log record, and applies ``policy``. A run without DeepSpeed
    (DDP, FSDP, one device) gets the forecast, the record in every checkpoint and the resume check, its count held
    against its optimizer's steps; DeepSpeed's own checks need its engine.

    Args:
        policy: ``"warn"`` (default; report only), ``"raise"`` (stop at the first divergence),
            ``"sync"`` (DeepSpeed's boundary follows the Trainer's), ``"realign"`` (the Trainer's count
            follows the engine's) or ``"drop_last"`` (train only full accumulation windows); a
            :class:`stepsync.Policy` member works too.
        console: a ``rich.console.Console`` for tables and panels, ``None`` for one on stderr, or ``False``
            for none (the logger still speaks).
        loss_normalisation: how each window's loss is meant to weigh its trained tokens: ``"token_mean"``
            (default: every trained token of a window weighs the same), or a rule that is deliberate:
            ``"micro_batch_mean"`` or ``"sequence_mean"`` (DPO and other per-sequence losses). At the first window
            whose micro-batches hold different numbers of trained tokens, stepsync reads each token's weight at the
            logits of a model with output embeddings and holds the run to this rule.

    Raises:
        ValueError: for an unknown policy or a console that is not a rich Console.
        StepDriftError: with ``policy="raise"``, at the first divergence, on every rank.

    A failure inside stepsync itself is logged once with its traceback; training goes on as every other rank
    runs it, except under ``policy="raise"``, where the failure is re-raised.

    Example::

        from stepsync import StepSyncCallback
        trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed=ds_config,
                          gradient_accumulation_steps=2), train_dataset=data,
                          callbacks=[StepSyncCallback(policy="sync")])
        trainer.train()
        print(trainer.callback_handler.callbacks[-1].report.drift)
    """

    framework = TRAINER

    def __new__(cls, *args, **kwargs):
        # With restore_callback_states_from_checkpoint=True the Trainer rebuilds every stateful callback from
        # the checkpoint (`type(callback)(**saved_args)`) and drops the user's instance. Hand it the user's
        # instance instead, so that the object the user holds keeps the report.
        restoring = trainer_facts.callback_being_restored(cls)
        if restoring is not None:
            restoring._restored_with = kwargs
            return restoring
        return super().__new__(cls)

    def __init__(self, policy: Union[str, Policy] = Policy.WARN, console: Any = None,
                 loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> None:
        if self.__dict__.pop("_restored_with", None) is not None:
            return  # the Trainer is restoring this very instance: keep the user's choices
        self._leader: Optional[StepSyncCallback] = None
        self._watch(policy, console, loss_normalisation)
        self._state: Any = None
        self._trainer: Any = None
        self._losses: Optional[UnappliedLosses] = None  # realign's: the losses of micro-batches not yet applied

    @property
    def report(self) -> SyncReport:
        """What stepsync saw in the last run (:class:`stepsync.SyncReport`); the acting instance's report when
        another ``StepSyncCallback`` of the same Trainer acts."""
        return self._leader.report if self._leader is not None else self._report

    @report.setter
    def report(self, report: SyncReport) -> None:
        self._report = report

    # ----------------------------------------------------------------- hooks

    @guarded(steering=True, needs_run=False)
    def on_init_end(self, args, state, control, **kwargs):
        trainer = trainer_facts.find_trainer(self)
        if trainer is not None:  # before the progress bar and the reporters read the plan at on_train_begin
            trainer_facts.run_after_the_flow_callback(trainer, self)
        config = trainer_facts.deepspeed_config(args)
        builds = op_builds_of(config, config is not None and starts_on_a_cpu())
        if builds and trainer_facts.speaks(args, state):  # said before train() builds the engine
            for build in builds:
                logger.warning("%s", build)

    @guarded(steering=True, needs_run=False)
    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self._run, self._leader, self._state = None, None, state
        self._idle()
        trainer_facts.keep_a_place_in(state, CALLBACK_NAME, self.state)
        trainer = self._trainer = trainer_facts.find_trainer(self)
        if trainer is None:
            return self._deactivate("could not find the Trainer that runs this callback", logging.WARNING, args, state)
        leader = trainer_facts.elect(trainer, StepSyncCallback)
        if leader is not self:
            return self._follow(leader, args, state)
        deepspeed = trainer_facts.uses_deepspeed(trainer, args)
        if deepspeed:
            engine = trainer_facts.find_engine(trainer)
            missing = ("DeepSpeed is configured but no engine with global_steps was found (trainer.model_wrapped); "
                       "stepsync cannot check this run")
        else:  # DDP, FSDP, one device: the updates are the optimizer's steps
            engine = count_optimizer_steps(getattr(trainer, "optimizer", None), state.global_step,
                                           getattr(trainer, "model", None), trainer_facts.window_ends(trainer))
            missing = "the Trainer has no torch optimizer (trainer.optimizer) whose steps stepsync can count"
        if engine is None:
            return self._deactivate(missing, logging.WARNING, args, state)
        behaviour = self._installed(trainer_facts.speaks(args, state))
        if behaviour is None:
            if not deepspeed:
                engine.stop_counting()
            return None
        if not deepspeed:
            behaviour = without_an_engine(behaviour)
        before = (state.global_step, state.max_steps)
        reporting = trainer_facts.ReportingCallbacks(trainer)
        self._tracking.trackers[:] = [reporting] if reporting.callbacks else []
        failure = None
        try:
            start_run(trainer, args, state, engine, train_dataloader, behaviour, self.policy, self.output,
                      trainer_facts.speaks(args, state), keep=self._keep, loss_normalisation=self.loss_normalisation)
        except StepSyncError:
            raise
        except Exception as exc:
            failure = exc
        self._agree_on_the_start(args, state, before, failure)
        trainer_facts.run_after_the_flow_callback(trainer, self)
        run = self._run
        if run is not None and run.policy.follows_the_engine and run.facts.deepspeed and \
                run.behaviour.engine_boundary is EngineBoundary.MICRO_COUNTER:
            self._losses = UnappliedLosses(trainer, engine)

    def _take_out_the_unapplied_losses(self, args) -> None:
        """The run's last step: the losses of the micro-batches the engine never applied leave the Trainer's loss
        sum, so that its train_loss is the mean over the updates the engine applied."""
        try:
            self._losses.take_out(self._trainer, getattr(args, "device", "cpu"))  # type: ignore[union-attr]
        except Exception as exc:  # the train_loss stays the Trainer's own; training is unchanged
            self._failed("the realign loss", exc, False)

    def _agree_on_the_start(self, args, state, before: tuple, failure: Optional[Exception]) -> None:
        """Every rank steers this run the same way, or none does (see :func:`how_the_ranks_started`)."""
        verdict, reason = how_the_ranks_started(args, state, before, failure is not None)
        if verdict is StartVerdict.TOGETHER:
            return
        if failure is not None and verdict is StartVerdict.FAILED:
            reason = f"internal error in on_train_begin: {failure!r}"
        if verdict is StartVerdict.RESUMED_APART:
            self._switch_off(reason)
            raise StepSyncConfigError(f"{reason}; stepsync stops every rank before the first micro-batch")
        if self.policy.stops:
            if failure is not None:
                self._switch_off(reason, exc_info=failure)
                raise failure
            raise StepSyncConfigError(f"{reason}; policy '{self.policy.value}' stops every rank before the first "
                                      "micro-batch")
        # Every rank takes the Trainer's own start back: none of them steers.
        trainer_facts.set_global_step(self._trainer, state, before[0])
        state.max_steps = before[1]
        self._switch_off(f"{reason}; no rank steers this run", exc_info=failure)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._epoch_begins()

    @guarded(steering=True)
    def _epoch_begins(self, run: Run) -> None:
        run.begin_epoch()

    on_substep_end = _micro_batch_hook("on_substep_end", trainer_updated=False)
    on_step_end = _micro_batch_hook("on_step_end", trainer_updated=True)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._epoch_ends(args, state, control)

    @guarded(steering=True)
    def _epoch_ends(self, run: Run, args, state, control) -> None:
        steering = run.end_epoch(state.global_step)
        if steering is not None:
            trainer_facts.steer(self._trainer, steering, args, state, control, at_step_end=False)
        if self._losses is not None and (control.should_training_stop or state.epoch >= args.num_train_epochs):
            self._take_out_the_unapplied_losses(args)

    def on_log(self, args, state, control, logs=None, **kwargs):
        run = self._run
        if run is None or logs is None or not run.observing:
            return None
        try:  # guarded here, not by guarded(): one call less
            trainer_facts.add_metrics(state, logs, run.engine_steps_seen, finding_metrics(run.report))
            self._tracking.catch_up()
        except Exception as exc:
            return self._failed("on_log", exc, False)
        return None

    def on_save(self, args, state, control, **kwargs):
        self._saved(args, state)

    @guarded(steering=False)
    def _saved(self, run: Run, args, state) -> None:
        if getattr(args, "should_save", state.is_world_process_zero):
            trainer_facts.save_the_record(run, args, state, STORED_BY_TRAINER, self.policy.stops)
        run.saved_checkpoint()

    def state(self) -> dict:
        """``ExportableState`` (transformers >= 4.41): the record the Trainer saves in ``trainer_state.json``."""
        run = (self._leader or self)._run
        try:
            record = record_of(run).to_dict() if run is not None else None
        except Exception:  # never break the Trainer's save
            logger.debug("could not build the resume record", exc_info=True)
            record = None
        return {"args": {"policy": self.policy.value, "loss_normalisation": self.loss_normalisation.value},
                "attributes": {"saved_record": record}}

    @guarded(steering=True, needs_run=False)
    def on_train_end(self, args, state, control, **kwargs):
        if self._losses is not None:
            self._losses.remove()
            self._losses = None
        if self._leader is None:  # with load_best_model_at_end the Trainer has loaded the best checkpoint already
            close_run(self._report, self._run, state.global_step, getattr(state, "best_model_checkpoint", None))

    def _follow(self, leader: StepSyncCallback, args, state) -> None:
        """Another instance acts for this Trainer: stay silent, and share its report."""
        self._leader = leader
        if trainer_facts.speaks(args, state):
            level = logging.WARNING if self.policy is not leader.policy else logging.INFO
            logger.log(level, "this Trainer has two StepSyncCallbacks; the one with policy '%s' acts and this one "
                       "(policy '%s') stays silent; both give the same report", leader.policy.value,
                       self.policy.value)

    def _deactivate(self, reason: str, level: int, args, state) -> None:
        self._idle(reason, level, trainer_facts.speaks(args, state))

    def _undo_steering(self) -> None:
        planned = self.report.planned_steps
        if planned is not None and self._state.max_steps < planned:
            self._state.max_steps = planned  # a lowered plan would now end the run early
