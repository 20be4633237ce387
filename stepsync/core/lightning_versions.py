"""What each PyTorch Lightning release does with DeepSpeed and ``accumulate_grad_batches``, as probed.

``probes/lightning_probe.py`` ran 2.0.9, 2.2.5, 2.4.0 and 2.6.6, each with the DeepSpeed of its time that runs
on CPU (``probes/lightning.json``); ``tests/unit/test_lightning_versions.py`` fails when these rows and that
data disagree. Every probed release does the same: one row per fact, each naming the Lightning code behind it.
Pure Python: reads installed versions from package metadata and never imports the packages.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from .errors import UnsupportedVersion
from .frameworks import LIGHTNING
from .versions import (
    DEEPSPEED_FEATURES,
    MEASURED_LIGHTNING,
    NEWEST,
    EngineBoundary,
    PlannedSteps,
    ReleaseRow,
    StackBehaviour,
    TrainerRule,
    assumed_release,
    installed_version,
    parse_version,
    without_an_engine,
)

OLDEST_LIGHTNING = "2.0.0"

LIGHTNING_ROWS = (
    ReleaseRow("lightning", "2.0.0", None, TrainerRule.WHOLE_WINDOWS,
               "with DeepSpeed the strategy handles accumulation (handles_gradient_accumulation), so Lightning never "
               "steps on an epoch's partial last window, and its window counter (batch_progress.current) restarts "
               "every epoch"),
    ReleaseRow("lightning", "2.0.0", None, EngineBoundary.MICRO_COUNTER,
               "its DeepSpeed precision plugin calls engine.step() on every micro-batch"),
    ReleaseRow("lightning", "2.0.0", None, "loss_divided_twice",
               "its closure divides the loss by accumulate_grad_batches, then DeepSpeedEngine.backward divides it "
               "again (scale_wrt_gas=True): each micro-batch weighs 1/G**2"),
    ReleaseRow("lightning", "2.0.0", None, "zero_grad_at_its_windows",
               "optimizer_zero_grad runs at batch_idx % G == 0 of each epoch: on ZeRO 0, 1 and 3 it clears what the "
               "engine is still accumulating; ZeRO-2 keeps it in its own buffers"),
    ReleaseRow("lightning", "2.0.0", None, "scheduler_on_its_count",
               "the strategy sets engine.lr_scheduler = None and Lightning steps the scheduler on its own count"),
)

# Lightning without DeepSpeed (its own accumulation, one CPU device): probed on 2.0.9 and 2.6.6
# (probes/lightning_alone.json), each the same.
LIGHTNING_ALONE_ROWS = (
    ReleaseRow("lightning", "2.0.0", None, TrainerRule.EPOCH_END,
               "without a strategy that handles accumulation, _should_accumulate() is False at every G-th batch of "
               "an epoch and at its last (_num_ready_batches_reached): the optimizer steps there, a partial window "
               "included, and global_step counts those steps"),
    ReleaseRow("lightning", "2.0.0", None, "loss_divided_once",
               "its closure divides the loss by accumulate_grad_batches, a partial window's too: each micro-batch "
               "weighs 1/G"),
)

# What ZeRO 1 and 2 do in a Fabric loop (Fabric's optimizer.step() steps DeepSpeed's optimizer directly), by the
# DeepSpeed release: measured with lightning 2.6.6 on DeepSpeed 0.14.5, 0.16.9, 0.17.0, 0.17.6, 0.18.0, 0.18.4,
# 0.19.0, 0.19.4 and 0.19.8 (the releases between two measured ones are taken as the one before).
FABRIC_ZERO12_ROWS = (
    ReleaseRow("deepspeed", None, "0.17.6", "accumulates",
               "the engine accumulates every backward of a window; with gradient_accumulation_steps=G in the config "
               "it divides the loss by G again"),
    ReleaseRow("deepspeed", "0.17.6", "0.18.4", "fails",
               "the first optimizer.step() fails (TypeError with gradient_accumulation_steps=1 in the config, "
               "KeyError: 0 with G)"),
    ReleaseRow("deepspeed", "0.18.4", None, "keeps_the_last",
               "with gradient_accumulation_steps=1 in the config every backward closes a window of the engine's, "
               "so only the last micro-batch of each loop window reaches its update; with G, the first "
               "optimizer.step() fails with KeyError: 0"),
)


class FabricZero12(str, Enum):
    """What ZeRO 1 and 2 do in a Fabric loop, by DeepSpeed release (the rows above say how it was measured)."""

    ACCUMULATES = "accumulates"
    FAILS = "fails"
    KEEPS_THE_LAST = "keeps_the_last"


def fabric_zero12(deepspeed: str) -> FabricZero12:
    """What ZeRO 1 and 2 do in a Fabric loop on this DeepSpeed."""
    return FabricZero12(next(row.behaviour for row in FABRIC_ZERO12_ROWS if row.covers(deepspeed)))


@dataclass(frozen=True)
class LightningStack:
    """The versions of the two packages that decide how a Lightning run on DeepSpeed counts its steps."""

    lightning: str = NEWEST
    deepspeed: str = NEWEST

    @classmethod
    def installed(cls) -> LightningStack:
        """The installed versions (``lightning``, else ``pytorch-lightning``); a missing one counts as
        :func:`~stepsync.core.versions.assumed_release` says."""
        found = installed_version("lightning") or installed_version("pytorch-lightning")
        deepspeed = installed_version("deepspeed") or assumed_release("deepspeed")
        return cls(found or assumed_release("lightning"), deepspeed)

    def __post_init__(self) -> None:
        parse_version(self.lightning)
        parse_version(self.deepspeed)

    def __str__(self) -> str:
        return f"lightning {self.lightning}, deepspeed {self.deepspeed}"


def _row_of(rows: tuple, kind: type) -> ReleaseRow:
    """The row whose behaviour is a member of ``kind`` (read by what it says, never by its place)."""
    return next(row for row in rows if isinstance(row.behaviour, kind))


def lightning_alone(behaviour: StackBehaviour) -> StackBehaviour:
    """``behaviour`` (the installed Lightning's) for a run without DeepSpeed: Lightning steps its optimizer at each
    epoch's windows of G, the partial last one included, and counts those steps (:data:`LIGHTNING_ALONE_ROWS`)."""
    counting = _row_of(LIGHTNING_ALONE_ROWS, TrainerRule)
    return replace(without_an_engine(behaviour), trainer_rule=TrainerRule(counting.behaviour),
                   planned_steps=PlannedSteps.CEIL, loss_divisions=1, zero_grad_at_its_windows=False)


def lightning_behaviour_of(stack: LightningStack) -> StackBehaviour:
    """Resolve ``stack`` against the Lightning rows; raises :class:`UnsupportedVersion` below 2.0."""
    version = parse_version(stack.lightning)
    if stack.lightning != NEWEST and version < parse_version(OLDEST_LIGHTNING):
        raise UnsupportedVersion(f"lightning {stack.lightning} is older than {OLDEST_LIGHTNING}, the first release "
                                 f"stepsync covers (probed: {', '.join(MEASURED_LIGHTNING)}): upgrade lightning")
    caveats: tuple = ()
    if stack.lightning != NEWEST and stack.lightning not in MEASURED_LIGHTNING:
        caveats = (f"lightning {stack.lightning} was not probed: its counting is inferred from the probed releases "
                   f"({', '.join(MEASURED_LIGHTNING)}), which all do the same",)
    counting, stepping = _row_of(LIGHTNING_ROWS, TrainerRule), _row_of(LIGHTNING_ROWS, EngineBoundary)
    boundary_setter = next(row for row in DEEPSPEED_FEATURES if row.behaviour == "set_gradient_accumulation_boundary")
    return StackBehaviour(
        stack=stack,
        trainer_rule=TrainerRule(counting.behaviour),
        engine_boundary=EngineBoundary(stepping.behaviour),
        planned_steps=PlannedSteps.WHOLE,
        engine_reason=f"lightning {stack.lightning}: {stepping.upstream}",
        can_override_boundary=boundary_setter.covers(stack.deepspeed),
        measured=stack.lightning in MEASURED_LIGHTNING,
        remainder_cut=False,
        caveats=caveats,
        framework=LIGHTNING,
        loss_divisions=2,
        zero_grad_at_its_windows=True,
    )
