"""What a failure inside stepsync changes, in every adapter alike. Steering reads only counters that are equal on
every rank, so a fault there is the same on every rank and switches stepsync off everywhere, giving DeepSpeed its
own boundary back; observing (checks, events, messages, metrics, records) is where one rank's disk, terminal or
handlers fail alone, so a fault there ends observing on that rank only and the policy keeps steering. Only policy
'raise' lets either reach the user's code."""
from __future__ import annotations

import functools
from typing import Any, Optional

from ..core.choices import Policy
from ..core.errors import StepSyncError
from .lifecycle import say_switched_off
from .run import Run


def switch_off(run: Run, reason: str, exc_info: Optional[BaseException] = None) -> None:
    """Stop everything: observing and steering; the engine decides its boundary again. Where the engine refuses
    that too (its boundary setter is what failed), the same one message says so."""
    run.observing = False
    if not run.facts.deepspeed:
        run.engine.stop_counting()
    try:
        run.action.end(run)
    except Exception as exc:
        reason = (f"{reason}; DeepSpeed's own boundary could not be given back ({exc!r}): the engine keeps the last "
                  "boundary stepsync set")
    say_switched_off(run.report, run.policy, reason, exc_info)


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
            except StepSyncError:
                raise
            except Exception as exc:
                return self._failed(hook.__name__.lstrip("_"), exc, steering)

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
        if steering or self.policy.stops:
            self._switch_off(f"internal error in {hook}: {exc!r}", exc_info=exc)
            if self.policy.stops:
                raise exc
            return
        if self._run is not None:
            self._run.stop_observing(hook, exc)

    def _observe(self, where: str, observation, *args) -> None:
        """An observation of the adapter's own (its metrics): a fault in it ends only the observing."""
        try:
            observation(*args)
        except StepSyncError:
            raise
        except Exception as exc:
            self._failed(where, exc, False)

    def _switch_off(self, reason: str, exc_info: Optional[BaseException] = None) -> None:
        run, self._run = self._run, None
        if run is None:
            return say_switched_off(self.report, self.policy, reason, exc_info)
        switch_off(run, reason, exc_info)
        self._undo_steering()

    def _undo_steering(self) -> None:
        """What the adapter changed in its framework for the policy and must give back once switched off."""
