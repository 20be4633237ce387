"""``stepsync.watch(engine)``: the check, and the fix, for a loop that drives DeepSpeed's engine itself.

Loops that call ``deepspeed.initialize`` and drive the engine themselves come in two shapes:

- ``backward()`` and ``step()`` on every micro-batch, the engine owning G (DeepSpeed-Chat's training steps): the loop
  plans its windows, and its LR schedule, per epoch (``epochs * ceil(N / G)``), while the engine updates at every
  G-th micro-batch by its own counter, which never restarts at an epoch;
- several ``backward()`` calls, then one ``step()`` (RL learners: open-instruct, OpenRLHF): the loop's window is what
  it gave ``backward()`` since its last ``step()``, while the engine counts its windows in ``step()`` calls, and on
  ZeRO 1 and 2 every ``backward()`` at one of its boundaries replaces the gradients reduced before it.

The watch wraps the engine instance's ``backward`` and ``step`` and learns the loop's shape at its first ``step()``,
where it makes the forecast. Under ``sync`` the engine's boundary is set before each ``backward()`` where the loop's
window is known to end (an epoch's windows of G), else to no boundary; a ``step()`` that ends the loop's window
makes it the boundary, and on ZeRO 1 and 2, where the boundary must come at a ``backward()``, one ``backward()`` of
a zero loss closes it (it adds nothing and reduces every gradient of the window: exact, as probed).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional, Union

from ..core import rules
from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.events import Cause, LostGradients
from ..core.frameworks import DEEPSPEED_LOOP
from ..core.plan import RunPlan
from ..core.tokens import Normalisation
from ..core.weights import SeveralBackwards, several_backwards
from ..engine.deepspeed import is_engine, zero_loss
from ..engine.faults import guarded
from ..engine.lifecycle import RunStart, make_forecast
from ..engine.loop_objects import length_of
from ..engine.policies import engine_loop_action_for
from ..engine.resume import engines_schedule
from ..engine.run import Run
from ..engine.watch import UserLoopWatch, accumulation_given
from .checkpoints import EngineCheckpoints, checkpoint_folder

UNSEEN_BACKWARD = ("engine.step() came with no engine.backward() before it: your loop calls backward another way "
                   "(loss.backward(), which DeepSpeed accepts on ZeRO 1-3), so stepsync cannot count its micro-batches "
                   "and watches no further; call engine.backward(loss) to have it watched")
SEVERAL_BACKWARDS = ("your loop called backward() {k} times before step(), and the engine counts its windows in "
                     "step() calls (gradient_accumulation_steps={g} in the DeepSpeed config): {effect}; set "
                     "gradient_accumulation_steps to 1 in the config")
SEVERAL_BACKWARDS_EFFECT = {
    False: "it updates at every {g}-th step(), not at each",
    True: "policy 'sync' makes each step() an update, but DeepSpeed still divides each micro-batch's loss by {g}",
}



class EngineWatch(UserLoopWatch):
    """Watches one loop that drives DeepSpeed's engine itself; made by :func:`watch`. A context manager, or call
    :meth:`close` after the loop: that gives ``backward``, ``step`` and the engine's boundary back.

    A failure inside stepsync never reaches your loop (it is logged once, and a failure of its steering gives
    DeepSpeed its own boundary back), except under ``policy="raise"``.

    Attributes:
        report: the same :class:`stepsync.SyncReport` the callback keeps; ``trainer_steps`` counts your loop's
            windows (each ``step()`` after several ``backward()`` calls, or each epoch's windows of G where it steps
            after every micro-batch).
        loop_steps: that count, live.
    """

    framework = DEEPSPEED_LOOP
    _checkpoints: EngineCheckpoints

    def __init__(self, engine: Any, policy: Union[str, Policy], dataloader: Any, num_epochs: Optional[float],
                 console: Any, loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN,
                 backwards_per_step: Optional[int] = None) -> None:
        self._watch(policy, console, loss_normalisation)
        self.engine = engine
        # the backward() calls per step() the user said the loop makes (one is the engine's own accumulation)
        self._stated = backwards_per_step if backwards_per_step and backwards_per_step > 1 else None
        self._said = backwards_per_step
        self._started: Optional[RunStart] = None  # what training started from, until the loop's first step()
        self._num_epochs = num_epochs
        self._checkpoints = EngineCheckpoints()
        self._per_micro_batch: Optional[bool] = None  # the loop steps after every backward(): known at its 1st step
        self._backwards = 0  # backward() calls since the loop's last step()
        self._pending = False  # the last backward's micro-batch is not in the run's count yet (no step() after it)
        self._at_boundary = False  # the last backward() ran at a boundary of the engine's
        self._since_update = 0  # backward() calls since the engine's last update
        self._since_loop_update = 0  # backward() calls since the loop's window last closed
        self._marks = (0, 0)  # of those, how many had run at the last two backward() calls at a boundary
        self._unread = 0  # of those, the ones whose boundary was not read (a loop that steps after each)
        self._closes_at_backward = False  # ZeRO 1-2 under the engine's own accumulation: a late window needs one
        self._replaces = False  # ... and this release replaces a boundary's gradients at the next boundary
        self._unverified = False  # ... and this release's ZeRO-2 drops what stepsync cannot count (said once)
        self._counts_update = False
        self._ends = False  # the loop's window ends at the running micro-batch (a loop that steps after each)
        self._steers = False  # the policy sets the engine's boundary
        self._reads_boundary = True  # each backward's boundary is read (ZeRO 1-2's replaced gradients, or sync)
        self._quick_steps = False  # a step() after one backward() needs only the count (nothing to check or close)
        self._start(dataloader, num_epochs)

    def _start(self, dataloader: Any, num_epochs: Optional[float]) -> None:
        engine = self.engine
        if not is_engine(engine):
            raise StepSyncConfigError(f"stepsync.watch() was given {type(engine).__name__}, not a DeepSpeed engine: "
                                      "pass the engine deepspeed.initialize(...) returned, or the accelerate "
                                      "Accelerator after accelerator.prepare(...)")
        behaviour = self._installed()
        if behaviour is None:
            return
        g = engine.gradient_accumulation_steps()
        n = length_of(dataloader)
        start = engine.global_steps  # a loop that loaded a checkpoint first: its count is taken as the engine's
        plan = None if n is None or num_epochs is None else RunPlan(n, g, num_epochs, -1, start, start)
        self._opened = RunStart(DEEPSPEED_LOOP, self.policy, engine, behaviour, n, g, self.output,
                                is_main=int(getattr(engine, "global_rank", 0) or 0) == 0, trainer_steps=start,
                                plan=plan, action=engine_loop_action_for(self.policy),
                                loss_normalisation=self.loss_normalisation, schedules=engines_schedule(engine))
        run = self._open(self._opened, training_starts=False)
        self.loop_steps = start
        self._closes_at_backward = run.facts.reduces_at_backward
        several = several_backwards(behaviour.stack.deepspeed)
        self._replaces = self._closes_at_backward and several is SeveralBackwards.REPLACES
        self._unverified = self._closes_at_backward and run.facts.zero_stage == 2 and several is SeveralBackwards.FAILS
        self._steers = run.action.sets_the_boundary()
        self._reads_boundary = self._steers or self._replaces
        if start:
            run.voice.note(f"the engine had made {start} update(s) before stepsync.watch(): your loop's count is taken "
                           "to start there")
        self._wrap()

    def _wrap(self) -> None:
        engine = self.engine
        backward, step = engine.backward, engine.step
        self._call_before(engine, "backward", self._before_backward)

        @functools.wraps(step)
        def watched_step(*args, **kwargs):
            if self._quick_steps and self._backwards == 1:
                self._counts_update = self._ends  # known before its backward()
            else:
                self._before_step(backward)
            result = step(*args, **kwargs)
            self._after_step()
            return result

        self._patches.set(engine, "step", watched_step)
        self._call_after(engine, "save_checkpoint", self._saved)
        self._call_after(engine, "load_checkpoint", self._loaded)

    def _saved(self, _: Any, save_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> None:
        self._after_save(checkpoint_folder(save_dir, tag, self.engine))

    def _loaded(self, loaded: Any, *args: Any, **kwargs: Any) -> None:
        path = loaded[0] if isinstance(loaded, tuple) and loaded else None  # the model states' file, or None
        self._after_load(None if path is None else os.path.dirname(os.fspath(path)))

    # ------------------------------------------------------------ every micro-batch

    def _ends_window(self, run: Run, position: int) -> bool:
        """Whether the loop's window ends at ``position`` (1-based in the epoch) of a loop that steps after every
        micro-batch: its epoch's windows of G, the last one partial."""
        return rules.is_trainer_boundary(run.behaviour.trainer_rule, position, run.n or 0, run.g)

    @guarded(steering=True)
    def _before_backward(self, run: Run) -> None:
        if self._opened is not None:
            self._started = self._checkpoints.start_training(run, self._opened, self._num_epochs)
            self.loop_steps, self._opened = self._started.trainer_steps, None
        self._micro_batch_begins(run, self._pending)  # no step() after the last one?
        self._pending = True
        self._backwards += 1
        self._since_update += 1
        self._since_loop_update += 1
        if self._per_micro_batch:
            self._ends = self._ends_window(run, run.position + 1)
        if self._stated and not self._per_micro_batch:
            self._held_to_stated(run, self._stated)
        if self._steers:  # the boundary is the one the policy sets
            run.before_micro_batch(self._ends)
            self._at_boundary = self._ends
        elif self._reads_boundary:
            self._at_boundary = bool(self.engine.is_gradient_accumulation_boundary())
        else:
            self._at_boundary, self._unread = False, self._unread + 1
        if self._at_boundary:
            self._marks = (self._marks[1], self._since_update)

    def _held_to_stated(self, run: Run, stated: int) -> None:
        """A loop that said its backward() calls per step(): the window ends at the stated one (where ``sync`` sets
        the boundary before it, no closing backward needed); one beyond it is said once, and the statement dropped."""
        if self._backwards <= stated:
            self._ends = self._backwards == stated
            return
        self._stated, self._ends = None, False
        effect = ""
        if self._steers and self._closes_at_backward and self._replaces:
            effect = (f": policy 'sync' had set the engine's boundary before the {stated}th, and DeepSpeed "
                      f"{run.behaviour.stack.deepspeed} replaces what a boundary reduced at the next one, so that "
                      "window's first micro-batches are lost (counted in the report)")
        elif self._steers:
            effect = f": policy 'sync' had set the engine's boundary before the {stated}th (nothing lost on this stage)"
        closed = "; from here each window is closed at its step()" if self._steers else ""
        run.voice.warn(f"your loop called backward() {self._backwards} times before step(), more than the "
                       f"gradient_accumulation_steps={stated} it gave stepsync.watch(){effect}{closed}: pass the "
                       "backward() calls your loop makes per step()")

    @guarded(steering=True)
    def _before_step(self, run: Run, backward: Any) -> None:
        k, engine = self._backwards, self.engine
        if k == 0:
            if run.policy.stops:
                raise StepSyncConfigError(f"{UNSEEN_BACKWARD}; policy '{run.policy.value}' stops here")
            self._switch_off(UNSEEN_BACKWARD)
            return
        if self._per_micro_batch is None:
            self._first_step(run, k)
        elif k > 1:
            self._per_micro_batch = False
        if k > 1 and self._unverified:
            self._unverified = False
            self._say_unverified(run)
        self._reads_boundary = self._steers or (self._replaces and not self._per_micro_batch)
        # A loop that steps after each backward(): its window's end was known (and under sync set) before it.
        self._quick_steps = bool(self._per_micro_batch) and run.facts.managed_accumulation
        position = run.position + (1 if self._pending else 0)
        self._counts_update = ends = (not self._per_micro_batch or not run.facts.managed_accumulation
                                      or self._ends_window(run, position))
        if ends and k and not self._at_boundary and run.action.closes_late(run):
            if self._closes_at_backward:
                backward(zero_loss(engine))  # DeepSpeed's own backward: the watch counts no micro-batch for it
            self._marks, self._at_boundary = (self._marks[1], self._since_update), True
        if (self._replaces and self._at_boundary and self._marks[0] and not self._unread
                and engine.is_gradient_accumulation_boundary()):
            lost = LostGradients(run.epoch + 1, position, engine.global_steps + 1, self._since_update, self._marks[0],
                                 run.facts.zero_stage or 0)
            run.updates.took_lost_gradients(run, lost)

    def _first_step(self, run: Run, k: int) -> None:
        """The loop's first step(): its shape is known, and training starts (the forecast is made for a loop that
        steps after every micro-batch)."""
        opened, self._started = self._started, None
        assert opened is not None
        self._per_micro_batch = k <= 1
        g = run.g_in_force
        if k > 1 and g > 1 and run.facts.managed_accumulation:
            run.known_cause = Cause.BACKWARDS_PER_STEP
            run.remedy = "set gradient_accumulation_steps to 1 in the DeepSpeed config"
            effect = SEVERAL_BACKWARDS_EFFECT[run.action.sets_the_boundary()].format(g=g)
            run.voice.warn(SEVERAL_BACKWARDS.format(k=k, g=g, effect=effect))
        if k == 1 and (self._said or 1) > 1:
            self._stated = None
            run.voice.warn(f"gradient_accumulation_steps={self._said} was given to stepsync.watch(), but your loop "
                           f"steps after every backward() (DeepSpeed accumulates the config's G={g} itself): leave "
                           "it out")
        elif k > 1 and self._steers and self._closes_at_backward and self._said is None:
            run.voice.note(f"policy 'sync' closes each window of your loop at its step() with one more backward() "
                           f"(of a zero loss: it adds nothing); if your loop calls backward() {k} times before each "
                           f"step(), pass gradient_accumulation_steps={k} to stepsync.watch() to have the boundary "
                           f"set before the {k}th instead")
        if opened.plan is not None and not run.facts.managed_accumulation:
            run.voice.note("no forecast: DeepSpeed's managed_gradient_accumulation is false, so every step() is an "
                           "update, not the epoch's windows of G a forecast counts")
        elif opened.plan is not None and k > 1:
            run.voice.note(f"no forecast: your loop called backward() {k} times before its first step(), so its "
                           "windows are its own, not the epoch's windows of G a forecast counts")
        else:
            make_forecast(run, opened)

    @staticmethod
    def _say_unverified(run: Run) -> None:
        """ZeRO-2 of DeepSpeed 0.17.6 - 0.18.2 and several backward() calls before one step(): what each update holds
        is not what stepsync can count. Refused where the policy would act on it (before anything is applied)."""
        text = (f"on DeepSpeed {run.behaviour.stack.deepspeed} ZeRO-2 drops gradients of a loop that calls backward() "
                "several times before step() (as probed on 0.17.6 - 0.18.2: a TypeError at the second backward(), "
                "only the last micro-batch applied where the boundary is set before it, none where a window is "
                "closed after it), and stepsync cannot count what each update holds: use DeepSpeed's own "
                "accumulation (gradient_accumulation_steps=K in the config, step() after every backward()), ZeRO-1, "
                "or DeepSpeed 0.18.3 or later")
        if run.policy.stops or run.action.sets_the_boundary():
            raise StepSyncConfigError(f"{text}; policy '{run.policy.value}' stops before this step() applies anything")
        run.voice.warn(text)

    @guarded(steering=True)
    def _after_step(self, run: Run) -> None:
        if self._counts_update:
            self.loop_steps += 1
            self._since_loop_update = 0
        self._pending, self._backwards = False, 0
        before = run.engine_steps_seen
        run.after_micro_batch(self._counts_update, self.loop_steps)
        if run.engine_steps_seen != before:
            self._since_update, self._marks, self._unread = 0, (0, 0), 0

    # ------------------------------------------------------------ checkpoints

    def _in_window(self) -> int:
        return self._since_loop_update

    # ------------------------------------------------------------ end

    def _unreported(self) -> bool:
        return self._pending


def watch(engine: Any, policy: Union[str, Policy] = Policy.WARN, dataloader: Any = None,
          num_epochs: Optional[float] = None, console: Any = None,
          loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN,
          gradient_accumulation_steps: Optional[int] = None, tracker: Any = None) -> EngineWatch:
    """Watch a loop that drives DeepSpeed's engine itself; call it after ``deepspeed.initialize(...)``.

    Args:
        engine: the engine ``deepspeed.initialize`` returned.
        policy: ``"warn"`` (report only), ``"raise"`` (stop at the first divergence, and before an update that
            would leave out micro-batches your loop gave it) or ``"sync"`` (the engine updates where your loop's
            window ends: at each ``step()`` after several ``backward()`` calls, at each epoch's windows of G where
            it steps after every micro-batch). ``"realign"`` and ``"drop_last"`` are refused.
        dataloader: the training dataloader, one micro-batch per ``backward()`` (its length tells the epochs apart
            and makes the forecast).
        num_epochs: the epochs the loop runs, for the forecast.
        console: as for :class:`stepsync.StepSyncCallback`.
        loss_normalisation: the rule each window's loss is meant to follow (default ``"token_mean"``), as for
            :class:`stepsync.StepSyncCallback`.
        gradient_accumulation_steps: for a loop that calls ``backward()`` K times before each ``step()`` (the
            config's G=1): K. Under ``sync`` the engine's boundary is then set before each window's K-th
            ``backward()`` (a shorter window, at an epoch's end, is closed at its ``step()``), which saves ZeRO 1
            and 2 the closing ``backward()`` of a zero loss. Leave it out for a loop that steps after every
            ``backward()``: the engine's G is its config's.
        tracker: where the run's metrics, its forecast and summary (as text) and an alert at each finding go: a
            ``SummaryWriter``, ``mlflow`` (on its active run) or ``(MlflowClient, run_id)``, a wandb run, a callable
            ``tracker(values, step)``, or a list of them (``docs/trackers.md``).

    Raises:
        StepSyncConfigError: (a ``ValueError``) an unknown or refused policy, or not an engine.

    Example::

        engine, _, train_dataloader, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, ...)
        with stepsync.watch(engine, policy="sync", dataloader=train_dataloader, num_epochs=2) as sync:
            for epoch in range(2):
                for batch in train_dataloader:
                    engine.backward(engine(**batch).loss)
                    engine.step()
        print(sync.report)
    """
    backwards = None if gradient_accumulation_steps is None else accumulation_given(
        gradient_accumulation_steps, "the backward() calls your loop makes before each step(), or leave it out")
    return EngineWatch(engine, policy, dataloader, num_epochs, console, loss_normalisation, backwards)._track_into(
        tracker)
