"""What a run says: notes, warnings and errors (into its report, and through the ``stepsync`` logger where the
framework's own logs go), the forecast at the start and the summary at the end (also as text in the run's trackers),
and an alert in them at each kind of finding policy 'raise' stops on."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from ..core.prediction import Forecast
from ..core.tracking import FORECAST_TEXT, SUMMARY_TEXT, forecast_text, run_metrics, summary_text
from ..display import render
from ..display.output import logger
from .trackers import Tracking

if TYPE_CHECKING:  # pragma: no cover
    from ..core.events import DriftEvent
    from ..core.report import SyncReport


class Voice:
    """The run's voice: every note, warning and error goes into the report, and is said where this rank speaks.

    Attributes:
        tracking: the run's trackers (:mod:`stepsync.engine.trackers`; none unless its adapter found some).
        counts: the framework's count and the updates made, as the run last read them (set by the run).
    """

    __slots__ = ("report", "is_main", "output", "tracking", "counts")

    def __init__(self, report: SyncReport, is_main: bool, output: Any) -> None:
        self.report = report
        self.is_main = is_main
        self.output = output
        self.tracking = Tracking()
        self.counts: Optional[Callable[[], Tuple[int, int]]] = None  # both counts as the run last read them

    def note(self, text: str) -> None:
        self.report.notes.append(text)
        if self.is_main:
            logger.info("%s", text)

    def running_note(self, index: Optional[int], text: str) -> int:
        """A note that one finding keeps up to date (how many times it recurred, where last): ``text`` replaces the
        note at ``index`` (None: a new one), so the report stays bounded; logged at DEBUG. Returns its index."""
        logger.debug("%s", text)
        notes = self.report.notes
        if index is None:
            notes.append(text)
            return len(notes) - 1
        notes[index] = text
        return index

    def not_checked(self, text: str) -> None:
        """What could not be told: kept in the report, logged at DEBUG; nothing for the user to do."""
        self.report.not_checked.append(text)
        logger.debug("%s", text)

    def warn(self, text: str) -> None:
        self.report.notes.append(text)
        if self.is_main:
            logger.warning("%s", text)

    def error(self, text: str) -> None:
        self.report.notes.append(text)
        logger.error("%s", text)

    def finding(self, kind: str, text: str) -> None:
        """A finding policy 'raise' stops on, said as a warning and alerted (once per ``kind``)."""
        self.warn(text)
        self.alert(kind, text)

    def drift(self, event: DriftEvent) -> None:
        """A change of the drift with a cause not said before: a warning and its panel where this rank speaks."""
        if self.is_main:
            logger.warning("%s", event.message())
            self.output.show(render.drift_panel, event, logging.WARNING)
            self.alert(f"drift ({event.cause.value})", event.message())

    def drift_went_on(self, epoch: int, event: DriftEvent, changes: int) -> None:
        """An epoch in which a drift said once changed again: its sum, once an epoch."""
        if self.is_main:
            logger.warning("epoch %d ends with step drift %+d: %d more change(s) in this epoch with the cause said at "
                           "epoch %d, micro-batch %d (%s)", epoch, event.last_drift, changes, event.epoch,
                           event.micro_batch, event.cause.value)

    def differs_from_the_forecast(self, text: str, why: str) -> None:
        """An epoch's counts the forecast did not predict: said at the first (the report keeps every one)."""
        if self.is_main:
            logger.warning("%s; %s", text, why)

    def stopped_observing(self, policy: str, reason: str, exc: BaseException) -> None:
        logger.error("stopped observing this run on this rank (no more checks, messages or metrics); its policy "
                     "'%s' goes on acting on training as on every other rank. %s", policy, reason, exc_info=exc)

    def announce(self, predicted: Forecast) -> None:
        """The forecast at the start: its verdict, its table, and an early end said as a warning."""
        self.report.forecast = predicted
        if self.is_main:
            logger.info("forecast: %s", predicted.verdict())
            self.output.show(render.forecast_view, predicted, logging.INFO)
            if self.tracking:
                self.tracking.text(FORECAST_TEXT, forecast_text(predicted), predicted.plan.trainer_steps_at_start)
        early = predicted.ends_early()
        if early:
            self.warn(early)

    def summarize(self) -> None:
        """The summary at the end, once."""
        if self.is_main:
            report = self.report
            logger.info("%s counted %d updates, %s made %s (drift %+d)", report.counter,
                        report.trainer_steps, report.updater, report.made(), report.drift)
            self.output.show(render.summary_view, report, logging.INFO)
            if self.tracking:
                if self.tracking.sends_last_metrics:
                    self.tracking.metrics(run_metrics(report, report.trainer_steps), report.trainer_steps)
                self.tracking.text(SUMMARY_TEXT, summary_text(report), report.trainer_steps)

    def alert(self, kind: str, text: str) -> None:
        """A finding policy 'raise' stops on, in trackers that alert: once per ``kind``, where this rank speaks;
        the metrics with it where they go from here, at both counts as the run last read them."""
        if self.is_main and self.tracking:
            self.tracking.alert(kind, text)
            if self.counts is not None:
                self.track(*self.counts())

    def track(self, counted: int, made: Optional[int] = None) -> None:
        """The run's metrics, at the framework's count ``counted`` (``made``: the updates made, default the
        report's), where they go to the trackers from here."""
        if self.is_main and self.tracking.sends_metrics and self.tracking:
            self.tracking.metrics(run_metrics(self.report, counted, made), counted)
