"""What each update did: the ones the engine counted but skipped, and the first after which the weights were not
finite. Read once per update (never per micro-batch), kept in the report, said once, and handed to the policy."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from ..core.events import DroppedWindow, LostGradients, NonFiniteUpdate, RanksApart, SkippedUpdate, UnsyncedUpdate
from .deepspeed import EngineFacts, FiniteWeights, WeightFingerprint, loss_scale
from .messages import Voice

if TYPE_CHECKING:  # pragma: no cover
    from ..core.report import SyncReport
    from .steering import PolicyAction


class Run(Protocol):
    """Where the run stands when an update is read, and whose policy hears of it (:class:`stepsync.engine.run.Run`)."""

    epoch: int
    position: int
    engine_steps_seen: int
    observing: bool
    action: PolicyAction

    def observe(self, observation: Callable[..., None], *args: Any) -> None: ...


class Updates:
    """What the engine's updates did, read once per update (never per micro-batch): the skips it counted and the
    first update after which the weights were not finite. Part of a :class:`~stepsync.engine.run.Run`, which hands
    itself in for where it stands and whose policy hears of each."""

    __slots__ = ("engine", "facts", "report", "voice", "skipped_seen", "weights", "weights_each_update",
                 "fingerprint", "ranks_agreed_at")

    def __init__(self, engine: Any, facts: EngineFacts, report: SyncReport, voice: Voice) -> None:
        self.engine, self.facts, self.report, self.voice = engine, facts, report, voice
        self.skipped_seen = engine.skipped_steps if facts.counts_skips else 0
        # An engine that applies non-finite gradients: its weights are read after every update, or at epoch ends.
        self.weights: Optional[FiniteWeights] = FiniteWeights(engine) if facts.unchecked_gradients else None
        self.weights_each_update = self.weights is not None and self.weights.each_update
        # Several ranks each holding a whole copy of the weights: the copies are compared where every rank stops.
        fingerprint = WeightFingerprint(engine) if facts.compares_ranks and facts.data_parallel_size > 1 else None
        self.fingerprint = fingerprint if fingerprint is not None and fingerprint.replicated else None
        self.ranks_agreed_at: Optional[int] = None

    def compare_ranks(self, run: Run, where: str) -> None:
        """Every rank's copy of the weights against the others' (one all-reduce, every rank together); the first
        difference is kept, said and given to the policy (every rank sees it: policy 'raise' stops them together),
        and nothing is compared after it."""
        if self.fingerprint is None:
            return
        if self.fingerprint.ranks_agree():
            self.ranks_agreed_at = self.engine.global_steps
            return
        self.fingerprint = None
        apart = RanksApart(max(run.epoch, 0) + 1, run.position, self.engine.global_steps, self.ranks_agreed_at, where,
                           self.facts.data_parallel_size)
        self.report.ranks_apart = apart
        if run.observing:
            run.observe(self.voice.finding, "ranks apart",
                        f"{apart}: a fault on one rank (a gradient left out of the average across ranks, weights "
                        "restored or written on one rank only, a hardware error) trains each rank apart from here; "
                        "resume from a checkpoint saved before they parted (policy 'raise' stops every rank where it "
                        "is found)")
        run.action.on_ranks_apart(apart)

    def took_a_skip(self, run: Run) -> None:
        """The engine counted an update it did not apply (its ``skipped_steps`` rose): the report keeps where, the
        policy hears of it, and the first whose data is lost is said at once (the summary counts the rest)."""
        self.skipped_seen = self.engine.skipped_steps
        searching = self.facts.skips_by_design
        at_minimum = searching and self._scale_was_at_its_minimum(run.engine_steps_seen)
        scale = loss_scale(self.engine) if searching else None
        skip = SkippedUpdate(max(run.epoch, 0) + 1, run.position, run.engine_steps_seen,
                             searching and not at_minimum, at_minimum, scale.now if scale is not None else None)
        self.report.engine_skipped = self.skipped_seen
        self.report.took_a_skip(skip)
        if run.observing:
            run.observe(self.say_skipped, skip)
        run.action.on_skipped_update(skip)

    def _scale_was_at_its_minimum(self, engine_steps: int) -> bool:
        """fp16: whether this skip found the loss scale already at its minimum, where the search can go no lower:
        the previous skip left it there and too few clean updates followed for it to grow."""
        scale = loss_scale(self.engine)
        before = self.report.skipped_updates[-1] if self.report.skipped_updates else None
        return (scale is not None and scale.now <= scale.minimum and before is not None
                and before.loss_scale is not None and before.loss_scale <= scale.minimum
                and engine_steps - before.engine_steps <= scale.window)

    def check_weights_now(self, run: Run) -> None:
        """Where the weights are read at epoch ends only (and at the end), read them."""
        if self.weights is not None and not self.weights_each_update and not self.weights.finite():
            self.took_non_finite(run)

    def took_non_finite(self, run: Run) -> None:
        """The weights are no longer finite after an update the engine applied: kept where, said, and given to
        the policy; later updates cannot make them finite again, so they are not read any more."""
        weights, self.weights, self.weights_each_update = self.weights, None, False
        assert weights is not None
        update = NonFiniteUpdate(max(run.epoch, 0) + 1, run.position, run.engine_steps_seen,
                                 weights.each_update, self.facts.unchecked_gradients)
        self.report.non_finite = update
        if run.observing:
            run.observe(self.say_non_finite, update)
        run.action.on_non_finite_update(update)

    def took_lost_gradients(self, run: Run, lost: LostGradients) -> None:
        """An update is about to leave out micro-batches the loop gave it: kept, the first said at once (the
        summary counts the rest), and given to the policy before the update is made."""
        self.report.took_lost_gradients(lost)
        if run.observing and self.report.updates_losing == 1:
            sync = "" if run.action.sets_the_boundary() else ", or use policy='sync'"
            run.observe(self.voice.finding, "micro-batches lost",
                        f"{lost}; call engine.set_gradient_accumulation_boundary(i == last) before each backward() "
                        "(or set \"managed_gradient_accumulation\": false in the DeepSpeed config, where your "
                        f"DeepSpeed has it){sync}; later updates that lose micro-batches are counted in the report")
        run.action.on_lost_gradients(lost)

    def took_an_unsynced_update(self, run: Run, found: UnsyncedUpdate) -> None:
        """An update is about to apply gradients other than its window's (where the sync was on): kept, the first
        said at once (the summary counts the rest), and given to the policy before the update is made."""
        self.report.took_an_unsynced_update(found)
        if run.observing and self.report.updates_unsynced == 1:
            run.observe(self.voice.finding, "gradient sync",
                        f"{found}; or use policy='sync'; later updates like it are counted in the report")
        run.action.on_unsynced_update(found)

    def took_a_dropped_window(self, run: Run, dropped: DroppedWindow) -> None:
        """A window cleared with no update after it: kept, the first said at once (the summary counts the rest);
        no policy stops on it (fp16's GradScaler does it by design)."""
        self.report.took_a_dropped_window(dropped)
        if run.observing and self.report.windows_dropped == 1:
            run.observe(self.voice.warn, f"{dropped}; later windows like it are counted in the report")

    def say_skipped(self, skip: SkippedUpdate) -> None:
        """The first skipped update of each kind, said at once; the summary counts the rest."""
        if (self.report.skips_by_design if skip.by_design else self.report.skips_lost) > 1:
            return
        if skip.by_design:
            self.voice.note(f"the engine skipped {skip}: fp16's dynamic loss scale skips updates while it searches for "
                            "a scale; engine.global_steps counts them, and the report counts them apart")
            return
        framework = self.report.framework
        schedule = (f"{framework.name} steps the LR scheduler on its own count, so the LR moved for it all the same "
                    "(stepsync cannot take a scheduler's step back)" if framework.schedules_on_its_count else
                    "the LR schedule does not move for it")
        self.voice.finding("skipped update",
                           f"the engine skipped {skip}. engine.global_steps counts it all the same, and {schedule}; "
                           "find the micro-batch whose loss is not finite in that window (policy 'raise' stops at the "
                           "first such update); later skips are counted in the report")

    def say_non_finite(self, update: NonFiniteUpdate) -> None:
        """Said once: the weights cannot become finite again, so nothing after it is said."""
        who = "The engine" if self.facts.deepspeed else "Your optimizer"
        self.voice.finding("weights not finite",
                           f"{update}. {who} counts this and every later update as made, and the LR schedule moves "
                           "on, but they train nothing: find the micro-batch whose loss is not finite (policy 'raise' "
                           "stops at this update)")

