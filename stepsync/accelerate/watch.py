"""``stepsync.watch``: the same check and fix for a custom ``accelerate`` training loop on DeepSpeed.

A loop shaped like transformers' ``run_*_no_trainer.py`` counts an update when ``accelerator.sync_gradients``
is true inside ``accelerator.accumulate()``: every G-th micro-batch and at the end of the dataloader. Before
accelerate 1.8 the DeepSpeed engine decides its updates with its own micro-step counter, which never
restarts at an epoch, so the two counts drift exactly as the Trainer's do.

The watch wraps the accelerator instance's ``backward`` (and ``accumulate``, to see whether a backward runs
inside it): before each backward it reads accelerate's own ``sync_gradients``, after it the engine's count.
Nothing else is touched; under ``warn`` the run is exactly what it would be without it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Optional, Union

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.events import Cause
from ..core.forecast import forecast
from ..core.plan import RunPlan
from ..core.report import SyncReport
from ..core.versions import EngineBoundary, PlannedSteps, Stack, TrainerRule, behaviour_of
from ..display.output import ConsoleOutput, logger
from ..engine.deepspeed import BoundaryOverride, is_engine
from ..engine.loop_objects import InstancePatches, length_of
from ..engine.policies import watching_action
from ..engine.run import Run

METRIC_KEYS = ("stepsync/loop_steps", "stepsync/engine_steps", "stepsync/drift")
REFUSED = {
    Policy.REALIGN: "policy 'realign' cannot change your loop's own counter: keep policy 'warn' and adopt "
                    "watch.report.engine_steps, or use policy='sync'",
    Policy.DROP_LAST: "policy 'drop_last' cannot end your dataloader's epochs early: use policy='sync', or drop "
                      "the partial window in your loop",
}
OUTSIDE_ACCUMULATE = ("accelerator.backward() ran outside `with accelerator.accumulate(model):` with "
                      "gradient_accumulation_steps={g}: there sync_gradients stays True, so {effect}; put the "
                      "forward, backward and optimizer step inside `with accelerator.accumulate(model):`")
OUTSIDE_EFFECT = {
    True: "the engine updates on every micro-batch, not every G-th",
    False: "your loop counts every micro-batch as an update while the engine updates every G-th",
}


class LoopWatch:
    """Watches one custom accelerate loop; made by :func:`watch`. Use it as a context manager, or call
    :meth:`close` after the loop: that gives ``backward`` and the engine's boundary back and ends the report.

    Attributes:
        report: the same :class:`stepsync.SyncReport` the callback keeps; ``trainer_steps`` is the count your
            loop sees (updates where ``accelerator.sync_gradients`` was true).
        loop_steps: that count, live.
    """

    def __init__(self, accelerator: Any, policy: Policy, dataloader: Any, num_epochs: Optional[float],
                 console: Any) -> None:
        self.accelerator = accelerator
        self.policy = policy
        self.output = ConsoleOutput(console)
        self.report = SyncReport(policy, counter="your loop")
        self._override: Optional[BoundaryOverride] = None
        self._inside_accumulate = 0
        self._epoch_open = False
        self._said_outside = False
        self._patches = InstancePatches()
        self.loop_steps = 0
        self.run: Optional[Run] = None
        self._start(dataloader, num_epochs)

    # ------------------------------------------------------------ setup

    def _start(self, dataloader: Any, num_epochs: Optional[float]) -> None:
        accelerator = self.accelerator
        state = getattr(accelerator, "state", None)
        if "DEEPSPEED" not in str(getattr(accelerator, "distributed_type", "")):
            self.report.inactive_reason = "the accelerator does not use DeepSpeed: nothing to check"
            logger.info("%s", self.report.inactive_reason)
            return
        engine: Any = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
        if not is_engine(engine):
            raise StepSyncConfigError("stepsync.watch() found no DeepSpeed engine on the accelerator: call it after "
                                      "accelerator.prepare(model, optimizer, dataloader, ...)")
        g = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
        n = length_of(dataloader)
        # accelerate's accumulate() is the epoch-end rule: a window every G micro-batches, restarted at the
        # dataloader's end; the no_trainer examples plan epochs * ceil(N / G) updates.
        behaviour = dataclasses.replace(behaviour_of(Stack.installed()), trainer_rule=TrainerRule.EPOCH_END,
                                        planned_steps=PlannedSteps.CEIL)
        is_main = bool(getattr(state, "is_main_process", True))
        # sync steers the engine here from sync_gradients; the run's action only watches (and raises)
        run = self.run = Run(engine, behaviour, n, g, self.report, self.output, counter="loop updates",
                             is_main=is_main, action=watching_action(self.policy))
        self.report.active = True
        run.state_what_differs("the accelerator's")
        if self.policy is Policy.SYNC:
            if behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER:
                run.note("policy 'sync' does nothing here: this accelerate already sets DeepSpeed's boundary from "
                         "sync_gradients (accelerate >= 1.8.0)")
            elif not run.facts.can_override_boundary:
                raise StepSyncConfigError(f"policy 'sync' cannot steer this engine: {run.facts.why_not}; "
                                          "use policy='warn'")
            else:
                self._override = BoundaryOverride(engine)
        if n is not None and num_epochs is not None:
            run.announce(forecast(RunPlan(n, g, num_epochs, -1, 0, engine.global_steps), behaviour, self.policy))
        elif n is None:
            run.note("no dataloader length: pass dataloader=... to stepsync.watch() for a forecast")
        self._wrap(run)

    def _wrap(self, run: Run) -> None:
        accelerator = self.accelerator
        backward, accumulate = accelerator.backward, accelerator.accumulate

        @functools.wraps(backward)
        def watched_backward(loss, **kwargs):
            self._before_backward(run)
            result = backward(loss, **kwargs)
            self._after_backward(run)
            return result

        @contextlib.contextmanager
        def watched_accumulate(*models):
            self._inside_accumulate += 1
            try:
                with accumulate(*models):
                    yield
            finally:
                self._inside_accumulate -= 1

        self._patches.set(accelerator, "backward", watched_backward)
        self._patches.set(accelerator, "accumulate", watched_accumulate)

    # ------------------------------------------------------------ every micro-batch

    def _before_backward(self, run: Run) -> None:
        if not self._epoch_open:
            run.begin_epoch()
            self._epoch_open = True
        self._counts_update = bool(self.accelerator.sync_gradients)
        if not self._inside_accumulate and run.g > 1 and not self._said_outside:
            self._said_outside = True
            effect = OUTSIDE_EFFECT[run.behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER]
            run.warn(OUTSIDE_ACCUMULATE.format(g=run.g, effect=effect))
            run.known_cause = Cause.OUTSIDE_ACCUMULATE
            run.remedy = "put the forward, backward and optimizer step inside `with accelerator.accumulate(model):`"
        if self._override is not None:
            self._override.set(self._counts_update)  # accelerate 1.8's fix: the engine follows sync_gradients

    def _after_backward(self, run: Run) -> None:
        if self._counts_update:
            self.loop_steps += 1
        run.after_micro_batch(self._counts_update, self.loop_steps)
        if self._counts_update:
            self._log_metrics(run)
        if getattr(self.accelerator.gradient_state, "end_of_dataloader", False):
            run.end_epoch(self.loop_steps)
            self._epoch_open = False

    def _log_metrics(self, run: Run) -> None:
        if getattr(self.accelerator, "trackers", None):
            engine_steps = run.engine_steps_seen
            self.accelerator.log({METRIC_KEYS[0]: self.loop_steps, METRIC_KEYS[1]: engine_steps,
                                  METRIC_KEYS[2]: self.loop_steps - engine_steps}, step=self.loop_steps)

    # ------------------------------------------------------------ end

    def close(self) -> SyncReport:
        """Give ``backward``, ``accumulate`` and the engine's boundary back; the report is final."""
        self._patches.restore()
        if self._override is not None:
            self._override.restore()
            self._override = None
        if self.run is not None and not self.report.finished:
            self.report.unapplied_micro_batches = self.run.since_engine_update
            self.report.finished = True
            self.run.summarize()
        return self.report

    def __enter__(self) -> LoopWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def watch(accelerator: Any, policy: Union[str, Policy] = Policy.WARN, dataloader: Any = None,
          num_epochs: Optional[float] = None, console: Any = None) -> LoopWatch:
    """Watch a custom accelerate training loop on DeepSpeed; call it after ``accelerator.prepare(...)``.

    Args:
        accelerator: the ``accelerate.Accelerator`` of the loop.
        policy: ``"warn"`` (report only), ``"raise"`` (stop at the first divergence) or ``"sync"`` (DeepSpeed's
            boundary follows ``accelerator.sync_gradients``, accelerate 1.8's fix for 1.1-1.7). ``"realign"``
            and ``"drop_last"`` are refused: stepsync cannot change your loop's counter or its dataloader.
        dataloader: the prepared training dataloader, for the forecast (its length).
        num_epochs: the epochs the loop runs, for the forecast.
        console: as for :class:`stepsync.StepSyncCallback`.

    Raises:
        ValueError: an unknown or refused policy, a bad console.
        StepSyncConfigError: no DeepSpeed engine yet (call it after ``prepare``), or ``sync`` on an engine that
            cannot be steered.

    Example::

        model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(...)
        with stepsync.watch(accelerator, policy="sync", dataloader=train_dataloader, num_epochs=3) as sync:
            for epoch in range(3):
                for batch in train_dataloader:
                    with accelerator.accumulate(model):
                        accelerator.backward(model(**batch).loss)
                        optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()
        print(sync.report)
    """
    return LoopWatch(accelerator, Policy.parse(policy, refused=REFUSED), dataloader, num_epochs, console)
