"""The user's loop objects as the adapters meet them: a dataloader that may have no length, and methods wrapped
on one instance (a loop's ``backward``, an optimizer's ``step``) that must be given back as they were."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple


def length_of(loader: Any) -> Optional[int]:
    """``len(loader)``, or None for no loader or one without a length (an iterable dataset)."""
    if loader is None:
        return None
    try:
        return len(loader)
    except TypeError:
        return None


class InstancePatches:
    """Attributes set on single instances, each given back by :meth:`restore`: the instance's own earlier
    attribute when it had one (another wrapper), else none, so that its class's method shows through again."""

    def __init__(self) -> None:
        self._saved: List[Tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                vars(owner).pop(name, None)
            else:
                setattr(owner, name, original)
        self._saved = []
