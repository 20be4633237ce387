"""``stepsync.lightning.watch``: the check, and the fix where it can be exact, for a Fabric loop on DeepSpeed (and,
without it, the checks that need none: each token's weight against the optimizer's steps).

Fabric's documented accumulation loop calls ``fabric.backward(loss)`` on every micro-batch inside
``fabric.no_backward_sync(model, enabled=...)`` and ``optimizer.step()`` at the end of each window. Under
DeepSpeed the wrapped optimizer steps DeepSpeed's optimizer directly and never calls ``engine.step()``: the
engine's ``global_steps`` stays 0, its LR scheduler never steps and its checkpoints are all tagged
``global_step0``; ``no_backward_sync`` does nothing; on ZeRO 1 and 2 every ``backward`` closes a window of the
engine's (its ``gradient_accumulation_steps`` is 1), so only the last micro-batch of each loop window reaches the
update; and with ``gradient_accumulation_steps=G`` in the DeepSpeed config, ZeRO 1 and 2 raise ``KeyError: 0``
at the first ``optimizer.step()``.

The watch wraps the Fabric instance's ``backward`` and ``no_backward_sync`` and the optimizer's ``step``; under
``sync`` it makes the engine do the update the loop asks for: the engine's boundary is set from the loop's own
``no_backward_sync(enabled=...)`` before each backward, and ``optimizer.step()`` becomes ``engine.step()``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Optional, Tuple, Union

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.events import Cause
from ..core.frameworks import FABRIC_LOOP
from ..core.lightning_versions import FabricZero12, fabric_zero12
from ..core.tokens import Normalisation
from ..core.versions import StackBehaviour, without_an_engine
from ..engine.faults import guarded
from ..engine.lifecycle import RunStart
from ..engine.loop_objects import length_of
from ..engine.optimizer import OptimizerSteps, count_optimizer_steps
from ..engine.policies import loop_action_for
from ..engine.run import Run
from ..engine.watch import UserLoopWatch
from . import lightning as lightning_facts

NEVER_STEPPED = ("Fabric's optimizer.step() steps DeepSpeed's optimizer directly and never calls engine.step(): the "
                 "engine's global_steps stays at {engine} while your loop made {loop} update(s), its LR scheduler "
                 "never steps and its checkpoints are all tagged global_step{engine}; use policy='sync', or call "
                 "the engine's step() yourself")
LOSES_GRADIENTS = ("on ZeRO-{stage} with gradient_accumulation_steps=1 in the DeepSpeed config every backward closes "
                   "a window of the engine's, so only the last micro-batch of each of your loop's windows reaches "
                   "its update (no_backward_sync does nothing under DeepSpeed); use policy='sync'")
FAILS = ("with gradient_accumulation_steps={gas} in the DeepSpeed config, ZeRO-{stage}'s optimizer fails at the first "
         "optimizer.step() under Fabric on DeepSpeed {deepspeed} (KeyError: 0 with G > 1); set "
         "gradient_accumulation_steps to 1 in the config and accumulate in your loop (use policy='sync')")


class FabricWatch(UserLoopWatch):
    """Watches one Fabric loop on DeepSpeed; made by :func:`watch`. A context manager, or call :meth:`close`.

    A failure inside stepsync never reaches your loop (it is logged once, and a failure of its steering gives
    DeepSpeed and ``optimizer.step()`` their own behaviour back), except under ``policy="raise"``."""

    framework = FABRIC_LOOP

    def __init__(self, fabric: Any, model: Any, optimizer: Any, policy: Union[str, Policy], dataloader: Any,
                 console: Any, loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN):
        self._watch(policy, console, loss_normalisation)
        self.fabric, self.optimizer = fabric, optimizer
        self._ends_window: Optional[bool] = None  # what the loop's last no_backward_sync said of this micro-batch
        self._reported_micro_batch = True  # the last backward's micro-batch is in the run's count
        self._says_windows = False  # the loop has used no_backward_sync: a backward outside it ends a window
        engine = lightning_facts.fabric_engine(fabric, model)
        if engine is None:  # Fabric's own accumulation: the updates are its torch optimizer's steps
            engine = count_optimizer_steps(optimizer, 0, model, self._loop_window_ends)
            if engine is None:
                self._idle("nothing to watch: this Fabric has neither DeepSpeed nor a torch optimizer whose steps "
                           "stepsync can count", logging.WARNING)
                return
        self._start(engine, dataloader)

    def _loop_window_ends(self) -> bool:
        """The loop's own word on the running micro-batch (its no_backward_sync), read at its backward."""
        run = self._run
        return bool(run is not None and run.loop_window_ends)

    def _start(self, engine: Any, dataloader: Any) -> None:
        alone = isinstance(engine, OptimizerSteps)  # Fabric's own accumulation, no engine
        behaviour = self._installed()
        if behaviour is None:
            if alone:
                engine.stop_counting()
            return
        warning = None
        if alone:
            behaviour, gas = without_an_engine(behaviour), 1
        else:
            behaviour, gas, warning = self._on_deepspeed(engine, behaviour)
        # Fabric's loop logs when the user does: the metrics go to its loggers from here
        self._tracking.trackers[:] = [lightning_facts.LightningLoggers(self.fabric)]
        self._tracking.sends_metrics = self._tracking.sends_last_metrics = True
        run = self._open(RunStart(FABRIC_LOOP, self.policy, engine, behaviour, length_of(dataloader), gas,
                                  self.output, is_main=bool(getattr(self.fabric, "is_global_zero", True)),
                                  action=loop_action_for(self.policy), loss_normalisation=self.loss_normalisation))
        if warning:
            run.voice.warn(warning)
        self._wrap()

    def _on_deepspeed(self, engine: Any, behaviour: StackBehaviour) -> Tuple[StackBehaviour, int, Optional[str]]:
        """(the behaviour, the engine's G, what its release does wrong in a Fabric loop or None); refused where the
        policy would act on a release whose optimizer fails."""
        stage = lightning_facts.zero_stage(self.fabric.strategy) or 0
        gas = engine.gradient_accumulation_steps()
        deepspeed = behaviour.stack.deepspeed
        zero12 = fabric_zero12(deepspeed) if stage in (1, 2) else None
        warning = None
        if zero12 in (FabricZero12.FAILS, FabricZero12.KEEPS_THE_LAST) and (gas > 1 or zero12 is FabricZero12.FAILS):
            warning = FAILS.format(gas=gas, stage=stage, deepspeed=deepspeed)
            if self.policy.interferes or self.policy.stops:
                raise StepSyncConfigError(warning)
        elif zero12 is FabricZero12.KEEPS_THE_LAST and not self.policy.steers_the_boundary:
            warning = LOSES_GRADIENTS.format(stage=stage)
        return behaviour, gas, warning

    def _keep(self, run: Run) -> None:
        super()._keep(run)
        if run.facts.deepspeed:
            run.known_cause = Cause.ENGINE_NOT_STEPPED

    def _wrap(self) -> None:
        fabric, optimizer = self.fabric, self.optimizer
        no_backward_sync, step = fabric.no_backward_sync, optimizer.step
        self._call_before(fabric, "backward", self._before_backward)

        @contextlib.contextmanager
        def watched_no_backward_sync(module, enabled: bool = True):
            self._ends_window, self._says_windows = not enabled, True
            with no_backward_sync(module, enabled):
                yield

        @functools.wraps(step)
        def watched_step(*args, **kwargs):
            run = self._run
            # Under sync the engine makes the update the loop asks for; switched off, Fabric's own step is back.
            result = run.engine.step() if run is not None and run.action.sets_the_boundary() else step(*args, **kwargs)
            self._after_step()
            return result

        self._patches.set(fabric, "no_backward_sync", watched_no_backward_sync)
        self._patches.set(optimizer, "step", watched_step)

    @guarded(steering=True)
    def _before_backward(self, run: Run) -> None:
        self._micro_batch_begins(run, not self._reported_micro_batch)  # no optimizer.step() after the last one?
        self._reported_micro_batch = False
        ends_window, self._ends_window = self._ends_window, None
        if ends_window is None and self._says_windows:
            ends_window = True  # a loop that marks its accumulating micro-batches syncs the others
        if run.action.sets_the_boundary() and ends_window is None:
            raise StepSyncConfigError("policy 'sync' needs your loop's fabric.no_backward_sync(model, enabled=...) "
                                      "around each backward, to know which micro-batch ends a window")
        if ends_window is None and run.token_weights is not None and run.token_weights.reading:
            run.token_weights.remove()  # no window would ever end: nothing to name
            run.voice.not_checked("loss normalisation: not read: your loop does not say where its windows end "
                                  "(fabric.no_backward_sync(model, enabled=...) around each backward)")
        run.before_micro_batch(bool(ends_window))

    @guarded(steering=True)
    def _after_step(self, run: Run) -> None:
        self.loop_steps += 1
        self._reported_micro_batch = True
        run.after_micro_batch(True, self.loop_steps)
        if self.loop_steps == 1 and run.engine.global_steps == 0:
            run.voice.warn(NEVER_STEPPED.format(engine=0, loop=1))

    def _unreported(self) -> bool:
        return not self._reported_micro_batch


def watch(fabric: Any, model: Any, optimizer: Any, policy: Union[str, Policy] = Policy.WARN, dataloader: Any = None,
          console: Any = None, loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> FabricWatch:
    """Watch a Fabric loop on DeepSpeed; call it after ``model, optimizer = fabric.setup(model, optimizer)``.

    Args:
        fabric: the ``lightning.Fabric`` of the loop.
        model, optimizer: what ``fabric.setup`` returned.
        policy: ``"warn"`` (name what goes wrong), ``"raise"`` (stop at the first divergence) or ``"sync"`` (the
            engine updates where your loop calls ``optimizer.step()``, accumulating the micro-batches your
            ``fabric.no_backward_sync(model, enabled=True)`` marks). ``"realign"`` and ``"drop_last"`` are refused.
        dataloader: the training dataloader (its length tells the epochs apart).
        console: as for :class:`stepsync.StepSyncCallback`.
        loss_normalisation: the rule each window's loss is meant to follow (default ``"token_mean"``), as for
            :class:`stepsync.StepSyncCallback`.

    Example::

        model, optimizer = fabric.setup(model, optimizer)
        with stepsync.lightning.watch(fabric, model, optimizer, policy="sync", dataloader=loader) as sync:
            for batch_idx, batch in enumerate(loader):
                with fabric.no_backward_sync(model, enabled=(batch_idx + 1) % 4 != 0):
                    fabric.backward(model(batch) / 4)
                if (batch_idx + 1) % 4 == 0:
                    optimizer.step(); optimizer.zero_grad()
        print(sync.report)
    """
    return FabricWatch(fabric, model, optimizer, policy, dataloader, console, loss_normalisation)
