"""The adapter for PyTorch Lightning on DeepSpeed: ``from stepsync.lightning import StepSyncCallback`` for the
Lightning Trainer, ``stepsync.lightning.watch(fabric, model, optimizer)`` for a Fabric loop.

Importing it imports Lightning; ``import stepsync`` and the command line never do.
"""
from ..core.install import install_hint

try:
    from .callback import StepSyncCallback
    from .fabric import FabricWatch, watch
except ImportError as exc:
    if (exc.name or "").split(".")[0] not in ("lightning", "pytorch_lightning", "torch", "deepspeed"):
        raise
    raise ImportError(f"stepsync.lightning needs Lightning, torch and DeepSpeed ({exc}): pip install torch first "
                      f"(pip install torch==2.13.0 is a CPU build), then {install_hint('lightning')}") from exc

__all__ = ["FabricWatch", "StepSyncCallback", "watch"]
