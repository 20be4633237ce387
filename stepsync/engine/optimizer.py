"""The updates of a run without DeepSpeed (DDP, FSDP, one device): the steps its torch optimizer takes.

A :class:`~stepsync.engine.run.Run` reads an :class:`OptimizerSteps` where it reads an engine's ``global_steps``: the
framework's count is held against the updates really made, and a step fp16's GradScaler skips is not one.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from .deepspeed import EngineFacts

NOT_AN_ENGINE = "the run has no DeepSpeed engine: its optimizer steps where the framework counts an update"
UNCHECKED = ("a torch optimizer applies every gradient it is given, finite or not (torch.nn.utils.clip_grad_norm_(..., "
             "error_if_nonfinite=True) before optimizer.step() stops at the first that is not)")


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
        facts: what a run learns of it: no boundary to steer, no skip counter, no ZeRO stage or precision; the
            data-parallel ranks of the process group.
        module: the model the framework trains, where the adapter gives it (the checks that read its output and
            each token's weight hook it); None elsewhere.
        device: where the model's parameters are (a collective across ranks runs there).

    ``reads_weights``: every rank calls the run's epoch ends and checkpoints together (a loop the watch sees whole),
    so the weights are read there: whether they are finite (the optimizer applies every gradient), and the ranks'
    copies compared (its facts say both).
    """

    __slots__ = ("global_steps", "_handle", "module", "facts", "device", "_boundary")

    def __init__(self, optimizer: Any, start: int, module: Any = None,
                 boundary: Optional[Callable[[], bool]] = None, reads_weights: bool = False) -> None:
        self.global_steps = start
        self._handle = optimizer.register_step_post_hook(self._stepped)
        self.module, self._boundary = module, boundary
        self.facts = EngineFacts(None, False, NOT_AN_ENGINE, counts_skips=False, deepspeed=False,
                                 data_parallel_size=_ranks(), unchecked_gradients=UNCHECKED if reads_weights else "",
                                 compares_ranks=reads_weights)
        parameter = next(iter(getattr(module, "parameters", lambda: ())()), None)
        self.device = getattr(parameter, "device", "cpu")

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.global_steps += 1

    def stop_counting(self) -> None:
        self._handle.remove()

    @property
    def tells_its_windows(self) -> bool:
        """The framework says, at each backward, whether it closes its window (the token check needs it)."""
        return self._boundary is not None and self.module is not None

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the running backward closes the framework's window, as the framework says."""
        return bool(self._boundary()) if self._boundary is not None else False

    def register_forward_hook(self, hook: Callable[..., Any]) -> Any:
        """A forward hook on the model (as on a DeepSpeed engine, which is the model's wrapper)."""
        return self.module.register_forward_hook(hook)


def _ranks() -> int:
    """The ranks of the default process group (1 without one); torch is imported only where it is loaded."""
    import sys

    dist = getattr(sys.modules.get("torch"), "distributed", None)
    return dist.get_world_size() if dist is not None and dist.is_available() and dist.is_initialized() else 1


def count_optimizer_steps(optimizer: Any, start: int, module: Any = None,
                          boundary: Optional[Callable[[], bool]] = None,
                          reads_weights: bool = False) -> Optional[OptimizerSteps]:
    """An :class:`OptimizerSteps` on the torch optimizer inside ``optimizer``, or None where there is none;
    ``module``, ``boundary`` and ``reads_weights``: as :class:`OptimizerSteps` takes them, for the checks that need
    them."""
    inner = innermost_optimizer(optimizer)
    return OptimizerSteps(inner, start, module, boundary, reads_weights) if inner is not None else None
