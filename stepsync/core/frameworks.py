"""Each training framework stepsync watches, described once: the display, the messages, the metrics, the policy
checks, the forecast and the command line read these descriptions, never prose. A new framework is one folder of
adapters and one description here."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Dict, FrozenSet, List, Optional, Tuple, Union

from .choices import Policy, unsupported
from .errors import StepSyncConfigError


class _Named(str, Enum):
    """A member prints as its value in messages and tables, as the release rows print it."""

    def __str__(self) -> str:
        return self.value


# accelerate's examples/by_feature/gradient_accumulation_for_autoregressive_models.py, for every loop.
LOOP_LOSS_FIX = ("sum each micro-batch's token losses and divide by the trained tokens of its whole window (counted "
                 "before the window starts), then multiply by G where the framework divides by G (accelerate's "
                 "gradient_accumulation_for_autoregressive_models example); or declare the rule meant: "
                 "loss_normalisation='micro_batch_mean' or 'sequence_mean'")
TRAINER_LOSS_FIX = ("divide the summed token losses by num_items_in_batch in your model's forward or compute_loss (a "
                    "transformers model does); model.accepts_loss_kwargs = False makes the Trainer average each "
                    "micro-batch's own mean instead; or declare the rule meant: "
                    "StepSyncCallback(loss_normalisation='micro_batch_mean' or 'sequence_mean')")


# A compute_loss_func gets num_items_in_batch, and the Trainer then never divides its loss by G itself, whatever
# model.accepts_loss_kwargs says (tests/integration/test_token_weights.py runs both fixes).
COMPUTE_LOSS_FUNC_FIX = ("divide the summed token losses by num_items_in_batch in your compute_loss_func (the Trainer "
                         "passes it, and then never divides the loss by G itself); or declare the rule meant: "
                         "StepSyncCallback(loss_normalisation='micro_batch_mean' or 'sequence_mean')")
# Where the release was not measured to pass it (4.46.3 passes None).
COMPUTE_LOSS_FUNC_FIX_OLDER = ("divide the summed token losses by the trained tokens of the whole window in your "
                               "compute_loss_func: its num_items_in_batch where the Trainer passes it (transformers "
                               "4.57.6 and 5.x do, 4.46.3 passes None: there count them yourself, or upgrade); or "
                               "declare the rule meant: StepSyncCallback(loss_normalisation='micro_batch_mean' or "
                               "'sequence_mean')")


# How a framework's users compute a window's loss, as verify measures it: (the loss path, what it is, in words).
# The path names what the summed token losses are divided by (stepsync.tools.measurement).
OWN_MEAN = "own mean"
ITEMS_IN_BATCH = "divided by num_items_in_batch"
WINDOW_TOKENS_TIMES_G = "window tokens, times G"
LOOP_LOSS_PATHS = (
    (OWN_MEAN, "each micro-batch's own mean, as F.cross_entropy gives it (the examples)"),
    (WINDOW_TOKENS_TIMES_G, "summed and divided by the window's trained tokens, times G (accelerate's "
                            "gradient_accumulation_for_autoregressive_models example)"))
TRAINER_LOSS_PATHS = (
    (ITEMS_IN_BATCH, "a transformers model's loss (the Trainer passes num_items_in_batch and does not divide by G, "
                     "as transformers 4.47 and later do)"),
    ("own mean, not divided by G", "a model whose forward takes **kwargs and ignores num_items_in_batch"))
LIGHTNING_LOSS_PATHS = ((OWN_MEAN, "each micro-batch's own mean, as F.cross_entropy gives it"),)


class TrainerRule(_Named):
    """When the Trainer counts an update at micro-batch ``s`` (0-based in the epoch) of ``N``."""

    EPOCH_WINDOW = "epoch_window"  # (s+1) % G == 0 or (N <= G and s+1 == N)
    GLOBAL_COUNTER = "global_counter"  # t % G == 0 or (N <= G and s+1 == N), t counted across epochs
    EPOCH_END = "epoch_end"  # (s+1) % G == 0 or s+1 == N
    WHOLE_WINDOWS = "whole_windows"  # (s+1) % G == 0 only: an epoch's partial last window is never an update



class EngineBoundary(_Named):
    """Who decides when the DeepSpeed engine updates."""

    MICRO_COUNTER = "micro_counter"  # engine.step() on every micro-batch: (micro_steps+1) % G == 0
    FOLLOWS_TRAINER = "follows_trainer"  # set_gradient_accumulation_boundary(sync_gradients) each micro-batch
    NEVER_STEPPED = "never_stepped"  # the loop steps the optimizer itself: the engine's count never moves



class PlannedSteps(_Named):
    """How the Trainer plans ``max_steps`` from ``num_train_epochs``."""

    FLOOR = "floor"  # E * max(N // G, 1)
    CEIL = "ceil"  # E * ceil(N / G)
    WHOLE = "whole"  # E * (N // G), and the loop runs every epoch whatever it counts



class SavedFolders(_Named):
    """The checkpoint folders a framework saves, as ``stepsync inspect`` reads them."""

    TRAINER = "trainer"  # checkpoint-N (and Ray Train's): the framework's count is in its trainer_state.json
    ACCELERATE = "accelerate"  # accelerator.save_state: DeepSpeed's files in the tag its 'latest' names
    ENGINE = "deepspeed"  # engine.save_checkpoint: the folder is DeepSpeed's tag itself

    @property
    def count_in_the_record(self) -> bool:
        """A loop saved it: the loop's count is in stepsync's record only, not in the folder's own files."""
        return self is not SavedFolders.TRAINER

    @property
    def is_the_tag(self) -> bool:
        """The folder is DeepSpeed's tag folder itself (its parent holds 'latest')."""
        return self is SavedFolders.ENGINE


class BackwardCall(str, Enum):
    """How a framework calls the engine's backward (what each micro-batch's weight depends on, as probed)."""

    ENGINE = "engine"  # engine.backward(loss): a plain DeepSpeed loop, Fabric; the engine divides by G
    ACCELERATE = "accelerate"  # the same, inside accelerate's accumulate()
    TRAINER = "trainer"  # engine.backward(loss / G, scale_wrt_gas=False): transformers' Trainer
    LIGHTNING = "lightning"  # engine.backward(loss / G): Lightning's closure divides, and the engine again
    FULLY_SHARD = "fully_shard"  # loss.backward() on a model FSDP2 shards: no engine; the loop's own division
    DDP = "ddp"  # loss.backward() on a model DDP replicates, the window's others under no_sync(): no engine

    @property
    def through_an_engine(self) -> bool:
        """The backward goes through a DeepSpeed engine (what ``stepsync verify`` builds from a config)."""
        return self not in (BackwardCall.FULLY_SHARD, BackwardCall.DDP)

    @property
    def fully_sharded(self) -> bool:
        """The backward goes through FSDP2 (what ``stepsync verify`` measures without an engine)."""
        return self is BackwardCall.FULLY_SHARD

    def backward(self, engine: Any, loss: Any, g: int, items_counted: bool = False) -> None:
        """Hand one micro-batch's ``loss`` to ``engine`` as this framework does (``g``: its G); ``items_counted``:
        the Trainer passes num_items_in_batch to a model that takes it, and then does not divide by G itself."""
        if self is BackwardCall.TRAINER:  # a new tensor, as the Trainer's (loss times the ranks): DeepSpeed's
            # hooks on the model's own output (0.18.3 on) divide that tensor by G whatever scale_wrt_gas says
            engine.backward(loss * 1 if items_counted else loss / g, scale_wrt_gas=False)
        elif self is BackwardCall.LIGHTNING:
            engine.backward(loss / g)
        elif self.through_an_engine:
            engine.backward(loss)
        else:  # torch's own: the loop divides, no engine does
            loss.backward()

    @property
    def as_probed(self) -> BackwardCall:
        """The call the weight probes measured that weighs micro-batches as this one does: Lightning's extra
        division scales every micro-batch alike (its loss_divisions), so its faults are the engine call's."""
        return BackwardCall.ENGINE if self is BackwardCall.LIGHTNING else self


@dataclass(frozen=True)
class Refusal:
    """Why a framework cannot have the policies that do one thing, and what to use instead.

    Attributes:
        does: the :class:`Policy` property that is true of the policies refused (``"follows_the_engine"``).
        why: what the policy would have to change that it cannot (``"cannot end your dataloader's epochs early"``).
        instead: the policies that serve instead, best first.
        or_else: a fix outside stepsync, in words (``"drop the partial window in your loop"``); empty for none.
    """

    does: str
    why: str
    instead: Tuple[Policy, ...]
    or_else: str = ""

    def refuses(self, policy: Policy) -> bool:
        return bool(getattr(policy, self.does))

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
        metric_keys: the metrics of its count, the engine's count and the drift, in that order (a run without
            DeepSpeed names the optimizer's steps instead of the engine's, :func:`stepsync.core.tracking.run_metrics`).
        refused: the policies it cannot have, each with why and what to use instead (:class:`Refusal`).
        remedy: what a user of it does about a drift; None where that depends on the installed releases (the
            Trainer's and accelerate's, :attr:`stepsync.core.versions.StackBehaviour.remedy`).
        schedules_on_its_count: it steps the LR scheduler itself on its own count (Lightning takes DeepSpeed's
            scheduler over), so the LR moves at an update the engine skipped; elsewhere DeepSpeed steps it at the
            updates it applies.
        backward_call: how it calls the engine's backward (:class:`BackwardCall`).
        key: its name on the command line (``--framework``).
        counts_by, plans_by, engine_stepped: where the framework's own loop fixes how it counts its updates, how
            it plans them and whether the engine steps, whatever the releases (a user's loop); None where the
            release table decides. ``engine_reason``: why the engine updates where it does, then.
        ends_epochs_under: the policies under which an epoch trains its whole windows only (the framework ends it
            there, or stepsync does), leaving its last partial window untrained.
        g_setting: the name of its gradient accumulation setting, in messages; ``g_fix``: what makes it and the
            engine's one G where they differ.
        plans_by_forecast: it plans no count of its own that stepsync can read (Lightning runs its epochs): the
            forecast's plan is taken as its plan.
        checks_every_micro_batch: both counts are compared after every micro-batch, not only where it counted an
            update (an engine ahead of it shows between its updates).
        packages: the releases that decide how it counts (a forecast for another machine names them); with
            "lightning" among them the Lightning rows say how it counts (:attr:`releases`), else the Trainer's.
        loss_divisions: how many times a micro-batch's loss is divided by G where its loop fixes that, whatever
            the releases (None: the release table says); ``caveat``: what the forecast cannot know of it.
        loss_fix: how a user of it makes each window's loss a mean over its trained tokens, in a message.
        no_length: what a run without its dataloader's length misses, and the fix, as its start says it.
        checkpoints: the folders ``stepsync inspect`` reads of it (:class:`SavedFolders`), or None where it saves
            none that it reads.
        loss_paths: the ways its users compute a window's loss, each ``(path, words)``, that ``stepsync verify``
            measures each trained token's weight under (``path`` one of :data:`OWN_MEAN`, :data:`ITEMS_IN_BATCH`,
            :data:`WINDOW_TOKENS_TIMES_G`, or another name for the micro-batch's own mean).
    """

    name: str
    who: str
    counter: str
    whose_g: str
    key: str
    metric_keys: Tuple[str, ...] = ()
    refused: Tuple[Refusal, ...] = field(default=(), compare=False)
    remedy: Optional[str] = None
    schedules_on_its_count: bool = False
    backward_call: BackwardCall = BackwardCall.ENGINE
    counts_by: Optional[TrainerRule] = None
    plans_by: Optional[PlannedSteps] = None
    engine_stepped: Optional[EngineBoundary] = None
    engine_reason: str = ""
    ends_epochs_under: FrozenSet[Policy] = frozenset()
    g_setting: str = "gradient_accumulation_steps"
    g_fix: str = 'fix the DeepSpeed config (use "auto")'
    plans_by_forecast: bool = False
    checks_every_micro_batch: bool = False
    checkpoints: Optional[SavedFolders] = None
    no_length: str = "the train dataloader has no length: no forecast, and 'sync'/'drop_last' cannot plan windows"
    loss_divisions: Optional[int] = None
    caveat: str = ""
    packages: Tuple[str, ...] = ("transformers", "accelerate", "deepspeed")
    loss_fix: str = LOOP_LOSS_FIX
    loss_paths: Tuple[Tuple[str, str], ...] = LOOP_LOSS_PATHS

    @property
    def releases(self) -> str:
        """Whose release table says how it counts: "lightning", or "transformers" (the Trainer's rows, with
        accelerate's and DeepSpeed's)."""
        return "lightning" if "lightning" in self.packages else "transformers"

    def applied_to(self, behaviour: Any) -> Any:
        """What the installed releases do (a :class:`stepsync.core.versions.StackBehaviour`), run by this
        framework: its own counting, planning and engine stepping where its loop fixes them."""
        changes: Dict[str, Any] = {"framework": self}
        if self.counts_by is not None:
            changes["trainer_rule"] = self.counts_by
        if self.plans_by is not None:
            changes["planned_steps"] = self.plans_by
        if self.loss_divisions is not None:
            changes["loss_divisions"] = self.loss_divisions
        if self.caveat:
            changes["caveats"] = (*behaviour.caveats, self.caveat)
        if self.engine_stepped is not None:
            changes["engine_boundary"], changes["engine_reason"] = self.engine_stepped, self.engine_reason
        return replace(behaviour, **changes)

    def parse_policy(self, policy: Union[str, Policy], as_flag: bool = False) -> Policy:
        """``policy`` as a :class:`Policy`; an unknown one, or one this framework refuses, raises
        :class:`~stepsync.core.errors.StepSyncConfigError` (a ``ValueError``) naming what to use."""
        parsed = Policy.parse(policy)
        refusal = self.refusal_of(parsed)
        if refusal is not None:
            raise StepSyncConfigError(refusal.message(parsed, as_flag))
        return parsed

    def refusal_of(self, policy: Policy) -> Optional[Refusal]:
        """Why this framework cannot have ``policy``, or None where it can."""
        return next((refusal for refusal in self.refused if refusal.refuses(policy)), None)


TRAINER = Framework(
    name="the Trainer", who="Trainer", counter="Trainer global_step", whose_g="the Trainer's", key="trainer",
    metric_keys=("stepsync/trainer_steps", "stepsync/engine_steps", "stepsync/drift"),
    backward_call=BackwardCall.TRAINER, ends_epochs_under=frozenset({Policy.DROP_LAST}),
    checkpoints=SavedFolders.TRAINER,
    loss_fix=TRAINER_LOSS_FIX, loss_paths=TRAINER_LOSS_PATHS)

LIGHTNING = Framework(
    name="Lightning", who="Lightning", counter="Lightning global_step",
    whose_g="Lightning's accumulate_grad_batches", key="lightning", backward_call=BackwardCall.LIGHTNING,
    ends_epochs_under=frozenset({Policy.SYNC, Policy.DROP_LAST}),
    g_setting="accumulate_grad_batches", plans_by_forecast=True, checks_every_micro_batch=True,
    packages=("lightning", "deepspeed"), loss_paths=LIGHTNING_LOSS_PATHS,
    metric_keys=("stepsync/lightning_steps", "stepsync/engine_steps", "stepsync/drift"),
    refused=(Refusal("follows_the_engine", "cannot apply to Lightning: its global_step is derived from its loop's "
                     "progress counters, which a callback cannot set", (Policy.SYNC, Policy.DROP_LAST)),),
    remedy="use stepsync.lightning.StepSyncCallback(policy='sync')", schedules_on_its_count=True)

# What a loop a user writes misses without its dataloader's length (the watch is given it, or not).
LOOP_NO_LENGTH = ("no dataloader length: pass dataloader=... (one with a length) to stepsync.watch() to tell its "
                  "epochs apart and for a forecast")

# accelerate's accumulate() is the epoch-end rule: a window every G micro-batches, restarted at the dataloader's
# end; the run_*_no_trainer.py examples plan epochs * ceil(N / G) updates.
ACCELERATE_LOOP = Framework(
    no_length=LOOP_NO_LENGTH,
    name="your loop", who="your loop", counter="loop updates", whose_g="the accelerator's", key="accelerate",
    metric_keys=("stepsync/loop_steps", "stepsync/engine_steps", "stepsync/drift"),
    backward_call=BackwardCall.ACCELERATE, counts_by=TrainerRule.EPOCH_END, plans_by=PlannedSteps.CEIL,
    checkpoints=SavedFolders.ACCELERATE, packages=("accelerate", "deepspeed"),
    g_fix="give Accelerator(gradient_accumulation_steps=...) the G your DeepSpeed config or plugin sets (accelerate "
          "before 1.8 does not take it from there), or set it to \"auto\" there",
    refused=(Refusal("follows_the_engine", "cannot change your loop's own counter", (Policy.SYNC,),
                     "keep policy 'warn' and adopt watch.report.engine_steps"),
             Refusal("ends_epochs_early", "cannot end your dataloader's epochs early", (Policy.SYNC,),
                     "drop the partial window in your loop")))

# Fabric's documented loop steps at every G-th micro-batch of an epoch (its leftovers join the next epoch's first
# window) and runs every epoch; its optimizer.step() updates the weights without engine.step().
FABRIC_LOOP = Framework(
    no_length=LOOP_NO_LENGTH,
    name="your Fabric loop", who="your loop", counter="your loop's optimizer.step() count",
    whose_g="the DeepSpeed config's", key="fabric", counts_by=TrainerRule.WHOLE_WINDOWS,
    metric_keys=("stepsync/loop_steps", "stepsync/engine_steps", "stepsync/drift"),
    plans_by=PlannedSteps.WHOLE, engine_stepped=EngineBoundary.NEVER_STEPPED,
    engine_reason="your Fabric loop steps the optimizer itself and never calls engine.step(): the engine's count "
                  "stays where it was",
    loss_divisions=1, packages=("lightning", "deepspeed"),
    caveat="your Fabric loop divides each loss by G; DeepSpeed divides it once more where its config's "
           "gradient_accumulation_steps is G (each micro-batch then weighs 1/G^2): stepsync verify --framework fabric "
           "measures your config",
    refused=(Refusal("follows_the_engine", "cannot change your loop's own count", (Policy.SYNC, Policy.WARN)),
             Refusal("ends_epochs_early", "cannot end your dataloader's epochs early", (Policy.SYNC, Policy.WARN))),
    remedy="use stepsync.lightning.watch(fabric, ..., policy='sync')")

# A loop that drives the engine itself, as DeepSpeed-Chat's training steps do: backward() and step() after every
# micro-batch, the engine updating at every G-th by its own counter, across epochs, while the loop plans its LR
# schedule as epochs * ceil(N / G) (its windows restart at each epoch). A loop that calls backward() several times
# per step() closes its own windows at each step() (the watch learns which at the first step()).
DEEPSPEED_LOOP = Framework(
    no_length=LOOP_NO_LENGTH,
    name="your DeepSpeed loop", who="your loop", counter="loop windows", whose_g="the DeepSpeed config's",
    key="deepspeed", counts_by=TrainerRule.EPOCH_END, plans_by=PlannedSteps.CEIL,
    engine_stepped=EngineBoundary.MICRO_COUNTER,
    engine_reason="your loop calls engine.step() after every micro-batch: the engine updates at every G-th by its "
                  "own counter, which never restarts at an epoch",
    metric_keys=("stepsync/loop_steps", "stepsync/engine_steps", "stepsync/drift"),
    remedy="use stepsync.watch(engine, policy='sync'), or close each epoch's last window yourself: "
           "engine.set_gradient_accumulation_boundary(True) before its last backward(), False before the others",
    g_fix="make the DeepSpeed config's gradient_accumulation_steps the windows your loop closes",
    refused=(Refusal("follows_the_engine", "cannot change your loop's own count", (Policy.SYNC,),
                     "keep policy 'warn' and adopt watch.report.engine_steps"),
             Refusal("ends_epochs_early", "cannot end your dataloader's epochs early", (Policy.SYNC,),
                     "drop each epoch's partial window in your loop")),
    packages=("deepspeed",), checkpoints=SavedFolders.ENGINE)

# A torch-native loop whose model is sharded with FSDP2 (fully_shard), as torchtitan's and PyTorch's examples
# write it: the loop closes a window every G micro-batches and at the dataloader's end, turns the gradient sync on
# for each window's last micro-batch (model.set_requires_gradient_sync(is_last)) and steps its optimizer there.
FSDP_LOOP = Framework(
    no_length=LOOP_NO_LENGTH,
    name="your FSDP2 loop", who="your loop", counter="loop windows", whose_g="your loop's", key="fsdp",
    counts_by=TrainerRule.EPOCH_END, plans_by=PlannedSteps.CEIL, engine_stepped=EngineBoundary.FOLLOWS_TRAINER,
    engine_reason="your loop steps its optimizer itself: each update is an optimizer.step() of the loop's",
    metric_keys=("stepsync/loop_steps", "stepsync/optimizer_steps", "stepsync/drift"),
    remedy="use stepsync.watch(model, optimizer=..., policy='sync'), which turns the gradient sync on at the last "
           "micro-batch of each of your loop's windows",
    backward_call=BackwardCall.FULLY_SHARD,
    g_fix="pass stepsync.watch(model, gradient_accumulation_steps=G) the G your loop steps its optimizer at",
    refused=(Refusal("follows_the_engine", "cannot change your loop's own count", (Policy.SYNC, Policy.WARN)),
             Refusal("ends_epochs_early", "cannot end your dataloader's epochs early", (Policy.SYNC,),
                     "drop each epoch's partial window in your loop")),
    packages=("torch",))

# The same loop around a DistributedDataParallel model: the window's other micro-batches run under model.no_sync().
DDP_LOOP = replace(
    FSDP_LOOP, name="your DDP loop", key="ddp", backward_call=BackwardCall.DDP,
    remedy="use stepsync.watch(model, optimizer=..., policy='sync'), which turns DDP's gradient sync on at the last "
           "micro-batch of each of your loop's windows (as if the others ran under model.no_sync())")

FRAMEWORKS = (TRAINER, LIGHTNING, ACCELERATE_LOOP, FABRIC_LOOP, DEEPSPEED_LOOP, FSDP_LOOP, DDP_LOOP)
_REGISTERED: List[Framework] = []  # frameworks described outside stepsync, by register()


def register(framework: Framework) -> Framework:
    """Make a framework described outside stepsync known wherever a framework is named: ``stepsync check
    --framework KEY`` and ``verify --framework KEY`` in this process, and the folders ``inspect`` reads. Its
    adapter is built on :class:`stepsync.engine.watch.FrameworkWatch`. Registering it again changes nothing; another
    framework under a key already taken raises :class:`~stepsync.core.errors.StepSyncConfigError`."""
    taken = next((known for known in known_frameworks() if known.key == framework.key), None)
    if taken is framework:
        return framework
    if taken is not None:
        raise StepSyncConfigError(f"a framework is already known as {framework.key!r} ({taken.name}): give "
                                  f"{framework.name} another key")
    _REGISTERED.append(framework)
    return framework


def known_frameworks() -> Tuple[Framework, ...]:
    """stepsync's frameworks, then those registered (:func:`register`)."""
    return FRAMEWORKS + tuple(_REGISTERED)


def framework_called(key: str) -> Framework:
    """The framework whose command-line name is ``key``."""
    for framework in known_frameworks():
        if framework.key == key:
            return framework
    raise StepSyncConfigError(unsupported("--framework", key, [f.key for f in known_frameworks()]))
