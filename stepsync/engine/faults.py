"""What a failure inside stepsync changes. Steering reads only counters that are equal on every rank, so a fault
there is the same on every rank and switches stepsync off everywhere; observing (checks, events, messages,
metrics, records) is where one rank's disk, terminal or handlers fail alone, so a fault there ends observing on
that rank only and the policy keeps steering. Policy 'raise' stops the run at either."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..core.choices import Policy
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
