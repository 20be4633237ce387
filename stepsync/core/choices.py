"""The policies a user can choose, and every answer that differs between them: the engine, the adapters and the
command line ask the policy, never compare it with a member (``tests/unit/test_layout.py``)."""
from __future__ import annotations

from enum import Enum
from typing import Union

from .errors import StepSyncConfigError


class FaultAnswer(str, Enum):
    """What a policy does about a fault of a micro-batch's weight that DeepSpeed makes."""

    REPAIR = "repair"  # undo it from outside DeepSpeed (sync, where the fault is an extra division by G)
    REFUSE = "refuse"  # stop before any gradient is made
    WARN = "warn"


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
        raise StepSyncConfigError(unsupported("policy", value, [p.value for p in cls]))

    @property
    def interferes(self) -> bool:
        """Whether the policy changes the run (as opposed to only watching it)."""
        return self in (Policy.SYNC, Policy.REALIGN, Policy.DROP_LAST)

    @property
    def stops(self) -> bool:
        """Whether what stepsync finds wrong stops the run (an objection at the start, a drift, a skipped or
        non-finite update, a checkpoint that cannot be resumed exactly, a fault inside stepsync itself), rather
        than being said and left to the user."""
        return self is Policy.RAISE

    @property
    def steers_the_boundary(self) -> bool:
        """Whether it sets the engine's boundary where the framework counts its updates."""
        return self is Policy.SYNC

    @property
    def follows_the_engine(self) -> bool:
        """Whether the framework's count follows the engine's updates (so the run ends at the engine's last update,
        and what it trains after it is never applied)."""
        return self is Policy.REALIGN

    @property
    def lowers_the_plan(self) -> bool:
        """Whether it lowers the framework's planned updates to the count it reaches, so the run ends where it is
        meant to (at the engine's last update, or after the last whole window), never 'early'."""
        return self.follows_the_engine or self.ends_epochs_early

    @property
    def watches_only(self) -> bool:
        """Whether it only watches: says what it finds and changes nothing, stops nothing."""
        return not self.interferes and not self.stops

    @property
    def ends_epochs_early(self) -> bool:
        """Whether it ends every epoch after its last whole window of G micro-batches."""
        return self is Policy.DROP_LAST

    @property
    def precedence(self) -> int:
        """Which of two callbacks on one Trainer acts: a remedy over 'raise' over 'warn', then the first."""
        return 2 if self.interferes else int(self.stops)

    @property
    def role(self) -> str:
        """What it does to a run, in a few words (the demo's titles)."""
        if self.interferes:
            return "the remedy"
        return "stops at the first fault" if self.stops else "only watches: the run as it is"

    def answer_to_weight_fault(self, repairable: bool) -> FaultAnswer:
        """``sync`` repairs what it can undo from outside DeepSpeed and refuses the rest, like ``raise``."""
        if self.steers_the_boundary and repairable:
            return FaultAnswer.REPAIR
        return FaultAnswer.REFUSE if self.stops or self.steers_the_boundary else FaultAnswer.WARN


def unsupported(what: str, value: object, choices) -> str:
    """An invalid choice, worded one way everywhere (Lightning's words)."""
    return f"Unsupported {what} {value!r}. Possible choices are: {', '.join(repr(c) for c in choices)}"
