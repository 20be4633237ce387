"""The user's loop objects as the adapters meet them: a dataloader that may have no length, and methods wrapped
on one instance (a loop's ``backward``, an optimizer's ``step``) that must be given back as they were."""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, List, Optional, Tuple, TypeVar

from ..core.report import SyncReport
from .faults import Adapter
from .run import Run

Watch = TypeVar("Watch", bound="LoopAdapter")


def length_of(loader: Any) -> Optional[int]:
    """``len(loader)``, or None for no loader or one without a length (an iterable dataset)."""
    if loader is None:
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def bound_to(owner: Any, function: Callable[..., Any]) -> Any:
    """``function`` as a method of ``owner``, called with the arguments the method is called with."""
    def method(_owner: Any, *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    functools.update_wrapper(method, function)
    return types.MethodType(method, owner)


class InstancePatches:
    """Attributes set on single instances, each given back by :meth:`restore`: the instance's own earlier
    attribute when it had one (another wrapper), else none, so that its class's method shows through again."""

    def __init__(self) -> None:
        self._saved: List[Tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any, as_method: bool = False) -> None:
        """Set ``owner.name`` to ``value``; ``as_method``: as a method bound to ``owner``, for code that wraps it as
        one (an LR scheduler built on an optimizer reads its ``step.__func__``)."""
        self._saved.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, bound_to(owner, value) if as_method else value)

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                vars(owner).pop(name, None)
            else:
                setattr(owner, name, original)
        self._saved = []


class LoopAdapter(Adapter):
    """What both loop watches share: the loop's methods they wrap, all given back at :meth:`close`, which ends the
    run once; a context manager that closes on exit."""

    _patches: InstancePatches
    loop_steps: int

    def _micro_batch_begins(self, run: Run, last_unreported: bool) -> None:
        """A loop whose updates come after its backward() calls, its epochs told apart by the dataloader's length:
        the last micro-batch is counted where no update followed it, and an epoch begins where none is open or the
        open one is full."""
        if last_unreported:
            run.after_micro_batch(False, self.loop_steps)
        if run.epoch < run.start_epoch:  # none open yet (a resumed run starts at its record's epoch)
            run.begin_epoch()
        elif run.n is not None and run.position >= run.n:
            run.end_epoch(self.loop_steps)
            run.begin_epoch()

    def _loop_ends(self, run: Run, last_unreported: bool) -> None:
        """The loop ended: its last micro-batch counted where no update followed it, and a full epoch ended."""
        if last_unreported:
            run.after_micro_batch(False, self.loop_steps)
        if run.n is not None and run.position >= run.n:
            run.end_epoch(self.loop_steps)

    def close(self) -> SyncReport:
        """Give the wrapped methods and the engine's boundary back; the report is final. Closing twice changes
        nothing."""
        self._patches.restore()
        if not self.report.finished:
            self._close()
        return self.report

    def _close(self) -> None:
        """End the run (the adapter's last micro-batch, epoch and report)."""

    def __enter__(self: Watch) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
