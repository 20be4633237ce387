"""One watched run: where it is, what the engine did, the policy's decisions and the checks of both counts.

Every framework adapter drives a :class:`Run` the same way: :func:`stepsync.engine.lifecycle.open_run` builds one
when training starts, the adapter calls it once per event with the count its framework keeps and applies the
:class:`~stepsync.engine.steering.Steering` it gets back, and :func:`~stepsync.engine.lifecycle.close_run` ends it.
The run owns its report, its output and its policy's action; it never calls the adapter.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError, StepSyncError
from ..core.events import Cause, DriftEvent
from ..core.plan import RunPlan
from ..core.prediction import Forecast
from ..core.relayout import Layout
from ..core.report import EpochCount, SyncReport
from ..core.versions import StackBehaviour
from ..display.output import ConsoleOutput
from .deepspeed import engine_facts
from .messages import Voice
from .outcomes import Updates
from .steering import AT_DRIFT, EVERY_MICRO_BATCH, PolicyAction, Steering

# Causes that are a fact of one moment: each change with one of them is an entry of its own.
ONCE_EACH = (Cause.INHERITED, Cause.CAUGHT_UP)


class Run:
    """Where the run is, as stepsync counts it: epoch, position in the epoch, engine counters.

    Args:
        engine: the DeepSpeed engine (read: ``global_steps``; steered through its public boundary setter).
        behaviour: what the installed releases do.
        n: micro-batches per epoch on one rank (None when the dataloader has no length).
        g: gradient accumulation steps.
        report: the report this run fills (its ``framework`` names the count in every event).
        output: where the rich views are drawn.
        action: what acts for the policy.
        start_epoch, skip: where a resumed run starts (0-based epoch, micro-batches already done in it).
        is_main: whether this rank speaks (messages, views).
        plan: what the forecast is made from (None without a dataloader length).
        checks_every_micro_batch: compare both counts after every micro-batch, not only where the framework
            counted an update (an engine ahead of it shows between its updates).
        layout: how the run splits its data (ranks, batch, G, dataset length), kept in every record.

    Attributes:
        epoch: 0-based epoch now running (``-1`` before the first epoch begins).
        position: micro-batches done in this epoch (the Trainer's ``step + 1``).
        done_before_epoch: micro-batches this run trained before this epoch began.
        t_before_epoch: the Trainer's cross-epoch micro-batch counter before this epoch's position 0.
        engine_steps_seen: ``engine.global_steps`` after the last micro-batch.
        trainer_steps_seen: the framework's count at its last update (the report's counts catch up with both at
            every event, epoch end and the end).
        since_engine_update: micro-batches the engine accumulated since its last update.
        last_drift: the drift at the last check (the one an event changes).
        remedy: what each drift event tells the user to do (the stack's remedy, plus what the adapter adds).
        known_cause: why the counters part, once the adapter has seen it (for instance a backward outside
            ``accumulate()``); None until then.
        engine_at_last_update, engine_moved_in_window: the engine's count at the framework's last update, and
            whether it moved in the window that update closed.
        observing: checks, events, messages and metrics are on (a fault there turns them off on this rank
            only, and the policy keeps steering).
    """

    # What every micro-batch reads comes first: it shares the object's first cache lines.
    __slots__ = ("position", "engine", "engine_steps_seen", "since_engine_update", "steers", "observing", "report",
                 "counts_skips", "updates", "voice", "last_drift", "trainer_steps_seen", "action",
                 "engine_at_last_update", "engine_moved_in_window",
                 "facts", "behaviour", "n", "g", "output", "is_main", "plan", "epoch", "start_epoch", "skip",
                 "done_before_epoch", "t_before_epoch", "remedy", "known_cause", "checks_every_micro_batch", "layout",
                 "output_hooks", "token_weights", "loop_window_ends", "stopped", "changes_this_epoch")

    def __init__(self, engine: Any, behaviour: StackBehaviour, n: Optional[int], g: int, report: SyncReport,
                 output: ConsoleOutput, action: PolicyAction, start_epoch: int = 0, skip: int = 0,
                 is_main: bool = True, plan: Optional[RunPlan] = None, checks_every_micro_batch: bool = False,
                 layout: Optional[Layout] = None) -> None:
        self.engine = engine
        self.facts = engine_facts(engine)
        self.behaviour = behaviour
        self.n = n
        self.g = g
        self.report = report
        self.output = output
        self.is_main = is_main
        self.plan = plan
        self.action = action
        self.steers = int(self.action.steers)  # a plain int: compared on every micro-batch
        self.epoch = start_epoch - 1
        self.start_epoch = start_epoch
        self.skip = skip
        self.position = 0
        self.done_before_epoch = 0
        self.t_before_epoch = 0
        self.engine_steps_seen = engine.global_steps
        self.counts_skips = self.facts.counts_skips
        self.voice = Voice(report, is_main, output)
        self.voice.counts = self.counts_seen
        self.updates = Updates(engine, self.facts, report, self.voice)
        self.engine_at_last_update = self.engine_steps_seen
        self.trainer_steps_seen = 0
        self.engine_moved_in_window = False
        self.since_engine_update = 0
        self.last_drift = 0
        self.remedy = behaviour.remedy
        self.known_cause: Optional[Cause] = None
        self.observing = True
        self.checks_every_micro_batch = checks_every_micro_batch
        self.layout = layout
        self.output_hooks: Any = None  # stepsync.engine.outputs.OutputHooks, where a weight fault needs them
        self.token_weights: Any = None  # stepsync.engine.tokens.TokenWeights, until a window names its rule
        self.loop_window_ends: Optional[bool] = None  # the loop's word on the micro-batch running now
        self.stopped = False  # policy 'raise' stopped training inside a micro-batch: its epoch did not end
        self.changes_this_epoch = 0  # changes of a drift said once, summed at the epoch's end

    # ------------------------------------------------------------ the policy's decisions

    def begin(self) -> Optional[Steering]:
        """Start the policy (after the report's starting counts are set)."""
        return self._took(self.action.begin(self))

    def begin_epoch(self) -> None:
        if self.epoch >= self.start_epoch:
            self.done_before_epoch += self.position - self._first_position()
        self.epoch += 1
        self.changes_this_epoch = 0
        self.position = self._first_position()
        self.t_before_epoch = self.done_before_epoch - self.position
        self.action.before_epoch(self)

    def _first_position(self) -> int:
        """Where this epoch's training began: after the skipped micro-batches of a resumed epoch, else at 0."""
        return self.skip if self.epoch == self.start_epoch else 0

    def before_micro_batch(self, ends_window: bool) -> None:
        """A loop's own word on the micro-batch about to run: whether it ends the loop's window."""
        self.loop_window_ends = ends_window
        self.action.before_micro_batch(self, ends_window)

    def after_micro_batch(self, trainer_updated: bool, trainer_steps: int) -> Optional[Steering]:
        """One micro-batch is done (``trainer_updated``: the framework counted an update at it, reaching
        ``trainer_steps``). Reads the engine, asks the policy, checks both counts; returns what to change."""
        self.position += 1
        engine_steps = self.engine.global_steps
        engine_updated = engine_steps != self.engine_steps_seen
        if engine_updated:
            self.engine_steps_seen = engine_steps
            self.since_engine_update = 0
            updates = self.updates
            if self.counts_skips and self.engine.skipped_steps != updates.skipped_seen:  # once per update, not batch
                updates.took_a_skip(self)
            if updates.weights_each_update and not updates.weights.finite():  # type: ignore[union-attr]  # set together
                updates.took_non_finite(self)
        else:
            self.since_engine_update += 1
        steers = self.steers
        if not trainer_updated and steers != EVERY_MICRO_BATCH:  # most micro-batches of most policies end here
            if self.checks_every_micro_batch and self.observing and trainer_steps - engine_steps != self.last_drift:
                self.observe(self.check, trainer_steps, "batch_end")
            return None
        if trainer_updated:
            self.engine_moved_in_window = engine_steps != self.engine_at_last_update
            self.engine_at_last_update = engine_steps
        steering = None
        if steers > AT_DRIFT or (steers and trainer_steps != engine_steps):
            steering = self.action.after_micro_batch(self, trainer_updated, engine_updated, trainer_steps)
            if steering is not None:  # rare: the hot path makes no call for it
                self._took(steering)
                if steering.trainer_steps is not None:
                    trainer_steps = self._adopted(steering.trainer_steps)
        if trainer_updated or self.checks_every_micro_batch:
            self.trainer_steps_seen = trainer_steps
            # check()'s own test, without its call: the report's counts catch up at the next event or epoch end
            if self.observing and trainer_steps - self.engine_steps_seen != self.last_drift:
                self.observe(self.check, trainer_steps, "step_end" if trainer_updated else "batch_end")
        return steering

    def end_epoch(self, trainer_steps: int) -> Optional[Steering]:
        """The epoch is over: the policy's last word on it, then its check and its counts in the report."""
        self.engine_steps_seen = self.engine.global_steps
        if self.counts_skips and self.engine.skipped_steps != self.updates.skipped_seen:
            self.updates.took_a_skip(self)
        self.updates.check_weights_now(self)
        self.updates.compare_ranks(self, "epoch end")
        steering = self._took(self.action.at_epoch_end(self, trainer_steps))
        if steering is not None and steering.trainer_steps is not None:
            trainer_steps = self._adopted(steering.trainer_steps)
        self.trainer_steps_seen = trainer_steps
        if self.observing:
            self.observe(self._close_epoch, trainer_steps)
            self.observe(self.voice.track, trainer_steps, self.engine_steps_seen)
        return steering

    def finish(self, trainer_steps: int) -> bool:
        """Training ended: give the engine's boundary back and close the report. True when the engine's count
        moved after the last micro-batch (the framework loaded a checkpoint into it)."""
        self.action.end(self)
        for hooks in (self.output_hooks, self.token_weights):
            if hooks is not None:
                hooks.remove()
        if not self.facts.deepspeed:
            self.engine.stop_counting()
        self.updates.check_weights_now(self)
        if not self.observing:
            return False
        self.report.trainer_steps = trainer_steps
        self.report.engine_steps = self.engine_steps_seen
        self.report.engine_skipped = self.updates.skipped_seen
        self.report.unapplied_micro_batches = self.since_engine_update
        return self.engine.global_steps != self.engine_steps_seen

    def saved_checkpoint(self) -> None:
        """Every rank saved a checkpoint: their copies of the weights are compared, so that a checkpoint saved after
        they parted is known."""
        self.updates.compare_ranks(self, "checkpoint")

    def next_position(self) -> tuple:
        """(0-based epoch, micro-batches done in it) of the next micro-batch the run will train."""
        last = self.action.last_position(self)
        if last is not None and self.position >= last:
            return self.epoch + 1, 0
        return self.epoch, self.position

    def _adopted(self, trainer_steps: int) -> int:
        """The policy set the framework's count to ``trainer_steps`` (the engine's): one correction; a drift carried
        until now is taken back, not a new event."""
        self.report.corrections += 1
        if self.last_drift and trainer_steps == self.engine_steps_seen and self.observing:
            self.voice.note(f"policy '{self.policy.value}' set the {self.report.counter}'s count to the "
                            f"{self.report.updater}'s ({trainer_steps}) at epoch {self.epoch + 1}, micro-batch "
                            f"{self.position}: the drift {self.last_drift:+d} carried until then is taken back")
            self.last_drift = 0
        return trainer_steps

    def object_to(self, text: str, stops_at: str, refusal: type = StepSyncConfigError, error: bool = False) -> None:
        """What stepsync finds wrong, decided in one place, worded one way: under a policy that stops, ``refusal``
        raised with where it stops (``stops_at``: "before the first micro-batch", "at this save"); else warned (an
        ``error`` where every rank must hear it). Every rank reads the same, so every rank decides alike."""
        self.voice.alert(text, text)
        if self.policy.stops:
            raise refusal(f"{text}; policy '{self.policy.value}' stops {stops_at}")
        (self.voice.error if error else self.voice.warn)(text)

    def counts_seen(self) -> Tuple[int, int]:
        """The framework's count and the updates made, as the run last read them."""
        return self.trainer_steps_seen, self.engine_steps_seen

    @property
    def g_in_force(self) -> int:
        """The micro-batches per update the engine applies: its own G, else the framework's."""
        return self.facts.g_in_force(self.g)

    @property
    def updates_counted(self) -> str:
        """What the second count counts, in an event's words: the engine's updates, or the optimizer's steps."""
        return "DeepSpeed engine global_steps" if self.facts.deepspeed else "optimizer steps"

    @property
    def policy(self) -> Policy:
        """The policy acting now (the user's, or the one it fell back to); the report keeps a copy."""
        return self.action.policy

    def _took(self, steering: Optional[Steering]) -> Optional[Steering]:
        if steering is not None and steering.replacement is not None:
            self.action = steering.replacement
            self.steers = int(self.action.steers)  # a plain int: compared on every micro-batch
            self.report.policy = self.action.policy
        return steering

    # ------------------------------------------------------------ checks

    def check(self, trainer_steps: int, where: str, remedy: Optional[str] = None) -> None:
        """Compare both counts; every change of the drift is one event (logged, drawn, handed to the policy)."""
        report = self.report
        report.trainer_steps = self.trainer_steps_seen = trainer_steps
        report.engine_steps = self.engine_steps_seen
        drift = trainer_steps - self.engine_steps_seen
        if drift == self.last_drift:
            return
        cause = self.cause_of(where, drift)
        last = report.events[-1] if report.events else None
        if last is not None and last.cause is cause and cause not in ONCE_EACH:  # one entry, said where it started
            event = last.continued(max(self.epoch, 0) + 1, self.position, trainer_steps, self.engine_steps_seen)
            report.events[-1] = event
            self.last_drift = drift
            self.changes_this_epoch += 1
            self.action.on_drift(event)
            return
        event = DriftEvent(
            epoch=max(self.epoch, 0) + 1,
            micro_batch=self.position if where != "train_begin" else 0,
            trainer_steps=trainer_steps,
            engine_steps=self.engine_steps_seen,
            previous_drift=self.last_drift,
            cause=cause,
            remedy=remedy or self.remedy,
            where=where,
            counter=report.framework.counter,
            updates=self.updates_counted,
        )
        self.last_drift = drift
        report.events.append(event)
        self.voice.drift(event)
        self.action.on_drift(event)

    def cause_of(self, where: str, drift: int, position: Optional[int] = None) -> Cause:
        """Why the drift is ``drift`` at ``where`` (at micro-batch ``position`` of the epoch; now by default)."""
        position = self.position if position is None else position
        if where == "train_begin":
            return Cause.INHERITED
        if drift == self.report.inherited_drift:
            return Cause.CAUGHT_UP
        if self.known_cause is not None:  # what the adapter saw explains the drift either way
            return self.known_cause
        if drift < self.last_drift:
            return Cause.ENGINE_AHEAD
        if self.n is not None and position == self.n:
            return Cause.TINY_EPOCH if self.n <= self.g else Cause.PARTIAL_WINDOW
        return Cause.UNEXPLAINED

    def _close_epoch(self, trainer_steps: int) -> None:
        """The epoch's check, its counts in the report, and their comparison with the forecast."""
        self.check(trainer_steps, "epoch_end")
        if self.changes_this_epoch:  # a drift said once where it started: its sum, once an epoch
            self.voice.drift_went_on(self.epoch + 1, self.report.events[-1], self.changes_this_epoch)
        self.report.epochs.append(EpochCount(self.epoch + 1, self.position - self._first_position(), trainer_steps,
                                             self.engine_steps_seen, self.updates.skipped_seen))
        predicted: Optional[Forecast] = self.report.forecast
        if predicted is None or self.stopped:
            return
        epoch = self.epoch + 1
        row = next((r for r in predicted.epochs if r.epoch == epoch), None)
        seen = (trainer_steps, self.engine_steps_seen)
        if row is None or (row.trainer_steps, row.engine_steps) != seen:
            expected = "no such epoch" if row is None else f"{row.trainer_steps}/{row.engine_steps}"
            text = f"epoch {epoch}: counts {seen[0]}/{seen[1]} differ from the forecast {expected}"
            self.report.forecast_mismatches.append(text)
            if len(self.report.forecast_mismatches) == 1:
                why = f"because of the {self.known_cause.value}" if self.known_cause else "please report this stack"
                self.voice.differs_from_the_forecast(text, why)

    def drop(self, epoch: int, micro_batches: int) -> None:
        """``micro_batches`` of (1-based) ``epoch`` are left untrained by the policy."""
        self.report.dropped_micro_batches[epoch] = micro_batches

    def observe(self, observation, *args) -> None:
        """Run one observation; a fault in it ends observing on this rank and never changes the steering."""
        try:
            observation(*args)
        except StepSyncError:
            raise
        except Exception as exc:
            self.stop_observing(getattr(observation, "__name__", "a check").lstrip("_"), exc)

    def stop_observing(self, where: str, exc: Exception) -> None:
        """A fault of the observing: no more checks, messages or metrics on this rank; the policy goes on (policy
        'raise' stops the run instead)."""
        reason = f"internal error in {where}: {exc!r}"
        if self.policy.stops:
            raise exc
        self.observing = False
        self.report.active = False
        self.report.inactive_reason = f"{reason}; stopped observing, policy '{self.policy.value}' still acts"
        self.voice.stopped_observing(self.policy.value, reason, exc)
