"""stepsync: keep transformers' Trainer and the DeepSpeed engine agreeing on the optimizer step count.

``import stepsync`` is light: it imports neither torch nor deepspeed. ``StepSyncCallback``
imports transformers when first used.
"""
from ._version import __version__
from .choices import Policy
from .forecast import EpochForecast, Forecast, RunPlan, forecast
from .report import Cause, DriftEvent, StepDriftError, StepSyncConfigError, SyncReport
from .versions import Stack, behaviour_of

__all__ = [
    "Cause", "DriftEvent", "EpochForecast", "Forecast", "Policy", "RunPlan", "Stack", "StepDriftError",
    "StepSyncCallback", "StepSyncConfigError", "SyncReport", "__version__", "behaviour_of", "forecast",
]


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name == "StepSyncCallback":
        try:
            from .callback import StepSyncCallback
        except ImportError as exc:  # the light install (stepsync check / inspect only)
            raise ImportError(f"StepSyncCallback needs transformers ({exc}): it runs inside your Trainer's "
                              "environment; pip install 'stepsync[trainer]' to install the training packages") from exc
        return StepSyncCallback
    raise AttributeError(f"module 'stepsync' has no attribute {name!r}")
