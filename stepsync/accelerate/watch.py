"""``stepsync.watch``: the same check and fix for a custom ``accelerate`` training loop on DeepSpeed.

A loop shaped like transformers' ``run_*_no_trainer.py`` counts an update when ``accelerator.sync_gradients``
is true inside ``accelerator.accumulate()``: every G-th micro-batch and at the end of the dataloader. Before
accelerate 1.8 the DeepSpeed engine decides its updates with its own micro-step counter, which never
restarts at an epoch, so the two counts drift exactly as the Trainer's do.

The watch wraps the accelerator instance's ``backward`` (and ``accumulate``, to see whether a backward runs
inside it): before each backward it reads accelerate's own ``sync_gradients``, after it the engine's count.
``save_state`` gets stepsync's record written into the folder (and a save that would lose micro-batches said);
``load_state`` reads it back, so that a resumed loop's report continues from the saved counts.
Nothing else is touched; under ``warn`` the run is exactly what it would be without it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from typing import Any, Optional, Tuple, Union

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.events import Cause
from ..core.frameworks import ACCELERATE_LOOP
from ..core.plan import RunPlan
from ..core.tokens import Normalisation
from ..core.tracking import run_metrics
from ..core.versions import EngineBoundary
from ..engine.deepspeed import engine_facts, is_engine, zero_loss
from ..engine.faults import guarded
from ..engine.lifecycle import RunStart, close_run, say_the_clip
from ..engine.loop_objects import accelerators_sharding_dropped, distributed_type, length_of
from ..engine.policies import loop_action_for
from ..engine.run import Run
from ..engine.trackers import AcceleratorTrackers
from ..engine.watch import UserLoopWatch, accumulation_given
from .checkpoints import LoopCheckpoints, loop_layout

OUTSIDE_ACCUMULATE = ("accelerator.backward() ran outside `with accelerator.accumulate(model):` with "
                      "gradient_accumulation_steps={g}: there sync_gradients stays True, so {effect}; put the "
                      "forward, backward and optimizer step inside `with accelerator.accumulate(model):`")
OUTSIDE_EFFECT = {
    True: "the engine updates on every micro-batch, not where your loop calls optimizer.step()",
    False: "the engine updates at every G-th micro-batch by its own counter, not where your loop calls "
           "optimizer.step()",
}


def find_engine(accelerator: Any) -> Any:
    """The DeepSpeed engine ``accelerator.prepare`` built, or None."""
    return getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)


class LoopWatch(UserLoopWatch):
    """Watches one custom accelerate loop; made by :func:`watch`. Use it as a context manager, or call
    :meth:`close` after the loop: that gives ``backward`` and the engine's boundary back and ends the report.

    A failure inside stepsync never reaches your loop (it is logged once, and a failure of its steering gives
    DeepSpeed its own boundary back), except under ``policy="raise"``.

    Attributes:
        report: the same :class:`stepsync.SyncReport` the callback keeps; ``trainer_steps`` is the count your
            loop sees (updates where ``accelerator.sync_gradients`` was true).
        loop_steps: that count, live.
    """

    framework = ACCELERATE_LOOP
    _checkpoints: LoopCheckpoints

    def __init__(self, accelerator: Any, policy: Union[str, Policy], dataloader: Any, num_epochs: Optional[float],
                 console: Any, asked_g: Optional[int] = None,
                 loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> None:
        self._watch(policy, console, loss_normalisation)
        self.accelerator = accelerator
        self._inside_accumulate = 0
        self._epoch_open = False
        self._outside = False  # backward() runs outside accumulate(): the loop's optimizer.step() calls are its count
        self._pending = False  # outside: the last micro-batch is not counted yet (no optimizer.step() after it yet)
        self._dataloader_ended = False  # outside: the dataloader ended at that micro-batch
        self._said_clip = False
        self._counts_update = False
        self._since_loop_update = 0
        self._num_epochs = num_epochs
        self._checkpoints = LoopCheckpoints(accelerator)
        self._start(dataloader, num_epochs, asked_g)

    # ------------------------------------------------------------ setup

    def _start(self, dataloader: Any, num_epochs: Optional[float], asked_g: Optional[int]) -> None:
        accelerator = self.accelerator
        if is_engine(accelerator):  # deepspeed.initialize's engine, driven by the loop itself
            raise StepSyncConfigError("this watch is for an accelerate Accelerator, and was given a DeepSpeed engine: "
                                      "call stepsync.watch(engine), which watches a loop that drives it itself")
        kind = distributed_type(accelerator)
        if "DEEPSPEED" not in kind:
            dropped = accelerators_sharding_dropped(accelerator)
            self._idle(
                f"nothing to watch: the accelerator does not use DeepSpeed (distributed_type {kind}). " + (
                    f"{dropped}. " if dropped else "") +
                "Given a DeepSpeed plugin, accelerate drops it under Accelerator(cpu=True): on a CPU machine leave "
                "cpu out, set DS_ACCELERATOR=cpu and start the script with torchrun or accelerate launch. A loop on "
                "several ranks without DeepSpeed (DDP, FSDP2) is watched through the model and optimizer prepare() "
                "returned: stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=G)",
                logging.WARNING)
            return
        engine = find_engine(accelerator)
        if not is_engine(engine):
            raise StepSyncConfigError("stepsync.watch() found no DeepSpeed engine on the accelerator: call it after "
                                      "accelerator.prepare(model, optimizer, dataloader, ...)")
        behaviour = self._installed()
        if behaviour is None:
            return
        g = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
        n = length_of(dataloader)
        plan = None if n is None or num_epochs is None else RunPlan(n, g, num_epochs, -1, 0, engine.global_steps)
        in_force = engine_facts(engine).g_in_force(g)  # accelerate < 1.8 may keep the code's G
        self._opened = RunStart(ACCELERATE_LOOP, self.policy, engine, behaviour, n, g, self.output,
                                is_main=bool(getattr(getattr(accelerator, "state", None), "is_main_process", True)),
                                plan=plan, action=loop_action_for(self.policy), asked_g=g_asked(asked_g, in_force),
                                loss_normalisation=self.loss_normalisation,
                                layout=loop_layout(engine, dataloader, g, n))
        self._tracking.trackers[:] = [AcceleratorTrackers(accelerator)]
        # The forecast waits for the first micro-batch: a load_state before it changes where the loop starts.
        self._open(self._opened, training_starts=False)
        self._wrap()

    def _wrap(self) -> None:
        accelerator = self.accelerator
        backward, accumulate, clip = accelerator.backward, accelerator.accumulate, accelerator.clip_grad_norm_

        @functools.wraps(backward)
        def watched_backward(loss, **kwargs):
            self._before_backward()
            result = backward(loss, **kwargs)
            self._after_backward()
            return result

        @contextlib.contextmanager
        def watched_accumulate(*models):
            self._inside_accumulate += 1
            try:
                with accumulate(*models):
                    yield
            finally:
                self._inside_accumulate -= 1

        @functools.wraps(clip)
        def watched_clip(parameters, max_norm, *args, **kwargs):
            if not self._said_clip:
                self._check_the_clip(max_norm)
            return clip(parameters, max_norm, *args, **kwargs)

        self._patches.set(accelerator, "backward", watched_backward)
        self._patches.set(accelerator, "accumulate", watched_accumulate)
        self._patches.set(accelerator, "clip_grad_norm_", watched_clip)
        for optimizer in getattr(accelerator, "_optimizers", ()):
            self._patches.set(optimizer, "step", self._watched_optimizer_step(optimizer.step), as_method=True)
        self._call_after(accelerator, "save_state", self._saved)
        self._call_after(accelerator, "load_state", self._loaded)

    def _saved(self, saved: Any, output_dir: Any = None, *args: Any, **kwargs: Any) -> None:
        folder = saved if isinstance(saved, str) else output_dir
        if folder is not None:
            self._after_save(os.fspath(folder))

    def _loaded(self, _: Any, input_dir: Any = None, *args: Any, **kwargs: Any) -> None:
        self._after_load(None if input_dir is None else os.fspath(input_dir))

    def _watched_optimizer_step(self, step: Any) -> Any:
        @functools.wraps(step)
        def watched_step(*args, **kwargs):
            if not self._outside:  # inside accumulate() the backward counts: nothing to do here
                return step(*args, **kwargs)
            self._before_optimizer_step()
            result = step(*args, **kwargs)
            self._after_optimizer_step()
            return result

        return watched_step

    # ------------------------------------------------------------ every micro-batch

    @guarded(steering=True)
    def _before_backward(self, run: Run) -> None:
        if self._opened is not None:
            opened, epochs = self._opened, self._num_epochs
            if not self._inside_accumulate and run.g > 1 and opened.plan is not None:
                run.voice.note("no forecast: your loop's backward() runs outside accumulate(), so its windows end at "
                               "its own optimizer.step() calls, not where a forecast counts them")
                opened, epochs = dataclasses.replace(opened, plan=None), None
            self.loop_steps = self._checkpoints.start_training(run, opened, epochs)
            self._opened = None
        if self._pending:  # outside accumulate(): the last micro-batch ended without an optimizer.step()
            self._count(run, False)
        if not self._epoch_open:
            run.begin_epoch()
            self._epoch_open = True
        if not self._inside_accumulate and run.g > 1 and not self._outside:
            self._outside = True
            self._say_outside(run)
        if self._outside:  # the loop's window ends at its optimizer.step(), after this backward
            self._pending = True
            run.before_micro_batch(False)  # under sync no boundary until then
            return
        self._counts_update = bool(self.accelerator.sync_gradients)
        run.before_micro_batch(self._counts_update)  # under sync the engine follows sync_gradients (accelerate 1.8)

    def _say_outside(self, run: Run) -> None:
        effect = OUTSIDE_EFFECT[run.behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER]
        run.voice.warn(OUTSIDE_ACCUMULATE.format(g=run.g, effect=effect))
        run.known_cause = Cause.OUTSIDE_ACCUMULATE
        run.remedy = "put the forward, backward and optimizer step inside `with accelerator.accumulate(model):`"
        if run.policy.steers_the_boundary and not run.action.sets_the_boundary():
            run.voice.warn(f"policy '{run.policy.value}' does not steer this run (said above), so the engine's updates "
                           "stay where accelerate puts them, not at your loop's optimizer.step()")

    @guarded(steering=True)
    def _after_backward(self, run: Run) -> None:
        self._dataloader_ended = bool(getattr(self.accelerator.gradient_state, "end_of_dataloader", False))
        if not self._outside:  # outside accumulate() the loop's optimizer.step() counts it
            self._count(run, self._counts_update)

    def _count(self, run: Run, updated: bool) -> None:
        """The micro-batch is done: counted (``updated``: the loop counted an update at it), and the epoch ended
        where the dataloader did."""
        self._pending = False
        if updated:
            self.loop_steps += 1
            self._since_loop_update = 0
        else:
            self._since_loop_update += 1
        run.after_micro_batch(updated, self.loop_steps)
        if updated and run.observing and getattr(self.accelerator, "trackers", None):
            self._observe("accelerator.log", self._log_metrics, run)
        # The dataloader says its end as it yields its last batch: a loop that gathers its window first (accelerate's
        # autoregressive example) runs several micro-batches after that. The epoch ends at the last of them.
        if self._dataloader_ended and (run.n is None or run.position >= run.n):
            run.end_epoch(self.loop_steps)
            self._epoch_open = self._dataloader_ended = False

    @guarded(steering=True)
    def _before_optimizer_step(self, run: Run) -> None:
        """Outside accumulate(), under sync: the loop's window ends here, after its last backward(); the engine closes
        it now (DeepSpeed's optimizer.step() under accelerate does nothing itself)."""
        if self._pending and run.action.closes_late(run):
            engine = run.engine
            if run.facts.reduces_at_backward:
                engine.backward(zero_loss(engine))
            engine.step()

    @guarded(steering=True)
    def _after_optimizer_step(self, run: Run) -> None:
        if self._pending:
            self._count(run, True)

    # ------------------------------------------------------------ checkpoints

    @guarded(steering=False)
    def _after_save(self, run: Run, folder: str) -> None:
        self._checkpoints.after_save(run, folder, self.loop_steps, self._since_loop_update)
        run.saved_checkpoint()

    @guarded(steering=False)
    def _check_the_clip(self, run: Run, max_norm: Any) -> None:
        self._said_clip = True
        if isinstance(max_norm, (int, float)):
            say_the_clip(run, float(max_norm), "accelerate ignores clip_grad_norm_'s max_norm under DeepSpeed: set "
                                               f"\"gradient_clipping\": {max_norm:g} in the DeepSpeed config",
                         "at your loop's first clip_grad_norm_")

    def _log_metrics(self, run: Run) -> None:
        self.accelerator.log(run_metrics(run.report, self.loop_steps, run.engine_steps_seen), step=self.loop_steps)
        self._tracking.catch_up()

    # ------------------------------------------------------------ end

    @guarded(steering=True, needs_run=False)
    def _close(self) -> None:
        if self._run is not None and self._pending:
            self._count(self._run, False)
        if self._run is not None and self._run.observing:
            self._say_whose_count_the_schedule_followed(self._run)
        close_run(self.report, self._run, self.loop_steps)

    def _say_whose_count_the_schedule_followed(self, run: Run) -> None:
        """Where the counts parted: the LR scheduler the loop prepared stepped on the loop's count (accelerate steps
        it where ``sync_gradients`` is true), not at the engine's updates as DeepSpeed's own scheduler does."""
        made = run.engine.global_steps
        if self.loop_steps == made:
            return
        engine_scheduler = getattr(run.engine, "lr_scheduler", None)
        prepared = [s for s in getattr(self.accelerator, "_schedulers", None) or []
                    if getattr(s, "scheduler", s) is not engine_scheduler]
        if prepared:
            run.voice.note(f"the LR scheduler your loop prepared steps on your loop's count (accelerate steps it where "
                           f"accelerator.sync_gradients is true), not at the engine's updates: its schedule followed "
                           f"your loop's {self.loop_steps} updates while the engine made {made}")


G_VARIABLE = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"


def g_asked(in_code: Optional[int], in_force: int) -> Tuple[Tuple[str, int, str], ...]:
    """Where the user set G, for the run to hold against the G ``in_force``: the code (when told) and accelerate's
    environment variable. accelerate takes the variable over the code, and the DeepSpeed config over both."""
    variable = os.environ.get(G_VARIABLE, "")
    places = []
    if in_code is not None:
        variable_won = variable.isdigit() and int(variable) == in_force
        over = (f"accelerate took {G_VARIABLE}={variable} over it: unset the variable" if variable_won else
                'accelerate took the DeepSpeed config\'s "gradient_accumulation_steps" over it: set it to "auto"')
        places.append(("your code", int(in_code), over))
    if variable.isdigit():
        places.append((f"the environment's {G_VARIABLE}", int(variable),
                       'accelerate took the DeepSpeed config\'s "gradient_accumulation_steps" over it: set that to '
                       '"auto" or unset the variable'))
    return tuple(places)


def watch(accelerator: Any, policy: Union[str, Policy] = Policy.WARN, dataloader: Any = None,
          num_epochs: Optional[float] = None, console: Any = None,
          gradient_accumulation_steps: Optional[int] = None,
          loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> LoopWatch:
    """Watch a custom accelerate training loop on DeepSpeed; call it after ``accelerator.prepare(...)``.

    Args:
        accelerator: the ``accelerate.Accelerator`` of the loop.
        policy: ``"warn"`` (report only), ``"raise"`` (stop at the first divergence) or ``"sync"`` (DeepSpeed's
            boundary follows ``accelerator.sync_gradients``, accelerate 1.8's fix for 1.1-1.7). ``"realign"``
            and ``"drop_last"`` are refused: stepsync cannot change your loop's counter or its dataloader.
        dataloader: the prepared training dataloader, for the forecast (its length).
        num_epochs: the epochs the loop runs, for the forecast.
        console: as for :class:`stepsync.StepSyncCallback`.
        gradient_accumulation_steps: the G your code gave ``Accelerator(...)``, held against the one in force
            (accelerate takes ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` over it, and the DeepSpeed config's value
            over both, with one log line); a difference is a warning naming the fix, a stop under ``raise``.
        loss_normalisation: the rule each window's loss is meant to follow (default ``"token_mean"``), as for
            :class:`stepsync.StepSyncCallback`.

    Raises:
        StepSyncConfigError: (a ``ValueError``) an unknown or refused policy, no DeepSpeed engine yet (call it
            after ``prepare``), or ``sync`` on an engine that cannot be steered.
        ValueError: a bad console.

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
    given = None if gradient_accumulation_steps is None else accumulation_given(
        gradient_accumulation_steps, "the positive int your code gave Accelerator(gradient_accumulation_steps=...), "
        "or leave it out")
    return LoopWatch(accelerator, policy, dataloader, num_epochs, console, given, loss_normalisation)
