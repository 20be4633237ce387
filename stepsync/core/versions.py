"""What each transformers / accelerate / DeepSpeed release does with accumulation boundaries.

This is the one module that knows release numbers; everything else asks it. Every row is measured:
the Trainer's rows come from probing every transformers minor release (``scripts/probe.py`` writes
``probes/results.json``; ``tests/unit/test_versions.py`` fails when these rows and that data disagree), the
engine's rows from real DeepSpeed runs at each boundary (``probes/engine.json``). Each row names the first
release measured with its behaviour. Pure Python: reads installed versions from package metadata and
never imports the packages.

Versions are compared by ``packaging.version``: a dev build or release candidate of the release where a
behaviour starts (``1.8.0.dev0``, ``1.8.0rc1``) sorts before it and is treated as the release before,
since the change may not be in it; a post release (``1.8.0.post1``) counts as the release. The forecast
says so when that decides the verdict.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any, Optional, Tuple

from packaging.version import InvalidVersion, Version

from .choices import Policy
from .errors import StepSyncConfigError, UnsupportedVersion
from .frameworks import TRAINER, EngineBoundary, Framework, PlannedSteps, TrainerRule

NEWEST = "newest"
OLDEST_SUPPORTED = "4.24.0"


def parse_version(text: str) -> Version:
    """``"4.47.1"``, ``"1.8.0.dev0"`` or ``"2.13.0+cpu"`` as a ``packaging`` Version; ``"newest"`` sorts last."""
    if text == NEWEST:
        return Version("999999")
    try:
        return Version(str(text).strip())
    except InvalidVersion:
        raise StepSyncConfigError(f"cannot read the version {text!r}: expected numbers such as '4.47.1'") from None


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


# The Trainer's rows: measured by probes/trainer_probe.py on every minor release (latest patch) and on every
# patch of a minor where a behaviour changed. `since` is the first release measured with the behaviour.
TRAINER_RULES = (
    ReleaseRow("transformers", None, "4.27.0", TrainerRule.EPOCH_WINDOW,
               "the window restarts each epoch; leftover micro-batches spill into the next epoch's first window"),
    ReleaseRow("transformers", "4.27.0", "4.47.0", TrainerRule.GLOBAL_COUNTER,
               "the window counter runs across epochs (transformers PR 22098); tiny epochs force an update"),
    ReleaseRow("transformers", "4.47.0", None, TrainerRule.EPOCH_END,
               "every epoch's last partial window is an update (transformers issue 31677)"),
)

PLANNED_STEPS = (
    ReleaseRow("transformers", None, "4.52.0", PlannedSteps.FLOOR, "max_steps = E * max(N // G, 1)"),
    ReleaseRow("transformers", "4.52.0", None, PlannedSteps.CEIL, "max_steps = E * ceil(N / G)"),
)

REMAINDER_CUT = ReleaseRow(
    "transformers", "4.46.0", "4.52.0", "remainder_cut",
    "the epoch's last window is sized `num_examples % G`, not `N % G`: with a batch size above 1 an epoch can "
    "end before its last micro-batches")

# The engine's rows: measured by probes/engine_probe.py (who calls engine.step(), where the engine updates).
# transformers 4.30-4.38 cannot run DeepSpeed on a CPU-only machine (they ask for NCCL): the 4.30.0 boundary
# lies between the measured 4.29.2 (the Trainer calls engine.step()) and 4.39.3 (accelerate's wrapper does),
# where the sources put it.
ENGINE_STEPPERS = (
    ReleaseRow("transformers", None, "4.30.0", EngineBoundary.MICRO_COUNTER,
               "the Trainer calls engine.step() on every micro-batch itself (before accelerate)"),
    ReleaseRow("accelerate", None, "1.8.0", EngineBoundary.MICRO_COUNTER,
               "accelerate's DeepSpeedEngineWrapper.backward calls engine.step() on every micro-batch"),
    ReleaseRow("accelerate", "1.8.0", None, EngineBoundary.FOLLOWS_TRAINER,
               "accelerate PR 3630 (issue 3552) sets the engine's boundary from the Trainer's sync_gradients"),
)

DEEPSPEED_FEATURES = (
    ReleaseRow("deepspeed", "0.5.8", None, "set_gradient_accumulation_boundary",
               "DeepSpeed 0.5.8 added engine.set_gradient_accumulation_boundary"),
    ReleaseRow("deepspeed", "0.19.4", None, "managed_gradient_accumulation",
               "DeepSpeed 0.19.4 added managed_gradient_accumulation (false disables the boundary override)"),
)

# What the Trainer fills in a DeepSpeed config's "auto" values and refuses where the config contradicts its
# TrainingArguments (HfTrainerDeepSpeedConfig, read in each release's integrations/deepspeed.py and
# training_args.py); tests/integration/test_trainer_refusals.py holds stepsync.core.trainer_config against the real
# Trainer's refusal on the stacks it runs on.
TRAINER_CONFIG_FILL = (
    ReleaseRow("transformers", None, "5.0.0", "apex_amp",
               "fp16.enabled is matched with fp16 through torch amp, amp.enabled and amp.opt_level with apex's"),
    ReleaseRow("transformers", "4.37.0", None, "auto_find_batch_size",
               "auto_find_batch_size=True exempts the batch sizes from the match"),
    ReleaseRow("transformers", "5.0.0", None, "warmup_steps_ratio",
               "warmup_steps below 1 is a ratio of the training steps (warmup_ratio folded into it)"),
    ReleaseRow("transformers", "5.18.0", None, "warmup_at_least_one", "warmup_num_steps is filled with at least 1"),
)


# Whether the Trainer hands a compute_loss_func the window's num_items_in_batch (the fix the loss-normalisation
# warning offers there): measured by tests/integration/test_token_weights.py on the stacks it runs on.
LOSS_FUNC_GETS_ITEMS = ReleaseRow("transformers", "4.57.6", None, "passes_items",
                                  "the Trainer passes num_items_in_batch to a compute_loss_func (measured on 4.57.6 "
                                  "and 5.24.0; 4.46.3 passes None)")


def trainer_config_fill(transformers: str) -> frozenset:
    """The names of the :data:`TRAINER_CONFIG_FILL` rows that hold on ``transformers``."""
    return frozenset(row.behaviour for row in TRAINER_CONFIG_FILL if row.covers(transformers))


# Every transformers release the Trainer probe ran on (probes/results.json): only these are "measured".
MEASURED_LIGHTNING = ("2.0.9", "2.2.5", "2.4.0", "2.6.6")  # stepsync.core.lightning_versions reads them
MEASURED_TRANSFORMERS = (
    "4.24.0", "4.25.1", "4.26.1", "4.27.0", "4.27.1", "4.27.2", "4.27.3", "4.27.4", "4.28.1", "4.29.2", "4.30.2",
    "4.31.0", "4.32.1", "4.33.3", "4.34.1", "4.35.2", "4.36.2", "4.37.2", "4.38.2", "4.39.3", "4.40.2", "4.41.2",
    "4.42.4", "4.43.4", "4.44.2", "4.45.2", "4.46.0", "4.46.1", "4.46.2", "4.46.3", "4.47.0", "4.47.1", "4.48.3",
    "4.49.0", "4.50.3", "4.51.3", "4.52.0", "4.52.1", "4.52.2", "4.52.3", "4.52.4", "4.53.3", "4.54.1", "4.55.4",
    "4.56.2", "4.57.6", "5.0.0", "5.1.0", "5.2.0", "5.3.0", "5.4.0", "5.5.4", "5.6.2", "5.7.0", "5.8.1", "5.9.0",
    "5.10.4", "5.11.0", "5.12.1", "5.13.1", "5.14.1", "5.15.1", "5.16.1", "5.17.0", "5.18.0", "5.19.0", "5.20.2",
    "5.21.1", "5.22.2", "5.23.0", "5.24.0", "5.25.0",
)


def _lookup(rows, package: str, version: str) -> Optional[ReleaseRow]:
    return next((row for row in rows if row.package == package and row.covers(version)), None)


def assumed_release(package: str) -> str:
    """What stepsync takes a package that is neither installed nor given to be: the newest release probed of the
    frameworks whose counting the probes measure (transformers, Lightning), the newest release of anything else."""
    measured = {"transformers": MEASURED_TRANSFORMERS, "lightning": MEASURED_LIGHTNING}.get(package)
    return measured[-1] if measured else NEWEST


@functools.lru_cache(maxsize=None)
def installed_version(package: str) -> Optional[str]:
    """The installed version of ``package`` from its metadata, or None; never imports it. Read once per process:
    a release installed while a process runs is not the one it imported."""
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
    def installed(cls, packages: Tuple[str, ...] = ("transformers", "accelerate", "deepspeed")) -> Stack:
        """The installed versions of ``packages`` (those that decide how a framework counts); any other, and one
        that is not installed, counts as :func:`assumed_release` says."""
        return cls(*((name in packages and installed_version(name)) or assumed_release(name)
                     for name in ("transformers", "accelerate", "deepspeed")))

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
        measured: whether the Trainer probe ran on this transformers release.
        remainder_cut: whether the Trainer sizes an epoch's last window from ``num_examples % G``.
        caveats: what the verdict rests on beyond measurement (an inferred release, a pre-release on a boundary).
        framework: who keeps the first count (:mod:`stepsync.core.frameworks`).
        loss_divisions: how many times the loss is divided by G before its gradients reach the engine (each
            micro-batch then weighs 1 / G ** loss_divisions of its update).
        zero_grad_at_its_windows: the framework clears gradients at the start of each of its own windows (which
            wipes what the engine still accumulates when the two windows differ, on ZeRO 0, 1 and 3).
    """

    stack: Any
    trainer_rule: TrainerRule
    engine_boundary: EngineBoundary
    planned_steps: PlannedSteps
    engine_reason: str
    can_override_boundary: bool
    measured: bool
    remainder_cut: bool
    caveats: Tuple[str, ...] = ()
    framework: Framework = TRAINER
    loss_divisions: int = 1
    zero_grad_at_its_windows: bool = False

    def ends_epochs_under(self, policy: Policy) -> bool:
        """Whether ``policy`` ends this run's epochs after their whole windows: where its framework does so for it,
        and for a policy that steers the boundary only where there is one to steer (without DeepSpeed there is
        none, and the framework's epochs run whole)."""
        return policy in self.framework.ends_epochs_under and (self.can_override_boundary
                                                               or not policy.steers_the_boundary)

    @property
    def remedy(self) -> str:
        """What a user can do when this stack drifts."""
        if self.engine_reason == WITHOUT_AN_ENGINE.format(framework=self.framework.name):  # no policy changes that
            return (f"find why the optimizer did not step where {self.framework.name} counted an update (fp16's "
                    "GradScaler skips a step whose gradients are not finite)")
        if self.framework.remedy is not None:
            return self.framework.remedy
        if self.engine_boundary is EngineBoundary.FOLLOWS_TRAINER:
            return "use StepSyncCallback(policy='realign') to adopt the engine's count"
        if self.trainer_rule is TrainerRule.EPOCH_END:  # the count accelerate's fix makes the engine follow
            fixed_in = next(row.since for row in ENGINE_STEPPERS if row.behaviour is EngineBoundary.FOLLOWS_TRAINER)
            return f"upgrade to accelerate>={fixed_in}, or use policy='sync' (StepSyncCallback or stepsync.watch)"
        return "use policy='sync' (StepSyncCallback or stepsync.watch)"


def _caveats(stack: Stack) -> Tuple[str, ...]:
    notes = []
    version = stack.transformers
    if version != NEWEST and version not in MEASURED_TRANSFORMERS:
        newest = MEASURED_TRANSFORMERS[-1]
        if parse_version(version) > parse_version(newest):
            notes.append(f"transformers {version} is newer than every probed release ({newest}): its counting is "
                         "inferred from release notes, not measured")
        else:
            notes.append(f"transformers {version} was not probed: its counting is inferred from the probed releases "
                         "around it, not measured")
    for package in ("transformers", "accelerate"):
        version = getattr(stack, package)
        if version == NEWEST:
            continue
        parsed = parse_version(version)
        rows = TRAINER_RULES + PLANNED_STEPS + (REMAINDER_CUT,) + ENGINE_STEPPERS
        for row in rows:
            if row.package == package and row.since and parsed.is_prerelease and parsed.release == Version(
                    row.since).release:
                notes.append(f"{package} {version} is a pre-release of {row.since}, where '{row.behaviour}' begins: "
                             f"treated as the release before {row.since}, since the change may not be in it")
    return tuple(dict.fromkeys(notes))


def behaviour_of(stack: Stack) -> StackBehaviour:
    """Resolve ``stack`` against the release tables; raises :class:`UnsupportedVersion` below 4.24.0."""
    if stack.transformers != NEWEST and parse_version(stack.transformers) < parse_version(OLDEST_SUPPORTED):
        raise UnsupportedVersion(
            f"transformers {stack.transformers} is older than {OLDEST_SUPPORTED}, the oldest release stepsync "
            f"measured (supported: {OLDEST_SUPPORTED} to {MEASURED_TRANSFORMERS[-1]}, newer ones inferred): "
            "upgrade transformers")
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
        measured=stack.transformers in MEASURED_TRANSFORMERS,
        remainder_cut=REMAINDER_CUT.covers(stack.transformers),
        caveats=_caveats(stack),
    )


WITHOUT_AN_ENGINE = "no DeepSpeed: the optimizer steps where {framework} counts an update"


def without_an_engine(behaviour: StackBehaviour) -> StackBehaviour:
    """``behaviour`` for a run without DeepSpeed (DDP, FSDP, one device): the optimizer steps at the framework's own
    boundaries, so the updates follow its count; its counting, planning and resume arithmetic stay the release's."""
    return replace(behaviour, engine_boundary=EngineBoundary.FOLLOWS_TRAINER,
                   engine_reason=WITHOUT_AN_ENGINE.format(framework=behaviour.framework.name),
                   can_override_boundary=False)
