"""stepsync: keep transformers' Trainer and the DeepSpeed engine agreeing on the optimizer step count.

``import stepsync`` is light: it imports neither torch, transformers nor deepspeed, and each public name
is loaded on first use. ``StepSyncCallback`` needs transformers (the training environment); the
forecast, the report and the command line's ``check`` and ``inspect`` do not.
"""
from ._version import __version__ as __version__

# public name -> the module that defines it (loaded on first use)
_PUBLIC = {
    "Policy": "core.choices",
    "EpochForecast": "core.prediction", "Forecast": "core.prediction", "forecast": "core.forecast",
    "RunPlan": "core.plan",
    "Cause": "core.events", "DriftEvent": "core.events",
    "StepSyncError": "core.errors", "StepDriftError": "core.errors", "StepSyncConfigError": "core.errors",
    "UpdateSkippedError": "core.errors", "SkippedUpdate": "core.events",
    "NonFiniteUpdateError": "core.errors", "NonFiniteUpdate": "core.events", "UnsafeCheckpointError": "core.errors",
    "RanksApartError": "core.errors", "RanksApart": "core.events",
    "LossNormalisationError": "core.errors", "Normalisation": "core.tokens", "TokenWeighting": "core.tokens",
    "GradientsLostError": "core.errors", "GradientSyncError": "core.errors", "UnsyncedUpdate": "core.events",
    "UnsupportedVersion": "core.errors", "ConfigInputError": "core.errors",
    "UnreadableFileError": "core.errors", "VerifyInputError": "core.errors", "AuditInputError": "core.errors",
    "SyncReport": "core.report",
    "Stack": "core.versions", "behaviour_of": "core.versions",
    "StepSyncCallback": "trainer.callback",
    "watch": "tools.watching", "LoopWatch": "accelerate.watch", "EngineWatch": "deepspeed.watch",
    "ShardedWatch": "fsdp.watch",
    "resume_settings": "tools.elastic", "ResumeSettings": "tools.elastic",
}

__all__ = sorted([*_PUBLIC, "__version__"])


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'stepsync' has no attribute {name!r}")
    from importlib import import_module

    try:
        value = getattr(import_module(f".{module}", __name__), name)
    except ImportError as exc:
        install = import_module(".core.install", __name__)  # loaded as the public names are
        if name == "StepSyncCallback":  # the light install (stepsync check / inspect only)
            raise ImportError(f"StepSyncCallback needs transformers ({exc}): it runs inside your Trainer's "
                              f"environment; {install.training_install_hint('trainer')}") from exc
        raise ImportError(f"stepsync needs {exc.name or 'a package'} ({exc}): {install.install_hint()}") from exc
    globals()[name] = value  # found once, then a plain attribute
    return value
