"""The user's loop objects as the adapters meet them: a dataloader that may have no length, and methods wrapped
on one instance (a loop's ``backward``, an optimizer's ``step``) that must be given back as they were."""
from __future__ import annotations

import functools
import os
import types
from typing import Any, Callable, List, Optional, Tuple


def length_of(loader: Any) -> Optional[int]:
    """``len(loader)``, or None for no loader or one without a length (an iterable dataset)."""
    if loader is None:
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def sharding_dropped(kind: str) -> str:
    """What accelerate says nowhere: it was asked for FSDP (an ``fsdp_plugin``, the Trainer's ``fsdp``, or
    ``accelerate launch --use_fsdp`` set ``ACCELERATE_USE_FSDP``) and ``kind`` (what it did instead: not FSDP) is in
    force; "" where it was not asked."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return ""
    return (f"accelerate was asked for FSDP and did not shard the model ({kind}: accelerate shards with FSDP on GPUs "
            "only, as measured on a CPU): every rank holds and trains a whole copy")


def distributed_type(accelerator: Any) -> str:
    """An accelerate ``Accelerator``'s ``distributed_type`` by its name (``"MULTI_CPU"``), or ``"unknown"``."""
    return str(getattr(accelerator, "distributed_type", "unknown")).split(".")[-1]


def accelerators_sharding_dropped(accelerator: Any) -> str:
    """:func:`sharding_dropped` for an accelerator whose ``distributed_type`` is not FSDP's; "" where it is."""
    kind = distributed_type(accelerator)
    return "" if kind == "FSDP" else sharding_dropped(f"distributed_type {kind}")


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
