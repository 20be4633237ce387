"""The one place that knows how to find the DeepSpeed engine and read or steer its counters.

It never imports deepspeed: the engine is recognised by what it has, so wrappers, older and
newer releases are handled alike, and a missing piece is reported instead of crashing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple


def spread_across_ranks(values: Sequence[int], device: Any = "cpu") -> List[Tuple[int, int]]:
    """(lowest, highest) of each of ``values`` over every rank of the run: one all-reduce, on every rank.

    A single process, or a run without a process group, gets its own values back.
    """
    values = [int(v) for v in values]
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return [(v, v) for v in values]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [(v, v) for v in values]
    # The highest of v and of -v in one call: -(highest of -v) is the lowest.
    both = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    found = both.tolist()
    n = len(values)
    return [(-found[n + i], found[i]) for i in range(n)]


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` looks like a DeepSpeed engine (it has the counters stepsync reads)."""
    return obj is not None and hasattr(obj, "global_steps") and hasattr(obj, "micro_steps")


@dataclass(frozen=True)
class EngineFacts:
    """What stepsync learned about the engine once, at ``on_train_begin``.

    Attributes:
        gradient_accumulation_steps: the engine's own G (None if it does not say).
        can_override_boundary: ``set_gradient_accumulation_boundary`` exists and is allowed.
        why_not: why the boundary cannot be overridden, when it cannot.
        managed_accumulation: DeepSpeed's ``managed_gradient_accumulation`` (True when it has none).
    """

    gradient_accumulation_steps: Optional[int]
    can_override_boundary: bool
    why_not: str = ""
    managed_accumulation: bool = True


def engine_facts(engine: Any) -> EngineFacts:
    gas = getattr(engine, "gradient_accumulation_steps", None)
    gas = gas() if callable(gas) else gas
    managed = getattr(engine, "managed_gradient_accumulation", None)
    managed = bool(managed()) if callable(managed) else True
    if not callable(getattr(engine, "set_gradient_accumulation_boundary", None)):
        return EngineFacts(gas, False, "this engine has no set_gradient_accumulation_boundary (DeepSpeed < 0.5.8?)",
                           managed)
    if not managed:
        return EngineFacts(gas, False, "DeepSpeed's managed_gradient_accumulation is false: every step() is a boundary",
                           managed)
    return EngineFacts(gas, True)


class BoundaryOverride:
    """Sets the engine's accumulation boundary through DeepSpeed's public API and restores it."""

    __slots__ = ("_active", "_last", "_saved", "engine")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._saved = getattr(engine, "_is_gradient_accumulation_boundary", None)
        self._active = False
        self._last: Optional[bool] = None

    def set(self, is_boundary: bool) -> None:
        # DeepSpeed keeps the value until it is set again (its own overrides restore it): skip repeats.
        if self._active and is_boundary is self._last:
            return
        self.engine.set_gradient_accumulation_boundary(is_boundary)
        self._active, self._last = True, is_boundary

    def restore(self) -> None:
        """Give the decision back to the engine (or to whoever held it before)."""
        if self._active:
            self.engine.set_gradient_accumulation_boundary(self._saved)
            self._active, self._last = False, None
