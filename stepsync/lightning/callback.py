"""``StepSyncCallback`` for PyTorch Lightning: translates Lightning's events into calls of one
:class:`~stepsync.engine.run.Run` and applies what it decides to Lightning's loop and DeepSpeed's engine."""
from __future__ import annotations

import logging
from typing import Any, Optional, Union

from lightning.pytorch import Callback

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.frameworks import LIGHTNING
from ..core.lightning_versions import lightning_alone
from ..core.plan import RunPlan
from ..core.record import ResumeRecord
from ..core.relayout import position, replayed_epoch_shift
from ..core.tokens import Normalisation
from ..core.tracking import finding_metrics
from ..core.versions import StackBehaviour
from ..engine.faults import guarded
from ..engine.lifecycle import RunStart, close_run
from ..engine.optimizer import count_optimizer_steps
from ..engine.policies import WatchOnly, action_for, last_whole_window
from ..engine.resume import record_of
from ..engine.run import Run
from ..engine.watch import FrameworkWatch
from . import lightning as lightning_facts


class StepSyncCallback(Callback, FrameworkWatch):
    """Keeps Lightning's ``global_step`` and the DeepSpeed engine's ``global_steps`` in agreement, and says what each
    update really trained.

    With ``strategy="deepspeed_stage_N"`` and ``accumulate_grad_batches=G``, Lightning counts an update every G
    micro-batches of an epoch and never at its partial last window, while DeepSpeed updates on its own counter,
    whose windows cross epoch ends; each micro-batch weighs 1/G**2 (the loss is divided twice), and on ZeRO 0, 1
    and 3 Lightning's zero_grad clears gradients the engine still accumulates. Before training it forecasts all
    of it; at every batch end and epoch end it compares both counts, logs each change of the drift, adds
    ``stepsync/*`` metrics through Lightning's ``log``, and applies ``policy``.

    Args:
        policy: ``"warn"`` (default; report only), ``"raise"`` (stop at the first divergence, on every rank),
            ``"sync"`` (the engine updates exactly where Lightning counts, each micro-batch at 1/G, an epoch's
            leftover micro-batches not trained) or ``"drop_last"`` (an epoch's leftover micro-batches not
            trained: no compute spent on them). ``"realign"`` is refused: Lightning's count cannot be set.
        console: a ``rich.console.Console``, ``None`` for one on stderr, or ``False`` for none.
        loss_normalisation: the rule each window's loss is meant to follow (default ``"token_mean"``), as for
            :class:`stepsync.StepSyncCallback`.

    Raises:
        ValueError: an unknown or refused policy, or a console that is not a rich Console.
        StepDriftError: with ``policy="raise"``, at the first divergence.
        StepSyncConfigError: ``sync`` or ``drop_last`` on an epoch shorter than one window (every micro-batch
            would be dropped).

    Example::

        from stepsync.lightning import StepSyncCallback
        trainer = pl.Trainer(strategy="deepspeed_stage_2", accumulate_grad_batches=2,
                             callbacks=[StepSyncCallback(policy="sync")])
        trainer.fit(model, train_dataloader)
    """

    framework = LIGHTNING

    def __init__(self, policy: Union[str, Policy] = Policy.WARN, console: Any = None,
                 loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> None:
        self._watch(policy, console, loss_normalisation)
        self._saved: Optional[dict] = None
        self._trainer: Any = None
        self._batches = 0  # micro-batches per epoch that Lightning runs (whole windows under sync and drop_last)
        self._dropped = 0
        self._train_batch_size: Optional[int] = None
        self._last_count = 0
        self._start: Optional[tuple] = None  # what the run is built from at the first batch
        self._epoch_open = False
        # without DeepSpeed no engine's forward hook says that the training forward returned: this callback does
        self._tells_forwards = False

    # ----------------------------------------------------------------- state kept in Lightning's checkpoints

    def state_dict(self) -> dict:
        run = self._run
        return {"saved_record": record_of(run).to_dict() if run is not None else None}

    def load_state_dict(self, state_dict: dict) -> None:
        self._saved = state_dict.get("saved_record")

    # ----------------------------------------------------------------- hooks

    @guarded(steering=True, needs_run=False)
    def on_train_start(self, trainer, pl_module) -> None:
        self._run, self._start, self._trainer = None, None, trainer
        self._idle()
        engine = lightning_facts.deepspeed_engine(trainer)
        counter = None  # without DeepSpeed (Lightning's own accumulation) the updates are its optimizer's steps
        if engine is None:
            counter = engine = count_optimizer_steps(next(iter(trainer.optimizers), None), trainer.global_step,
                                                     pl_module, lightning_facts.window_ends(trainer))
            if counter is None:
                self._idle("nothing to watch: the Lightning Trainer has neither DeepSpeed nor a torch optimizer whose "
                           "steps stepsync can count", logging.WARNING, trainer.is_global_zero)
                return
        behaviour = self._installed(trainer.is_global_zero)
        if behaviour is None:
            if counter is not None:
                counter.stop_counting()
            return
        alone = self._tells_forwards = counter is not None
        if alone:
            behaviour = lightning_alone(behaviour)
        n, g = lightning_facts.batches_per_epoch(trainer), int(trainer.accumulate_grad_batches)
        if self.policy.steers_the_boundary and n is None and not alone:
            raise StepSyncConfigError("policy 'sync' needs the train dataloader's length to know where Lightning "
                                      "counts its updates: give the dataloader a length, or use policy='warn'")
        self._batches = self._whole_windows(n, g, behaviour)
        if self._dropped:
            lightning_facts.end_epochs_after(trainer, self._batches)
        # The run starts at the first batch: only then is it sure where a resumed fit stands in its epoch.
        self._start = (engine, behaviour, n, g)

    @guarded(steering=True, needs_run=False)
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._start is not None:
            self._begin(trainer, batch_idx, *self._start)
        if not self._epoch_open and self._run is not None:
            self._run.begin_epoch()
            self._epoch_open = True

    def _begin(self, trainer, batch_idx: int, engine, behaviour, n: Optional[int], g: int) -> None:
        self._start = None
        epoch = trainer.current_epoch
        plan = None if n is None else RunPlan(
            n, g, trainer.max_epochs if trainer.max_epochs is not None else -1, trainer.max_steps,
            trainer.global_step, engine.global_steps, zero_stage=lightning_facts.zero_stage(trainer.strategy),
            start=(epoch, batch_idx))
        # drop_last ends Lightning's epochs itself (before they start): the run's action only watches
        action = WatchOnly(self.policy) if self.policy.ends_epochs_early else action_for(self.policy)
        self._last_count = trainer.global_step
        record = None if self._saved is None else ResumeRecord.from_dict(self._saved)
        layout = lightning_facts.data_layout(trainer, g)
        shift = None
        if record is not None and record.layout is not None and layout is not None and n is not None \
                and not lightning_facts.keeps_its_place(trainer):
            stood = position(record.layout, record.next_epoch, record.next_skip)
            shift = replayed_epoch_shift(record.layout, layout, stood, epoch, batch_idx, self._batches or n,
                                         trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None)
        self._tracking.trackers[:] = [lightning_facts.LightningLoggers(trainer)]
        self._tracking.sends_last_metrics = True
        self._open(RunStart(LIGHTNING, self.policy, engine, behaviour, self._batches or n, g, self.output,
                            is_main=trainer.is_global_zero, trainer_steps=trainer.global_step,
                            plan=plan, start_epoch=epoch, skip=batch_idx, action=action,
                            record=record, layout=layout, shift=None if shift is None or shift.exact else shift,
                            asked_clip=lightning_facts.asked_clip(trainer), clip_fix=lightning_facts.CLIP_FIX,
                            loss_normalisation=self.loss_normalisation))

    def _keep(self, run: Run) -> None:
        super()._keep(run)
        self._epoch_open = False
        if self.policy.steers_the_boundary and run.facts.can_override_boundary:
            self._train_batch_size = lightning_facts.scale_the_loss_once(run.engine)

    def _whole_windows(self, n: Optional[int], g: int, behaviour: StackBehaviour) -> int:
        """Micro-batches per epoch this policy trains: the whole windows where it ends epochs early (sync with
        DeepSpeed, drop_last), else 0 (all)."""
        if n is None or not behaviour.ends_epochs_under(self.policy):
            return 0
        whole = last_whole_window(self.policy, n, g, LIGHTNING.g_setting)
        self._dropped = n - whole
        return whole

    @guarded(steering=True, needs_run=False)
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._dropped:  # a dataloader reloaded for this epoch reset Lightning's epoch length
            lightning_facts.end_epochs_after(trainer, self._batches)
        self._epoch_open = False

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._tells_forwards:
            self._forward_returned(loss)

    @guarded(steering=False)
    def _forward_returned(self, run: Run, loss) -> None:
        tokens = run.token_weights
        if tokens is not None and tokens.reading:
            tokens.forward_returned(loss)
        else:
            self._tells_forwards = False  # nothing reads it now: the hook costs one test from here

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._batch_ends(trainer, pl_module)

    @guarded(steering=True)
    def _batch_ends(self, run: Run, trainer, pl_module) -> None:
        count = trainer.global_step
        updated = count != self._last_count
        self._last_count = count
        run.after_micro_batch(updated, count)  # no steering reaches Lightning's loop: it is set before the epoch
        if updated and run.observing:
            self._observe("on_train_batch_end", lightning_facts.add_metrics, pl_module, count, run.engine_steps_seen,
                          finding_metrics(run.report))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._epoch_ends(trainer)

    @guarded(steering=True)
    def _epoch_ends(self, run: Run, trainer) -> None:
        if self._dropped and run.position >= self._batches:
            run.drop(run.epoch + 1, self._dropped)
        run.end_epoch(trainer.global_step)

    @guarded(steering=True, needs_run=False)
    def on_train_end(self, trainer, pl_module) -> None:
        run = self._run
        self._undo_steering()
        steps = lightning_facts.scheduler_steps(trainer)
        applied = None if run is None else trainer.global_step - run.updates.skipped_seen
        if run is not None and run.observing and steps is not None and steps != applied:
            run.voice.note(f"Lightning stepped the LR scheduler {steps} times for its {trainer.global_step} updates"
                           + (f", of which the engine applied {applied}" if run.updates.skipped_seen else ""))
        close_run(self.report, run, trainer.global_step)

    # ----------------------------------------------------------------- logic

    def _undo_steering(self) -> None:
        size, self._train_batch_size = self._train_batch_size, None
        engine = lightning_facts.deepspeed_engine(self._trainer) if size is not None else None
        if engine is not None:
            engine.set_train_batch_size(size)  # DeepSpeed divides the loss by G again
