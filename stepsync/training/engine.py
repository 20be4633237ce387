"""The one place that knows how to find the DeepSpeed engine and read or steer its counters.

It never imports deepspeed: the engine is recognised by what it has, so wrappers, older and
newer releases are handled alike, and a missing piece is reported instead of crashing.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

_MAX_FRAMES = 12  # Trainer -> CallbackHandler.on_x -> call_event -> our hook, plus subclasses' overrides


def _calling_frames(depth: int):
    """The frames above the caller of the function that calls this, nearest first, at most ``_MAX_FRAMES``."""
    frame = sys._getframe(depth + 1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def find_trainer(callback: Any) -> Optional[Any]:
    """The Trainer whose callback handler holds ``callback``, found on the calling stack.

    Called from inside a hook, so the Trainer (or a subclass) is a few frames up; matching on its
    ``callback_handler`` finds the right one even with nested Trainers.
    """
    for frame in _calling_frames(1):
        candidate = frame.f_locals.get("self")
        handler = getattr(candidate, "callback_handler", None)
        if handler is not None and any(cb is callback for cb in getattr(handler, "callbacks", ())):
            return candidate
    return None


def callback_being_restored(cls: type) -> Optional[Any]:
    """The instance of ``cls`` that the Trainer's ``_load_callback_state`` is rebuilding right now, or None.

    That method calls ``type(callback)(**saved_args)`` with the old instance in its local ``callback``.
    """
    frame = sys._getframe(2)  # our caller is cls.__new__; its caller is the one that called cls(...)
    if frame is None or frame.f_code.co_name != "_load_callback_state":
        return None
    candidate = frame.f_locals.get("callback")
    return candidate if type(candidate) is cls else None


def resume_checkpoint(trainer: Any) -> Optional[str]:
    """The ``resume_from_checkpoint`` path of the training loop now running ``trainer``, or None.

    Read from the loop's frame: no Trainer release passes it to callbacks.
    """
    for frame in _calling_frames(1):
        if frame.f_locals.get("self") is trainer and "resume_from_checkpoint" in frame.f_locals:
            path = frame.f_locals["resume_from_checkpoint"]
            return path if isinstance(path, str) else None
    return None


def run_after_the_flow_callback(trainer: Any, callback: Any) -> None:
    """Move ``callback`` just after the Trainer's flow callback.

    The reporting callbacks (TensorBoard, W&B, ...) get ``on_log`` before user callbacks, and the progress
    bar reads the plan at ``on_train_begin`` after them; running before both lets every record carry the
    stepsync metrics and the bar see a lowered plan. A new list leaves the loop that is calling us untouched.
    """
    handler = getattr(trainer, "callback_handler", None)
    if handler is None:
        return
    others = [cb for cb in handler.callbacks if cb is not callback]
    flow = [i for i, cb in enumerate(others) if type(cb).__name__ == "DefaultFlowCallback"]
    at = flow[0] + 1 if flow else 0
    handler.callbacks = others[:at] + [callback] + others[at:]


def set_global_step(trainer: Any, state: Any, value: int) -> None:
    """Set ``state.global_step`` before the first step, and the logging mark the Trainer took from it."""
    if getattr(trainer, "_globalstep_last_logged", None) == state.global_step:
        trainer._globalstep_last_logged = value  # else the first log waits until the old count is passed
    state.global_step = value


def move_global_step_back(trainer: Any, state: Any, value: int) -> None:
    """Set ``state.global_step`` back to ``value`` in the middle of training, keeping the logged loss a mean.

    The Trainer logs the loss summed since its last log divided by ``global_step - _globalstep_last_logged``;
    a count moved back would shrink that divisor while the sum keeps every window, so the mark moves back too.
    """
    mark = getattr(trainer, "_globalstep_last_logged", None)
    if isinstance(mark, int) and not isinstance(mark, bool):
        trainer._globalstep_last_logged = mark - (state.global_step - value)
    state.global_step = value


def spread_across_ranks(trainer: Any, values: Sequence[int]) -> List[Tuple[int, int]]:
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
    device = getattr(getattr(trainer, "args", None), "device", "cpu")
    # The highest of v and of -v in one call: -(highest of -v) is the lowest.
    both = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    found = both.tolist()
    n = len(values)
    return [(-found[n + i], found[i]) for i in range(n)]


def examples_of(trainer: Any, dataloader: Any) -> Optional[int]:
    """The Trainer's own ``num_examples`` for ``dataloader`` (what 4.46-4.51 size windows from), or None."""
    try:
        return int(trainer.num_examples(dataloader))
    except Exception:  # no len(), or a Trainer without the method: the forecast assumes batch size 1
        return None


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` looks like a DeepSpeed engine (it has the counters stepsync reads)."""
    return obj is not None and hasattr(obj, "global_steps") and hasattr(obj, "micro_steps")


def find_engine(trainer: Any) -> Optional[Any]:
    """The DeepSpeed engine of ``trainer`` across transformers releases, or None."""
    wrapper = getattr(getattr(trainer, "accelerator", None), "deepspeed_engine_wrapped", None)
    for candidate in (getattr(trainer, "model_wrapped", None), getattr(trainer, "deepspeed", None),
                      getattr(wrapper, "engine", None)):
        if is_engine(candidate):
            return candidate
    return None


def uses_deepspeed(trainer: Any, args: Any) -> bool:
    """Whether the Trainer was asked to use DeepSpeed."""
    return bool(getattr(args, "deepspeed", None)) or bool(getattr(trainer, "is_deepspeed_enabled", False))


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

    __slots__ = ("engine", "_saved", "_active", "_last")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._saved = getattr(engine, "_is_gradient_accumulation_boundary", None)
        self._active = False
        self._last = None

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
