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
