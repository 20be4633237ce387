"""The skeleton every framework's adapter is built on, whichever framework it watches: the user's choices read
against the framework's descriptor, a report from the moment the watch exists (idle, saying why, until a run
opens), the installed releases asked of the descriptor, the run kept as it opens, and the framework's methods
wrapped on single instances and given back. An adapter adds only what its framework differs in: where its hooks
are and what they tell the run.

A watch of a loop the user writes (:class:`UserLoopWatch`) adds the loop's micro-batches and epochs as the loop
reports them, and :meth:`UserLoopWatch.close` (a context manager that closes on exit)."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable, ClassVar, Dict, Optional, TypeVar, Union

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError, UnsupportedVersion
from ..core.frameworks import Framework
from ..core.plan import RunPlan
from ..core.record import ResumeRecord
from ..core.releases import installed_behaviour
from ..core.report import SyncReport
from ..core.tokens import Normalisation
from ..core.tracking import run_metrics
from ..core.versions import StackBehaviour
from ..display.output import ConsoleOutput
from .faults import Adapter, guarded
from .lifecycle import RunStart, close_run, idle_report, open_run, start_training
from .loop_objects import InstancePatches
from .resume import LoopSaves
from .run import Run
from .trackers import Tracking, trackers_of

Watch = TypeVar("Watch", bound="UserLoopWatch")


def accumulation_given(given: Any, meaning: str) -> int:
    """The ``gradient_accumulation_steps`` a user gave ``stepsync.watch()``, or an error that says what to pass:
    ``meaning``."""
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise StepSyncConfigError(f"gradient_accumulation_steps={given!r}: pass {meaning}")
    return given


class ResumingSaves(LoopSaves):
    """The checkpoints of a loop whose watch opens its run before the loop may load one: the record kept in each it
    saves, and training started at the loop's first micro-batch, from the record of the checkpoint loaded by then.

    Attributes:
        save_where: where a save a resume can continue from exactly goes, as a message says it.
    """

    save_where: ClassVar[str]

    def after_save(self, run: Run, folder: str, since_loop_update: int) -> None:
        """Keep the record in the folder (each node's first process), and say a save a resume cannot continue from
        exactly."""
        self.keep_the_record(run, folder, int(os.environ.get("LOCAL_RANK", "0") or 0) == 0)
        self.saves.check(run, folder, since_loop_update, self.save_where)

    def start_training(self, run: Run, opened: RunStart, num_epochs: Optional[float],
                       forecast_now: bool = False) -> RunStart:
        """The first micro-batch of a loop that may have loaded a checkpoint: training starts fresh (``opened``), or
        from the checkpoint read (its record's counts and epoch).
        Returns what it started from; ``forecast_now=False`` leaves the forecast to the loop's first update."""
        if self.loaded is None:
            start_training(run, opened, forecast_now=forecast_now)
            return opened
        folder, record = self.loaded
        self.restore_steps(run, record)
        engine_steps, n = run.engine.global_steps, run.n
        name = os.path.basename(os.path.normpath(folder))
        if record is None:
            # Saved without stepsync: the loop's count before it is kept nowhere; the updater's stands for it.
            loop_steps, epoch, placed = engine_steps, 0, False
        else:
            loop_steps, epoch, placed = record.trainer_steps, record.next_epoch, record.next_skip == 0
            if n is not None and record.next_skip >= n:
                epoch, placed = epoch + 1, True
        plan = None
        if placed and n is not None and num_epochs is not None:
            plan = RunPlan(n, run.g, num_epochs, -1, loop_steps, engine_steps, start=(epoch, 0))
        started = dataclasses.replace(opened, trainer_steps=loop_steps, plan=plan, start_epoch=epoch, skip=0,
                                      record=record)
        start_training(run, started, resumed=True, forecast_now=forecast_now and plan is not None)
        if record is None:
            self.say_saved_without_stepsync(run, name, engine_steps)
        elif not placed:
            run.voice.warn(f"{name} was saved after micro-batch {record.next_skip} of epoch {record.next_epoch + 1}; "
                           "stepsync cannot see where your loop resumes in it, so it counts that epoch from your "
                           "loop's next micro-batch and makes no forecast")
        return started

    def restore_steps(self, run: Run, record: Optional[ResumeRecord]) -> None:
        """Before a resumed run starts: the updater's count as the checkpoint restored it (DeepSpeed's engine
        restores its own)."""


class FrameworkWatch(Adapter):
    """What every adapter is: a watch of one framework (:attr:`framework`, its descriptor), its report, its run.

    Attributes:
        framework: the descriptor of the framework watched (a class attribute of each adapter).
        report: what stepsync saw (:class:`stepsync.SyncReport`): idle, saying why, until a run opens.
    """

    framework: ClassVar[Framework]
    output: ConsoleOutput
    loss_normalisation: Normalisation
    _patches: InstancePatches

    def _watch(self, policy: Union[str, Policy], console: Any,
               loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> None:
        """Begin: the user's choices read (an unknown or refused one raises, naming what to use instead)."""
        self.policy = self.framework.parse_policy(policy)
        self.loss_normalisation = Normalisation.parse(loss_normalisation)
        self.output = ConsoleOutput(console)
        self._run: Optional[Run] = None
        self._patches = InstancePatches()
        self._tracking = Tracking()
        self._idle()

    @property
    def run(self) -> Optional[Run]:
        """The run being watched; None before, with nothing to watch, and once stepsync switched itself off."""
        return self._run

    def _idle(self, reason: str = "", level: int = logging.INFO, speaks: bool = True) -> None:
        """No run: the report says why (``reason`` logged at ``level`` where this rank ``speaks``)."""
        self.report = idle_report(self.framework, self.policy, reason, level, speaks)

    def _installed(self, speaks: bool = True) -> Optional[StackBehaviour]:
        """What the installed releases do, run by this framework; None (the report saying why) where stepsync does
        not cover them."""
        try:
            return installed_behaviour(self.framework)
        except UnsupportedVersion as exc:
            self._idle(f"{exc}; stepsync cannot check this run", logging.WARNING, speaks)
            return None

    def _open(self, start: RunStart, training_starts: bool = True) -> Run:
        """Open the run ``start`` describes, kept (:meth:`_keep`) before its policy starts."""
        return open_run(start, self._keep, training_starts)[0]

    def _keep(self, run: Run) -> None:
        """The run exists: a failure from now on switches it off, and the report is its own."""
        self._run, self.report = run, run.report
        run.voice.tracking = self._tracking

    def _call_before(self, owner: Any, name: str, hook: Callable[[], None]) -> None:
        """``owner.name``, on this instance, calls ``hook()`` first; given back at close."""
        method = getattr(owner, name)

        @functools.wraps(method)
        def watched(*args: Any, **kwargs: Any) -> Any:
            hook()
            return method(*args, **kwargs)

        self._patches.set(owner, name, watched)

    def _call_around(self, owner: Any, name: str, before: Callable[[], None], after: Callable[[], None],
                     as_method: bool = False) -> None:
        """``owner.name``, on this instance, calls ``before()`` first and ``after()`` once it returned; given back at
        close (``as_method``: set as a bound method, for code that reads its ``__func__``, as an LR scheduler
        does of an optimizer's ``step``)."""
        method = getattr(owner, name)

        @functools.wraps(method)
        def watched(*args: Any, **kwargs: Any) -> Any:
            before()
            result = method(*args, **kwargs)
            after()
            return result

        self._patches.set(owner, name, watched, as_method=as_method)

    def _call_after(self, owner: Any, name: str, hook: Callable[..., None]) -> None:
        """``owner.name``, on this instance, calls ``hook(result, *args, **kwargs)`` once it returned (where the
        framework has the method); given back at close."""
        method = getattr(owner, name, None)
        if method is None:
            return

        @functools.wraps(method)
        def watched(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            hook(result, *args, **kwargs)
            return result

        self._patches.set(owner, name, watched)


class UserLoopWatch(FrameworkWatch):
    """A watch of a loop the user writes: the loop's micro-batches and epochs as the loop's methods report them,
    and the loop's methods given back at :meth:`close`, which ends the run once."""

    loop_steps: int
    _checkpoints: LoopSaves  # where the loop saves and loads checkpoints the watch reads
    _opened: Optional[RunStart]  # what the run opened from, until training starts

    def _micro_batch_begins(self, run: Run, last_unreported: bool) -> None:
        """A loop whose updates come after its backward() calls, its epochs told apart by the dataloader's length:
        the last micro-batch is counted where no update followed it, and an epoch begins where none is open or the
        open one is full."""
        if last_unreported:
            run.after_micro_batch(False, self.loop_steps)
        if run.epoch < run.start_epoch:  # none open yet (a resumed run starts at its record's epoch)
            run.begin_epoch()
        elif run.n is not None and run.position >= run.n:
            run.end_epoch(self.loop_steps)
            run.begin_epoch()

    def _loop_ends(self, run: Run, last_unreported: bool) -> None:
        """The loop ended: its last micro-batch counted where no update followed it, and a full epoch ended."""
        if last_unreported:
            run.after_micro_batch(False, self.loop_steps)
        if run.n is not None and run.position >= run.n:
            run.end_epoch(self.loop_steps)

    def _watch(self, policy: Union[str, Policy], console: Any,
               loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> None:
        super()._watch(policy, console, loss_normalisation)
        self.loop_steps = 0
        self._opened = None

    def _track_into(self: Watch, tracker: Any) -> Watch:
        """The trackers the user handed the watch: the run's metrics go to them from the run (a loop with no
        logging steps stepsync can see)."""
        self._tracking.trackers[:] = trackers_of(tracker)
        self._tracking.sends_metrics = self._tracking.sends_last_metrics = True
        return self

    def metrics(self) -> Dict[str, float]:
        """stepsync's metrics now, by name (``docs/trackers.md``): your loop's count, the updates made, the drift
        and each finding, to merge into your own logging calls; empty while no run is watched."""
        run = self._run
        if run is None:
            return {}
        return run_metrics(self.report, self.loop_steps, run.engine_steps_seen)

    def close(self) -> SyncReport:
        """Give the wrapped methods and the engine's boundary back; the report is final. Closing twice changes
        nothing."""
        self._patches.restore()
        if not self.report.finished:
            self._close()
        return self.report

    def _unreported(self) -> bool:
        """The loop's last micro-batch is not in the run's count yet (no update of the loop's followed it)."""
        return False

    @guarded(steering=True, needs_run=False)
    def _close(self) -> None:
        """End the run: the loop's last micro-batch, its epoch, and the report."""
        run = self._run
        if run is not None:
            self._loop_ends(run, self._unreported())
        close_run(self.report, run, self.loop_steps)

    @guarded(steering=False)
    def _after_save(self, run: Run, folder: str) -> None:
        """The loop saved ``folder``: the record kept in it, a save inside the loop's window said, the ranks'
        copies of the weights compared."""
        checkpoints = self._checkpoints
        assert isinstance(checkpoints, ResumingSaves)  # the watches whose loops' saves it wraps keep theirs so
        checkpoints.after_save(run, folder, self._in_window())
        run.saved_checkpoint()

    def _in_window(self) -> int:
        """The loop's micro-batches since its last update."""
        return 0

    @guarded(steering=False)
    def _after_load(self, run: Run, folder: Optional[str]) -> None:
        """The loop loaded ``folder``: its record is read for the first micro-batch (training has not started while
        the start is still open)."""
        self._checkpoints.after_load(run, folder, started=self._opened is None)

    def __enter__(self: Watch) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
