"""The adapter for PyTorch Lightning on DeepSpeed: ``from stepsync.lightning import StepSyncCallback`` for the
Lightning Trainer, ``stepsync.lightning.watch(fabric, model, optimizer)`` for a Fabric loop.

Importing it imports Lightning; ``import stepsync`` and the command line never do.
"""
from .callback import StepSyncCallback
from .fabric import FabricWatch, watch

__all__ = ["FabricWatch", "StepSyncCallback", "watch"]
