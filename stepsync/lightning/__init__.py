"""The adapter for PyTorch Lightning on DeepSpeed: ``from stepsync.lightning import StepSyncCallback`` for the
Lightning Trainer, ``stepsync.lightning.watch(fabric, model, optimizer)`` for a Fabric loop.

Importing it imports Lightning; ``import stepsync`` and the command line never do.
"""
from ..core.install import training_install_hint

try:
    from .callback import StepSyncCallback
    from .fabric import FabricWatch, watch
except ImportError as exc:
    if (exc.name or "").split(".")[0] not in ("lightning", "pytorch_lightning", "torch", "deepspeed"):
        raise
    raise ImportError(f"stepsync.lightning needs Lightning, torch and DeepSpeed ({exc}): "
                      f"{training_install_hint('lightning')}") from exc

__all__ = ["FabricWatch", "StepSyncCallback", "watch"]
