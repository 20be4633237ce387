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
        counts_skips: the engine keeps ``skipped_steps``, the updates it counted but did not apply.
        skips_by_design: fp16 with a dynamic loss scale, which skips updates while it searches for a scale.
        gradient_clipping: the clip norm the engine applies (0: none; None if it does not say).
    """

    gradient_accumulation_steps: Optional[int]
    can_override_boundary: bool
    why_not: str = ""
    managed_accumulation: bool = True
    counts_skips: bool = True
    skips_by_design: bool = False
    gradient_clipping: Optional[float] = None


def _asked(engine: Any, name: str) -> Any:
    """``engine.name()``, or None when the engine has no such call."""
    value = getattr(engine, name, None)
    return value() if callable(value) else None


def engine_facts(engine: Any) -> EngineFacts:
    gas = getattr(engine, "gradient_accumulation_steps", None)
    gas = gas() if callable(gas) else gas
    managed = _asked(engine, "managed_gradient_accumulation")
    managed = True if managed is None else bool(managed)
    why_not = ""
    if not callable(getattr(engine, "set_gradient_accumulation_boundary", None)):
        why_not = "this engine has no set_gradient_accumulation_boundary (DeepSpeed < 0.5.8?)"
    elif not managed:
        why_not = "DeepSpeed's managed_gradient_accumulation is false: every step() is a boundary"
    clip = _asked(engine, "gradient_clipping")
    searches_a_scale = bool(_asked(engine, "fp16_enabled")) and bool(_asked(engine, "dynamic_loss_scale"))
    return EngineFacts(gas, not why_not, why_not, managed,
                       counts_skips=isinstance(getattr(engine, "skipped_steps", None), int),
                       skips_by_design=searches_a_scale,
                       gradient_clipping=float(clip) if isinstance(clip, (int, float)) else None)


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
