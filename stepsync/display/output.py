"""Where stepsync's messages go: each one reaches each destination once.

The ``stepsync`` logger is the primary channel (files, job logs, rank filters). The rich views add tables
and panels where the Trainer's own logs go; a view is skipped when a logging handler already shows the same
message where the console draws: on the console's own stream (``logging.basicConfig()`` on stderr, or
Python's last-resort handler, which prints warnings to stderr when nothing is configured), or, when the
console draws on a terminal, on any terminal (a ``StreamHandler(sys.stdout)`` as transformers' example
scripts set up, or rich's ``RichHandler``): stdout and stderr of one terminal are one screen.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Optional

from ..core.errors import StepSyncConfigError


class _Prefixed(logging.LoggerAdapter):
    """Every message of the ``stepsync`` logger starts with ``stepsync: ``, whatever format the handler uses."""

    def process(self, msg, kwargs):
        return f"stepsync: {msg}", kwargs


logger = _Prefixed(logging.getLogger("stepsync"), {})


def logging_reaches(stream: Any, logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` on ``logger`` would be shown where ``stream`` shows it: on ``stream``
    itself, or on any terminal when ``stream`` is one."""
    if not logger.isEnabledFor(level):
        return False
    on_screen = _is_terminal(stream)
    current: Optional[logging.Logger] = logger
    handled = False
    while current is not None:
        for handler in current.handlers:
            handled = True
            if level < handler.level:
                continue
            target = _stream_of(handler)
            if target is stream or (on_screen and target is not None and _is_terminal(target)):
                return True
        if not current.propagate:
            break
        current = current.parent
    last = logging.lastResort
    return not handled and last is not None and level >= last.level and (
        stream is sys.stderr or (on_screen and _is_terminal(sys.stderr)))


def _stream_of(handler: logging.Handler) -> Any:
    # A StreamHandler on stderr keeps the stream it was given; the last-resort handler reads sys.stderr anew;
    # rich's RichHandler writes through its own console.
    if isinstance(handler, logging.StreamHandler):
        return getattr(handler, "stream", None)
    console = getattr(handler, "console", None)
    return getattr(console, "file", None) if console is not None and hasattr(console, "print") else None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class ConsoleOutput:
    """The rich console of one watcher on the ranks that speak: ``None`` makes one on stderr, ``False`` draws
    nothing."""

    def __init__(self, console: Any = None) -> None:
        if console is not None and console is not False and not hasattr(console, "print"):
            raise StepSyncConfigError("console must be a rich.console.Console, None or False, got "
                                      f"{type(console).__name__}")
        self.console = console

    def show(self, view: Callable[[Any], Any], data: Any, level: int) -> None:
        """Draw ``view(data)`` (a renderable of :mod:`stepsync.display.render`) unless the logger already said the
        same there."""
        if self.console is False:
            return
        if self.console is None:
            from rich.console import Console

            self.console = Console(stderr=True)
        if logging_reaches(self.console.file, logger.logger, level):
            return
        self.console.print(view(data))
