"""What each transformers / accelerate / DeepSpeed release does with accumulation boundaries.

This is the one module that knows release numbers; everything else asks it. Each row names the
release range it covers and the upstream change it comes from (see ``shared/UPSTREAM.md``).
Pure Python: it reads installed versions from package metadata and never imports the packages.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from importlib import metadata
from typing import Optional, Tuple

VersionTuple = Tuple[int, int, int]

NEWEST = "newest"


def parse_version(text: str) -> VersionTuple:
    """``"4.47.1"``, ``"1.8.0.dev0"`` or ``"2.13.0+cpu"`` -> ``(4, 47, 1)``; ``"newest"`` sorts last."""
    if text == NEWEST:
        return (10**6, 0, 0)
    match = re.match(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", str(text))
    if not match:
        raise ValueError(f"cannot read the version {text!r}: expected numbers such as '4.47.1'")
    return tuple(int(part or 0) for part in match.groups())  # type: ignore[return-value]


class TrainerRule(str, Enum):
    """When the Trainer counts an update at micro-batch ``s`` (0-based in the epoch) of ``N``."""

    EPOCH_WINDOW = "epoch_window"  # (s+1) % G == 0 or (N <= G and s+1 == N)
    GLOBAL_COUNTER = "global_counter"  # t % G == 0 or (N <= G and s+1 == N), t counted across epochs
    EPOCH_END = "epoch_end"  # (s+1) % G == 0 or s+1 == N


class EngineBoundary(str, Enum):
    """Who decides when the DeepSpeed engine updates."""

    MICRO_COUNTER = "micro_counter"  # engine.step() on every micro-batch: (micro_steps+1) % G == 0
    FOLLOWS_TRAINER = "follows_trainer"  # set_gradient_accumulation_boundary(sync_gradients) each micro-batch


class PlannedSteps(str, Enum):
    """How the Trainer plans ``max_steps`` from ``num_train_epochs``."""

    FLOOR = "floor"  # E * max(N // G, 1)
    CEIL = "ceil"  # E * ceil(N / G)


@dataclass(frozen=True)
class ReleaseRow:
    """One fact about a release range ``[since, until)`` of one package."""

    package: str
    since: Optional[str]
    until: Optional[str]
    behaviour: str
    upstream: str

    def covers(self, version: str) -> bool:
        v = parse_version(version)
        return (self.since is None or v >= parse_version(self.since)) and (
            self.until is None or v < parse_version(self.until)
        )


TRAINER_RULES = (
    ReleaseRow("transformers", None, "4.27.0", TrainerRule.EPOCH_WINDOW.value,
               "window restarts each epoch; leftovers spill into the next epoch's first window"),
    ReleaseRow("transformers", "4.27.0", "4.47.1", TrainerRule.GLOBAL_COUNTER.value,
               "transformers PR 22098 (issue 22082): counter across epochs; tiny epochs force an update"),
    ReleaseRow("transformers", "4.47.1", None, TrainerRule.EPOCH_END.value,
               "transformers 4.47.1 (issue 31677): every epoch's last partial window is an update"),
)

PLANNED_STEPS = (
    ReleaseRow("transformers", None, "4.48.0", PlannedSteps.FLOOR.value, "max_steps = E * max(N // G, 1)"),
    ReleaseRow("transformers", "4.48.0", None, PlannedSteps.CEIL.value, "max_steps = E * ceil(N / G)"),
)

ENGINE_STEPPERS = (
    ReleaseRow("transformers", None, "4.30.0", EngineBoundary.MICRO_COUNTER.value,
               "the Trainer calls engine.step() on every micro-batch itself (before accelerate)"),
    ReleaseRow("accelerate", None, "1.8.0", EngineBoundary.MICRO_COUNTER.value,
               "accelerate's DeepSpeedEngineWrapper.backward calls engine.step() on every micro-batch"),
    ReleaseRow("accelerate", "1.8.0", None, EngineBoundary.FOLLOWS_TRAINER.value,
               "accelerate PR 3630 (issue 3552) sets the engine's boundary from the Trainer's sync_gradients"),
)

DEEPSPEED_FEATURES = (
    ReleaseRow("deepspeed", "0.5.8", None, "set_gradient_accumulation_boundary",
               "DeepSpeed 0.5.8 added engine.set_gradient_accumulation_boundary"),
    ReleaseRow("deepspeed", "0.19.4", None, "managed_gradient_accumulation",
               "DeepSpeed 0.19.4 added managed_gradient_accumulation (false disables the boundary override)"),
)

# Stacks whose counts were measured on real runs; a forecast elsewhere is inferred from the rows above.
MEASURED_TRANSFORMERS = ("4.24.0", "4.45.2", "4.47.1", "5.24.0")
REMAINDER_BUG = ReleaseRow("transformers", "4.46.0", "4.49.0", "remainder",
                           "transformers 4.46-4.48: `num_examples % G` can cut epochs short when G > N")


def _lookup(rows, package: str, version: str) -> Optional[ReleaseRow]:
    return next((row for row in rows if row.package == package and row.covers(version)), None)


def installed_version(package: str) -> Optional[str]:
    """The installed version of ``package`` from its metadata, or None; never imports it."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Stack:
    """The versions of the three packages that decide how steps are counted."""

    transformers: str = NEWEST
    accelerate: str = NEWEST
    deepspeed: str = NEWEST

    @classmethod
    def installed(cls) -> "Stack":
        """The installed versions; a package that is not installed counts as its newest release."""
        return cls(*(installed_version(name) or NEWEST for name in ("transformers", "accelerate", "deepspeed")))

    def __post_init__(self) -> None:
        for name in ("transformers", "accelerate", "deepspeed"):
            parse_version(getattr(self, name))  # fail early on a malformed version

    def __str__(self) -> str:
        return f"transformers {self.transformers}, accelerate {self.accelerate}, deepspeed {self.deepspeed}"


@dataclass(frozen=True)
class StackBehaviour:
    """What a stack does, with the release row behind each fact.

    Attributes:
        trainer_rule: when the Trainer counts an update.
        engine_boundary: who decides the engine's updates when stepsync does not interfere.
        planned_steps: how ``max_steps`` is derived from epochs.
        engine_reason: the release row behind ``engine_boundary``, in words.
        can_override_boundary: whether ``set_gradient_accumulation_boundary`` exists (policy ``sync``).
        measured: whether this transformers release was measured on real runs.
    """

    stack: Stack
    trainer_rule: TrainerRule
    engine_boundary: EngineBoundary
    planned_steps: PlannedSteps
    engine_reason: str
    can_override_boundary: bool
    measured: bool
    remainder_bug: bool

    @property
    def remedy(self) -> str:
        """What a user can do when this stack drifts."""
        if self.engine_boundary is EngineBoundary.FOLLOWS_TRAINER:
            return "use StepSyncCallback(policy='realign') to adopt the engine's count"
        if parse_version(self.stack.transformers) >= parse_version("4.47.1"):
            return "upgrade to accelerate>=1.8.0, or use StepSyncCallback(policy='sync')"
        return "use StepSyncCallback(policy='sync')"


def behaviour_of(stack: Stack) -> StackBehaviour:
    """Resolve ``stack`` against the release tables."""
    trainer_row = _lookup(TRAINER_RULES, "transformers", stack.transformers)
    planned_row = _lookup(PLANNED_STEPS, "transformers", stack.transformers)
    stepper = _lookup(ENGINE_STEPPERS, "transformers", stack.transformers) or _lookup(
        ENGINE_STEPPERS, "accelerate", stack.accelerate
    )
    assert trainer_row and planned_row and stepper  # the tables cover every version
    stepper_version = stack.transformers if stepper.package == "transformers" else stack.accelerate
    return StackBehaviour(
        stack=stack,
        trainer_rule=TrainerRule(trainer_row.behaviour),
        engine_boundary=EngineBoundary(stepper.behaviour),
        planned_steps=PlannedSteps(planned_row.behaviour),
        engine_reason=f"{stepper.package} {stepper_version}: {stepper.upstream}",
        can_override_boundary=_lookup(DEEPSPEED_FEATURES, "deepspeed", stack.deepspeed) is not None,
        measured=stack.transformers == NEWEST
        or any(stack.transformers == v for v in MEASURED_TRANSFORMERS)
        or parse_version(stack.transformers) >= parse_version("5.0.0"),
        remainder_bug=REMAINDER_BUG.covers(stack.transformers),
    )
