"""Every error stepsync raises on purpose; each message names the fix, and all share one base."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .events import DriftEvent, LostGradients, NonFiniteUpdate, RanksApart, SkippedUpdate, UnsyncedUpdate


class StepSyncError(Exception):
    """The base of every error stepsync raises on purpose: catch this one name. A failure inside stepsync that is
    not one of these is a fault, which never reaches training unless the policy is ``raise``."""


class StepDriftError(StepSyncError, RuntimeError):
    """Raised by policy ``'raise'`` at the first divergence, or before the first micro-batch where the forecast says
    the counts will part (``event.where == "forecast"``); carries the :class:`DriftEvent`."""

    def __init__(self, event: DriftEvent, message: str = "") -> None:
        self.event = event
        super().__init__(message or event.message())


class UpdateSkippedError(StepSyncError, RuntimeError):
    """Raised by policy ``'raise'`` at the first update the engine counted but did not apply because a gradient
    was not finite (not at fp16's loss-scale search); carries the :class:`SkippedUpdate`."""

    def __init__(self, skip: SkippedUpdate) -> None:
        self.skip = skip
        super().__init__(f"the DeepSpeed engine skipped {skip}; policy 'raise' stops before another update: find the "
                         "micro-batch whose loss is not finite in that window")


class NonFiniteUpdateError(StepSyncError, FloatingPointError):
    """Raised by policy ``'raise'`` at the first update after which the weights are not finite (an engine that
    does not check its gradients applied a non-finite one); carries the :class:`NonFiniteUpdate`."""

    def __init__(self, update: NonFiniteUpdate) -> None:
        self.update = update
        super().__init__(f"{update}; policy 'raise' stops before another update: find the micro-batch whose loss "
                         "is not finite")


class RanksApartError(StepSyncError, RuntimeError):
    """Raised by policy ``'raise'`` on every rank together where the ranks' copies of the weights are found to differ;
    carries the :class:`RanksApart`."""

    def __init__(self, apart: RanksApart) -> None:
        self.apart = apart
        super().__init__(f"{apart}; policy 'raise' stops every rank here: resume from a checkpoint saved before "
                         "they parted")


class GradientsLostError(StepSyncError, RuntimeError):
    """Raised by policy ``'raise'`` before an update that would leave out micro-batches the loop gave it (several
    backward() calls per step() on ZeRO 1 and 2); carries the :class:`LostGradients`. Nothing of it was applied."""

    def __init__(self, lost: LostGradients) -> None:
        self.lost = lost
        super().__init__(f"{lost}; policy 'raise' stopped before that update: call "
                         "engine.set_gradient_accumulation_boundary(i == last) before each backward(), or use "
                         "policy='sync'")


class GradientSyncError(StepSyncError, RuntimeError):
    """Raised by policy ``'raise'`` before an update whose gradients are not those of the window the loop closed,
    because of where the gradient sync was on (FSDP2's ``set_requires_gradient_sync``, DDP's ``no_sync()``);
    carries the :class:`UnsyncedUpdate`. Nothing of it was applied."""

    def __init__(self, found: UnsyncedUpdate) -> None:
        self.found = found
        super().__init__(f"{found}; policy 'raise' stopped before that update, or use policy='sync'")


class LossNormalisationError(StepSyncError, RuntimeError):
    """Raised by policy ``'raise'`` before the update of the first window whose trained tokens the loss weighs
    otherwise than declared (a mean per micro-batch where a token mean is meant, or a sum); carries the
    :class:`TokenWeighting` (None on a rank whose own window was right, stopped with the others). Nothing of that
    window was applied."""

    def __init__(self, weighting: Any) -> None:  # a core.tokens.TokenWeighting (core.tokens imports this module)
        self.weighting = weighting
        found = weighting.message() if weighting is not None else "another rank's window weighs its trained tokens " \
            "otherwise than declared (that rank's log names it)"
        super().__init__(f"loss normalisation: {found}; policy 'raise' stopped every rank before that window's "
                         "update")


class UnsafeCheckpointError(StepSyncError, RuntimeError):
    """Raised by policy ``'raise'`` where a checkpoint cannot be resumed exactly (saved inside a window, or resumed
    elsewhere than it was saved)."""


class StepSyncConfigError(StepSyncError, ValueError):
    """A configuration or an argument that stepsync cannot serve; raised before any training step runs."""


class UnsupportedVersion(StepSyncError, ValueError):
    """A release older than any stepsync measured; the message names the supported range."""


class ConfigInputError(StepSyncError, ValueError):
    """An input ``stepsync check`` cannot use; the message says what to change."""


class UnreadableFileError(StepSyncError, ValueError):
    """A file stepsync was pointed at (a JSON config, a record) that it cannot read; the message names the fix."""


class VerifyInputError(StepSyncError, ValueError):
    """A config ``stepsync verify`` cannot run; the message says why."""


class AuditInputError(StepSyncError, ValueError):
    """The path ``stepsync inspect`` was given is not a Trainer output directory; the message names the fix."""
