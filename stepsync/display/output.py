"""Where stepsync's messages go: each one reaches each destination once.

The ``stepsync`` logger is the primary channel (files, job logs, rank filters). The rich views on rank 0
add tables and panels; a view is skipped when a logging handler already writes the same message to the
console's stream (for instance ``logging.basicConfig()`` on stderr, or Python's last-resort handler,
which prints warnings to stderr when nothing is configured).
"""
from __future__ import annotations

import logging
import sys
from typing import Any


def logging_reaches(stream: Any, logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` on ``logger`` would be written to ``stream``."""
    if not logger.isEnabledFor(level):
        return False
    current, handled = logger, False
    while current is not None:
        for handler in current.handlers:
            handled = True
            if level >= handler.level and _stream_of(handler) is stream:
                return True
        if not current.propagate:
            break
        current = current.parent
    last = logging.lastResort
    return not handled and last is not None and level >= last.level and stream is sys.stderr


def _stream_of(handler: logging.Handler) -> Any:
    # A StreamHandler on stderr keeps the stream it was given; the last-resort handler reads sys.stderr anew.
    return getattr(handler, "stream", None) if isinstance(handler, logging.StreamHandler) else None


class ConsoleOutput:
    """The rich console of one watcher on rank 0: ``None`` makes one on stderr, ``False`` draws nothing."""

    def __init__(self, console: Any = None) -> None:
        if console is not None and console is not False and not hasattr(console, "print"):
            raise ValueError(f"console must be a rich.console.Console, None or False, got {type(console).__name__}")
        self.console = console

    def show(self, view: str, data: Any, level: int) -> None:
        """Draw ``view`` (a function of display.render) unless the logger already said the same there."""
        if self.console is False:
            return
        from . import render

        if self.console is None:
            from rich.console import Console

            self.console = Console(stderr=True)
        if logging_reaches(self.console.file, logging.getLogger("stepsync"), level):
            return
        self.console.print(getattr(render, view)(data))
