"""The policies a user can choose; the code and the error messages share this one list."""
from __future__ import annotations

from enum import Enum
from typing import Union

from .errors import StepSyncConfigError


class Policy(str, Enum):
    """What stepsync does about a drift between the Trainer's and the engine's counts.

    - ``WARN``: report it, never interfere.
    - ``RAISE``: stop the run with :class:`stepsync.StepDriftError` at the first divergence.
    - ``SYNC``: make DeepSpeed's boundary follow the Trainer's (the engine updates where the Trainer counts).
    - ``REALIGN``: set the Trainer's ``global_step`` to the engine's ``global_steps``.
    - ``DROP_LAST``: end every epoch after its last full window of G micro-batches.
    """

    WARN = "warn"
    RAISE = "raise"
    SYNC = "sync"
    REALIGN = "realign"
    DROP_LAST = "drop_last"

    @classmethod
    def parse(cls, value: Union[str, Policy]) -> Policy:
        """``"sync"`` or ``Policy.SYNC`` -> ``Policy.SYNC``; anything else raises
        :class:`~stepsync.core.errors.StepSyncConfigError`, a ``ValueError`` (what a framework refuses:
        :meth:`stepsync.core.frameworks.Framework.parse_policy`)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower().replace("-", "_"))
            except ValueError:
                pass
        choices = ", ".join(repr(p.value) for p in cls)
        raise StepSyncConfigError(f"Unsupported policy {value!r}. Possible choices are: {choices}")

    @property
    def interferes(self) -> bool:
        """Whether the policy changes the run (as opposed to only watching it)."""
        return self in (Policy.SYNC, Policy.REALIGN, Policy.DROP_LAST)
