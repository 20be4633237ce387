"""The adapter for PyTorch Lightning on DeepSpeed: ``from stepsync.lightning import StepSyncCallback``.

Importing it imports Lightning; ``import stepsync`` and the command line never do.
"""
from .callback import StepSyncCallback

__all__ = ["StepSyncCallback"]
