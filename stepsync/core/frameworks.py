"""Each training framework stepsync watches, described once: the display, the messages, the metrics, the policy
checks and the command line read these descriptions, never prose. A new framework is one folder of adapters
and one description here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, Union

from .choices import Policy
from .errors import StepSyncConfigError


@dataclass(frozen=True)
class Refusal:
    """Why a framework cannot have a policy, and what to use instead.

    Attributes:
        why: what the policy would have to change that it cannot (``"cannot end your dataloader's epochs early"``).
        instead: the policies that serve instead, best first.
        or_else: a fix outside stepsync, in words (``"drop the partial window in your loop"``); empty for none.
    """

    why: str
    instead: Tuple[Policy, ...]
    or_else: str = ""

    def message(self, policy: Policy, as_flag: bool = False) -> str:
        """The refusal in a sentence; ``as_flag`` names the alternatives as the command line's ``--policy``."""
        named = [f"--policy {p.value}" if as_flag else f"policy='{p.value}'" for p in self.instead]
        use = " or ".join(named) + (f", or {self.or_else}" if self.or_else else "")
        return f"policy '{policy.value}' {self.why}: use {use}"


@dataclass(frozen=True)
class Framework:
    """One framework whose count of updates stepsync holds against the DeepSpeed engine's.

    Attributes:
        name: who keeps the count, in a sentence (``"the Trainer"``, ``"your loop"``).
        who: the same, short, for a table's header and the report's first line (``"Trainer"``).
        counter: the count itself, in drift messages (``"Trainer global_step"``).
        whose_g: where its gradient accumulation steps come from, in a message (``"the Trainer's"``).
        metric_keys: the metrics of its count, the engine's count and the drift, in that order; empty when stepsync
            logs none there.
        refused: the policies it cannot have, each with why and what to use instead (:class:`Refusal`).
        remedy: what a user of it does about a drift; None where that depends on the installed releases (the
            Trainer's and accelerate's, :attr:`stepsync.core.versions.StackBehaviour.remedy`).
        schedules_on_its_count: it steps the LR scheduler itself on its own count (Lightning takes DeepSpeed's
            scheduler over), so the LR moves at an update the engine skipped; elsewhere DeepSpeed steps it at the
            updates it applies.
        backward_call: how it calls the engine's backward (:data:`stepsync.core.weights.CALLS`): "trainer" for the
            Trainer's ``engine.backward(loss / G, scale_wrt_gas=False)``, "accelerate" for ``engine.backward(loss)``
            inside accelerate's ``accumulate()``, "engine" for ``engine.backward(loss)``.
    """

    name: str
    who: str
    counter: str
    whose_g: str
    metric_keys: Tuple[str, ...] = ()
    refused: Dict[Policy, Refusal] = field(default_factory=dict, compare=False)
    remedy: Optional[str] = None
    schedules_on_its_count: bool = False
    backward_call: str = "engine"

    def parse_policy(self, policy: Union[str, Policy], as_flag: bool = False) -> Policy:
        """``policy`` as a :class:`Policy`; an unknown one, or one this framework refuses, raises
        :class:`~stepsync.core.errors.StepSyncConfigError` (a ``ValueError``) naming what to use."""
        parsed = Policy.parse(policy)
        if parsed in self.refused:
            raise StepSyncConfigError(self.refused[parsed].message(parsed, as_flag))
        return parsed


TRAINER = Framework(
    name="the Trainer", who="Trainer", counter="Trainer global_step", whose_g="the Trainer's",
    metric_keys=("stepsync/trainer_steps", "stepsync/engine_steps", "stepsync/drift"), backward_call="trainer")

LIGHTNING = Framework(
    name="Lightning", who="Lightning", counter="Lightning global_step",
    whose_g="Lightning's accumulate_grad_batches",
    metric_keys=("stepsync/lightning_steps", "stepsync/engine_steps", "stepsync/drift"),
    refused={Policy.REALIGN: Refusal("cannot apply to Lightning: its global_step is derived from its loop's progress "
                                     "counters, which a callback cannot set", (Policy.SYNC, Policy.DROP_LAST))},
    remedy="use stepsync.lightning.StepSyncCallback(policy='sync')", schedules_on_its_count=True)

ACCELERATE_LOOP = Framework(
    name="your loop", who="your loop", counter="loop updates", whose_g="the accelerator's",
    metric_keys=("stepsync/loop_steps", "stepsync/engine_steps", "stepsync/drift"), backward_call="accelerate",
    refused={Policy.REALIGN: Refusal("cannot change your loop's own counter", (Policy.SYNC,),
                                     "keep policy 'warn' and adopt watch.report.engine_steps"),
             Policy.DROP_LAST: Refusal("cannot end your dataloader's epochs early", (Policy.SYNC,),
                                       "drop the partial window in your loop")})

FABRIC_LOOP = Framework(
    name="your Fabric loop", who="your loop", counter="your loop's optimizer.step() count",
    whose_g="the DeepSpeed config's",
    refused={Policy.REALIGN: Refusal("cannot change your loop's own count", (Policy.SYNC, Policy.WARN)),
             Policy.DROP_LAST: Refusal("cannot end your dataloader's epochs early", (Policy.SYNC, Policy.WARN))},
    remedy="use stepsync.lightning.watch(fabric, ..., policy='sync')")

FRAMEWORKS = (TRAINER, LIGHTNING, ACCELERATE_LOOP, FABRIC_LOOP)
SKIPPED_METRIC = "stepsync/updates_skipped"  # beside each framework's metrics, once the engine has skipped one
NON_FINITE_METRIC = "stepsync/non_finite_at_update"  # the update after which the weights were not finite
