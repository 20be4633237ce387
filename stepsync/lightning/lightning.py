"""What the Lightning adapter must know of Lightning: its DeepSpeed engine, the shape of its epochs, where a
resumed run stands, its scheduler, and how an epoch is made to end after its whole windows. Nothing here
imports Lightning at load time."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

from ..core.frameworks import LIGHTNING
from ..core.relayout import Layout
from ..engine.deepspeed import is_engine
from ..engine.trackers import MLflowRun, OpenedBy, TensorBoardWriter, Tracker, WandbRun


def uses_deepspeed(strategy: Any) -> bool:
    """Whether a Lightning Trainer's or Fabric's strategy is one of Lightning's DeepSpeed strategies."""
    return strategy is not None and "deepspeed" in type(strategy).__name__.lower()


def deepspeed_engine(trainer: Any) -> Optional[Any]:
    """The DeepSpeed engine of a Lightning Trainer (its DeepSpeedStrategy keeps it as ``model``), or None."""
    strategy = getattr(trainer, "strategy", None)
    if not uses_deepspeed(strategy):
        return None
    engine = getattr(strategy, "model", None)
    return engine if is_engine(engine) else None


def fabric_engine(fabric: Any, model: Any) -> Optional[Any]:
    """The DeepSpeed engine behind a model ``fabric.setup`` returned (its ``_forward_module``), or None."""
    engine = getattr(model, "_forward_module", None)
    return engine if uses_deepspeed(getattr(fabric, "strategy", None)) and is_engine(engine) else None


def window_ends(trainer: Any) -> Optional[Callable[[], bool]]:
    """Whether Lightning steps its optimizer after the running micro-batch, read at its backward: its epoch loop's
    own test (``_should_accumulate``, false at every G-th batch of an epoch and at its last); None where the loop has
    none."""
    should_accumulate = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "_should_accumulate",
                                None)
    return None if not callable(should_accumulate) else lambda: not should_accumulate()


def zero_stage(strategy: Any) -> Optional[int]:
    """The ZeRO stage in a Lightning DeepSpeed strategy's config (the Trainer's or Fabric's), or None."""
    config = getattr(strategy, "config", None) or {}
    stage = (config.get("zero_optimization") or {}).get("stage")
    return int(stage) if isinstance(stage, int) else None


def batches_per_epoch(trainer: Any) -> Optional[int]:
    """Micro-batches Lightning runs in an epoch on one rank (``limit_train_batches`` applied); None when unknown."""
    n = trainer.num_training_batches
    return int(n) if isinstance(n, (int, float)) and not math.isinf(n) and n > 0 else None


def data_layout(trainer: Any, g: int) -> Optional[Layout]:
    """How the train dataloader splits the data: the ranks a distributed sampler shards it over (1 where every rank
    reads all of it), its batch size and the dataset's length; None where the dataloader does not say."""
    loader = getattr(trainer, "train_dataloader", None)
    batch = getattr(loader, "batch_size", None)
    try:
        examples = len(loader.dataset)  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        return None
    if not isinstance(batch, int) or batch < 1 or examples < 1:
        return None
    sharded = "distributed" in type(getattr(loader, "sampler", None)).__name__.lower()
    return Layout(int(trainer.world_size) if sharded else 1, batch, g, examples)


def keeps_its_place(trainer: Any) -> bool:
    """The train dataloader saves and restores its position (``state_dict``/``load_state_dict``): Lightning then
    resumes inside an epoch where it stood, instead of restarting the epoch's order."""
    loader = getattr(trainer, "train_dataloader", None)
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def end_epochs_after(trainer: Any, batches: int) -> None:
    """Make every epoch end after ``batches`` micro-batches: the number Lightning's loop ends an epoch at, as its
    own ``limit_train_batches`` sets it (kept in ``fit_loop.max_batches``, which ``num_training_batches`` reads)."""
    trainer.fit_loop.max_batches = batches


def scheduler_steps(trainer: Any) -> Optional[int]:
    """How many times Lightning stepped the LR scheduler (its ``last_epoch``), or None without one."""
    configs = getattr(trainer, "lr_scheduler_configs", None) or []
    steps = getattr(configs[0].scheduler, "last_epoch", None) if configs else None
    return steps if isinstance(steps, int) else None


def scale_the_loss_once(engine: Any) -> Optional[int]:
    """Make DeepSpeed divide the loss by 1 instead of G (Lightning already divides it by G), through its public
    ``set_train_batch_size``; the engine's updates are then set by its boundary alone. Returns the train batch
    size to give back, or None when the engine has no such call."""
    setter = getattr(engine, "set_train_batch_size", None)
    if not callable(setter):
        return None
    before = engine.train_batch_size()
    setter(engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)
    return before


# Lightning puts gradient_clip_val into the DeepSpeed config only where the config has no gradient_clipping.
CLIP_FIX = "remove \"gradient_clipping\" from the DeepSpeed config (Lightning then passes gradient_clip_val)"


def asked_clip(trainer: Any) -> Optional[float]:
    """The clip norm asked of Lightning's Trainer (``gradient_clip_val``), or None where none was asked."""
    value = getattr(trainer, "gradient_clip_val", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def add_metrics(module: Any, lightning_steps: int, engine_steps: int, updates: Optional[dict] = None) -> None:
    """Both counts and the drift (and what the updates did, once there is something to say), through Lightning's
    own ``log`` (its loggers and ``callback_metrics``)."""
    counted, engine, drift = LIGHTNING.metric_keys
    metrics = {counted: float(lightning_steps), engine: float(engine_steps),
               drift: float(lightning_steps - engine_steps)}
    metrics.update((key, float(value)) for key, value in (updates or {}).items())
    module.log_dict(metrics, on_step=True, on_epoch=False)


class LightningLoggers(OpenedBy):
    """The loggers of a Lightning ``Trainer`` or of ``Fabric`` (``owner.loggers``): texts and alerts through each
    one's ``experiment``, metrics (those Lightning's own ``log`` does not carry) through its ``log_metrics``."""

    def __init__(self, owner: Any) -> None:
        super().__init__()
        self.owner = owner

    def metrics(self, values: Dict[str, float], step: int) -> None:
        for each in getattr(self.owner, "loggers", None) or ():
            each.log_metrics(dict(values), step)

    def opened(self) -> List[Tracker]:
        found: List[Tracker] = []
        for each in getattr(self.owner, "loggers", None) or ():
            name = type(each).__name__
            if name == "TensorBoardLogger":
                found.append(TensorBoardWriter(each.experiment))
            elif name == "MLFlowLogger":
                found.append(MLflowRun(each.experiment, each.run_id))
            elif name == "WandbLogger":
                found.append(WandbRun(each.experiment))
        return found
