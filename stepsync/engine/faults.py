"""What a failure inside stepsync changes. Steering reads only counters that are equal on every rank, so a fault
there is the same on every rank and switches stepsync off everywhere; observing (checks, events, messages,
metrics, records) is where one rank's disk, terminal or handlers fail alone, so a fault there ends observing on
that rank only and the policy keeps steering. Policy 'raise' stops the run at either."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

from ..core.choices import Policy
from ..core.errors import StepDriftError, StepSyncConfigError
from ..core.report import SyncReport
from ..display.output import logger

if TYPE_CHECKING:  # pragma: no cover
    from .run import Run


def stop_observing(run: Run, where: str, exc: Exception) -> None:
    """A fault of the observing: no more checks, messages or metrics on this rank; the policy goes on."""
    reason = f"internal error in {where}: {exc!r}"
    if run.report.policy is Policy.RAISE:
        raise exc
    run.observing = False
    run.report.active = False
    run.report.inactive_reason = f"{reason}; stopped observing, policy '{run.report.policy.value}' still acts"
    logger.error("stopped observing this run on this rank (no more checks, messages or metrics); its policy "
                 "'%s' goes on acting on training as on every other rank. %s", run.report.policy.value, reason,
                 exc_info=exc)


def switch_off(run: Run, reason: str, exc_info: Optional[BaseException] = None) -> None:
    """Stop everything: observing and steering; the engine decides its boundary again."""
    run.observing = False
    say_switched_off(run.report, reason, exc_info)
    try:
        run.action.end(run)
    except Exception:  # the engine is already broken; nothing more to restore
        logger.debug("could not restore the engine", exc_info=True)


def say_switched_off(report: SyncReport, reason: str, exc_info: Optional[BaseException] = None) -> None:
    """Mark ``report`` inactive for ``reason`` and say so once, with the traceback that caused it."""
    report.active = False
    report.inactive_reason = reason
    outcome = "policy 'raise' stops the run" if report.policy is Policy.RAISE else "training goes on"
    logger.error("switched itself off for this run; %s. %s", outcome, reason, exc_info=exc_info)


def guarded(steering: bool, needs_run: bool = True):
    """Run an adapter's hook; a failure inside stepsync goes to :meth:`Adapter._failed`, never to training.
    With ``needs_run`` the hook runs only while a run is on, and gets it as its first argument."""

    def decorate(hook):
        @functools.wraps(hook)
        def wrapper(self: Adapter, *args, **kwargs):
            run = self._run
            if needs_run and run is None:
                return None
            try:
                if needs_run:
                    return hook(self, run, *args, **kwargs)
                return hook(self, *args, **kwargs)
            except (StepDriftError, StepSyncConfigError):
                raise
            except Exception as exc:
                return self._failed(hook.__name__, exc, steering)

        return wrapper

    return decorate


class Adapter:
    """What every framework adapter shares: its run (None before training and once switched off), its policy and
    report, and what a failure inside stepsync does to them."""

    _run: Optional[Run]
    policy: Policy
    report: Any

    def _failed(self, hook: str, exc: Exception, steering: bool) -> None:
        """A failure inside stepsync. Policy 'raise' stops the run. A fault of the steering (the same on every
        rank) switches stepsync off; a fault of the observing ends only the observing on this rank."""
        if steering or self.policy is Policy.RAISE:
            self._switch_off(f"internal error in {hook}: {exc!r}", exc_info=exc)
            if self.policy is Policy.RAISE:
                raise exc
            return
        if self._run is not None:
            stop_observing(self._run, hook, exc)

    def _switch_off(self, reason: str, exc_info: Optional[BaseException] = None) -> None:
        run, self._run = self._run, None
        if run is None:
            return say_switched_off(self.report, reason, exc_info)
        switch_off(run, reason, exc_info)
        self._undo_steering()

    def _undo_steering(self) -> None:
        """What the adapter changed in its framework for the policy and must give back once switched off."""
