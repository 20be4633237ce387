"""The updates of a run without DeepSpeed (DDP, FSDP, one device): the steps its torch optimizer takes.

A :class:`~stepsync.engine.run.Run` reads an :class:`OptimizerSteps` where it reads an engine's ``global_steps``: the
framework's count is held against the updates really made, and a step fp16's GradScaler skips is not one.
"""
from __future__ import annotations

from typing import Any, Optional

from .deepspeed import EngineFacts

NOT_AN_ENGINE = "the run has no DeepSpeed engine: its optimizer steps where the framework counts an update"


def innermost_optimizer(optimizer: Any) -> Optional[Any]:
    """The torch optimizer inside accelerate's and the Trainer's wrappers (``.optimizer`` each), or None."""
    for _ in range(8):  # wrappers nest a few deep; a cycle must not loop forever
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer if callable(getattr(optimizer, "register_step_post_hook", None)) else None


class OptimizerSteps:
    """Counts the steps of a torch optimizer from ``start`` (the framework's count when training begins) through a
    step post-hook; :meth:`stop_counting` removes it.

    Attributes:
        global_steps: ``start`` plus every step the optimizer took since.
        facts: what a run learns of it: no boundary to steer, no skip counter, no ZeRO stage or precision.
    """

    __slots__ = ("global_steps", "_handle")
    facts = EngineFacts(None, False, NOT_AN_ENGINE, counts_skips=False, deepspeed=False)

    def __init__(self, optimizer: Any, start: int) -> None:
        self.global_steps = start
        self._handle = optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.global_steps += 1

    def stop_counting(self) -> None:
        self._handle.remove()


def count_optimizer_steps(optimizer: Any, start: int) -> Optional[OptimizerSteps]:
    """An :class:`OptimizerSteps` on the torch optimizer inside ``optimizer``, or None where there is none."""
    inner = innermost_optimizer(optimizer)
    return OptimizerSteps(inner, start) if inner is not None else None
