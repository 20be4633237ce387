"""What a run says: notes, warnings and errors (into its report, and through the ``stepsync`` logger where the
framework's own logs go), the forecast at the start and the summary at the end."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.prediction import Forecast
from ..display import render
from ..display.output import logger

if TYPE_CHECKING:  # pragma: no cover
    from ..core.report import SyncReport
    from ..core.versions import StackBehaviour
    from .deepspeed import EngineFacts


class Messages:
    """The run's voice; :class:`~stepsync.engine.run.Run` has the attributes it reads."""

    __slots__ = ()
    report: SyncReport
    is_main: bool
    output: Any
    n: Optional[int]
    g: int
    facts: EngineFacts
    behaviour: StackBehaviour

    def note(self, text: str) -> None:
        self.report.notes.append(text)
        if self.is_main:
            logger.info("%s", text)

    def warn(self, text: str) -> None:
        self.report.notes.append(text)
        if self.is_main:
            logger.warning("%s", text)

    def error(self, text: str) -> None:
        self.report.notes.append(text)
        logger.error("%s", text)

    def state_what_differs(self, whose_g: str) -> None:
        """Say once, at the start, what makes this run differ from what the forecast assumes."""
        if self.n is None:
            self.note("the train dataloader has no length: no forecast, and 'sync'/'drop_last' cannot plan windows")
        if self.facts.gradient_accumulation_steps not in (None, self.g):
            text = (f"the engine's gradient_accumulation_steps={self.facts.gradient_accumulation_steps} differs "
                    f"from {whose_g} {self.g}: fix the DeepSpeed config (use \"auto\")")
            if self.report.policy is Policy.RAISE:
                raise StepSyncConfigError(f"{text}; policy 'raise' stops before the first micro-batch")
            self.error(text)
        if not self.facts.managed_accumulation:
            self.note("DeepSpeed's managed_gradient_accumulation is false: the engine updates at every step() call, "
                      "not at its own boundaries; the forecast assumes managed accumulation and will differ")
        for caveat in self.behaviour.caveats:
            self.note(caveat)

    def announce(self, predicted: Forecast) -> None:
        """The forecast at the start: its verdict, its table, and an early end said as a warning."""
        self.report.forecast = predicted
        if self.is_main:
            logger.info("forecast: %s", predicted.verdict())
            self.output.show(render.forecast_view, predicted, logging.INFO)
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
