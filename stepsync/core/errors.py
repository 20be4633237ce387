"""Every error stepsync raises; each message names the fix."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .events import DriftEvent


class StepDriftError(RuntimeError):
    """Raised by policy ``'raise'`` at the first divergence; carries the :class:`DriftEvent`."""

    def __init__(self, event: DriftEvent) -> None:
        self.event = event
        super().__init__(event.message())


class StepSyncConfigError(ValueError):
    """A configuration that stepsync cannot serve; raised before any training step runs."""


class UnsupportedVersion(ValueError):
    """A release older than any stepsync measured; the message names the supported range."""


class ConfigInputError(ValueError):
    """An input ``stepsync check`` cannot use; the message says what to change."""


class AuditInputError(ValueError):
    """The path ``stepsync inspect`` was given is not a Trainer output directory; the message names the fix."""
