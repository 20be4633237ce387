"""One watched run: where it is, what the engine did, and the checks that compare both counts.

Shared by the Trainer callback (``callback.py``) and the custom-loop watch (``loop.py``): each feeds it the
count its side keeps (``state.global_step``, or the loop's updates) and it keeps the report.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from ..core.choices import Policy
from ..core.forecast import Forecast, RunPlan
from ..core.report import Cause, DriftEvent, EpochCount, SyncReport
from ..core.versions import StackBehaviour
from . import engine as engine_adapter

logger = logging.getLogger("stepsync")


class RunTracker:
    """Where the run is, as stepsync counts it: epoch, position in the epoch, engine counters.

    ``owner`` is the callback or the loop watch that holds the report, the policy's action (``_action``) and
    the console (``output``).

    Attributes:
        epoch: 0-based epoch now running (``-1`` before the first epoch begins).
        position: micro-batches done in this epoch (the Trainer's ``step + 1``).
        micro_batches: micro-batches done since training began.
        t_before_epoch: the Trainer's cross-epoch micro-batch counter before this epoch's position 0.
        engine_steps_seen: ``engine.global_steps`` after the last micro-batch.
        since_engine_update: micro-batches the engine accumulated since its last update.
        last_drift: the drift at the last check (the one an event changes).
        remedy: what each drift event tells the user to do (the stack's remedy, plus what the framework adds).
        known_cause: why the counters part, once the adapter has seen it (for instance a backward outside
            ``accumulate()``); None until then.
        plan: what the forecast was made from (None when the dataloader has no length).
        state: the Trainer's ``TrainerState`` (None for a custom loop).
        trainer: the Trainer (None for a custom loop).
    """

    __slots__ = ("owner", "engine", "facts", "behaviour", "n", "g", "is_main", "report", "epoch", "start_epoch",
                 "skip", "position", "micro_batches", "t_before_epoch", "engine_steps_seen", "since_engine_update",
                 "plan", "state", "trainer", "last_drift", "remedy", "known_cause")

    def __init__(self, owner: Any, engine: Any, behaviour: StackBehaviour, n: Optional[int], g: int,
                 start_epoch: int = 0, skip: int = 0, is_main: bool = True) -> None:
        self.owner = owner
        self.engine = engine
        self.facts = engine_adapter.engine_facts(engine)
        self.behaviour = behaviour
        self.n = n
        self.g = g
        self.is_main = is_main
        self.report: SyncReport = owner.report
        self.epoch = start_epoch - 1
        self.start_epoch = start_epoch
        self.skip = skip
        self.position = 0
        self.micro_batches = 0
        self.t_before_epoch = 0
        self.engine_steps_seen = engine.global_steps
        self.since_engine_update = 0
        self.plan: Optional[RunPlan] = None
        self.state: Any = None
        self.trainer: Any = None
        self.last_drift = 0
        self.remedy = behaviour.remedy
        self.known_cause: Optional[Cause] = None

    # ------------------------------------------------------------ messages

    def note(self, text: str) -> None:
        self.report.notes.append(text)
        if self.is_main:
            logger.info("stepsync: %s", text)

    def warn(self, text: str) -> None:
        self.report.notes.append(text)
        if self.is_main:
            logger.warning("stepsync: %s", text)

    def error(self, text: str) -> None:
        self.report.notes.append(text)
        logger.error("stepsync: %s", text)

    def state_what_differs(self, whose_g: str) -> None:
        """Say once, at the start, what makes this run differ from what the forecast assumes."""
        if self.n is None:
            self.note("the train dataloader has no length: no forecast, and 'sync'/'drop_last' cannot plan windows")
        if self.facts.gradient_accumulation_steps not in (None, self.g):
            self.error(f"the engine's gradient_accumulation_steps={self.facts.gradient_accumulation_steps} differs "
                       f"from {whose_g} {self.g}: fix the DeepSpeed config (use \"auto\")")
        if not self.facts.managed_accumulation:
            self.note("DeepSpeed's managed_gradient_accumulation is false: the engine updates at every step() call, "
                      "not at its own boundaries; the forecast assumes managed accumulation and will differ")
        for caveat in self.behaviour.caveats:
            self.note(caveat)

    # ------------------------------------------------------------ policy

    def replace_action(self, action):
        self.owner._action = action
        return action

    def next_position(self) -> tuple:
        """(0-based epoch, micro-batches done in it) of the next micro-batch the run will train."""
        if self.n is not None and self.position >= self.owner._action.last_position(self):
            return self.epoch + 1, 0
        return self.epoch, self.position

    def fall_back(self, reason: Optional[str]):
        """Switch to ``realign`` for the rest of the run, never silently drifting on."""
        from .policies import RealignAction  # the policies know the tracker; the tracker names one policy

        if reason:
            self.error(f"{reason}; falling back to policy 'realign'")
        self.report.policy = Policy.REALIGN
        action = RealignAction()
        action.begin(self)
        return self.replace_action(action)

    # ------------------------------------------------------------ counting

    def begin_epoch(self) -> None:
        self.epoch += 1
        self.position = self.skip if self.epoch == self.start_epoch else 0
        self.t_before_epoch = self.micro_batches - self.position

    def micro_batch_done(self) -> bool:
        """Advance past one micro-batch and read the engine; True when the engine made an update in it."""
        self.position += 1
        self.micro_batches += 1
        engine_steps = self.engine.global_steps
        engine_updated = engine_steps != self.engine_steps_seen
        self.since_engine_update = 0 if engine_updated else self.since_engine_update + 1
        self.engine_steps_seen = engine_steps
        return engine_updated

    def check(self, trainer_steps: int, where: str, remedy: Optional[str] = None) -> None:
        """Compare both counts; every change of the drift is one event (logged, drawn, handed to the policy)."""
        report = self.report
        report.trainer_steps = trainer_steps
        report.engine_steps = self.engine_steps_seen
        drift = trainer_steps - self.engine_steps_seen
        if drift == self.last_drift:
            return
        event = DriftEvent(
            epoch=max(self.epoch, 0) + 1,
            micro_batch=self.position if where != "train_begin" else 0,
            trainer_steps=trainer_steps,
            engine_steps=self.engine_steps_seen,
            previous_drift=self.last_drift,
            cause=self._cause(where, drift),
            remedy=remedy or self.remedy,
            where=where,
            counter=getattr(self.owner, "counter", "Trainer global_step"),
        )
        self.last_drift = drift
        report.events.append(event)
        if self.is_main:
            logger.warning("stepsync: %s", event.message())
            self.owner.output.show("drift_panel", event, logging.WARNING)
        self.owner._action.on_drift(event)

    def _cause(self, where: str, drift: int) -> Cause:
        if where == "train_begin":
            return Cause.INHERITED
        if drift < self.last_drift:
            return Cause.ENGINE_AHEAD
        if self.known_cause is not None:
            return self.known_cause
        if self.n is not None and self.position == self.n:
            return Cause.TINY_EPOCH if self.n <= self.g else Cause.PARTIAL_WINDOW
        return Cause.UNEXPLAINED

    def end_epoch(self, trainer_steps: int) -> None:
        """Record the epoch's counts and compare them with the forecast."""
        first = self.skip if self.epoch == self.start_epoch else 0
        self.report.epochs.append(EpochCount(self.epoch + 1, self.position - first, trainer_steps,
                                             self.engine_steps_seen))
        predicted: Optional[Forecast] = self.report.forecast
        if predicted is None:
            return
        epoch = self.epoch + 1
        row = next((r for r in predicted.epochs if r.epoch == epoch), None)
        seen = (trainer_steps, self.engine_steps_seen)
        if row is None or (row.trainer_steps, row.engine_steps) != seen:
            expected = "no such epoch" if row is None else f"{row.trainer_steps}/{row.engine_steps}"
            text = f"epoch {epoch}: counts {seen[0]}/{seen[1]} differ from the forecast {expected}"
            self.report.forecast_mismatches.append(text)
            if len(self.report.forecast_mismatches) == 1 and self.is_main:
                why = f"because of the {self.known_cause.value}" if self.known_cause else "please report this stack"
                logger.warning("stepsync: %s; %s", text, why)

    # ------------------------------------------------------------ start and end

    def announce(self, predicted: Forecast) -> None:
        """The forecast at the start: its verdict, its table, and an early end said as a warning."""
        self.report.forecast = predicted
        if self.is_main:
            logger.info("stepsync forecast: %s", predicted.verdict())
            self.owner.output.show("forecast_view", predicted, logging.INFO)
        early = predicted.ends_early()
        if early:
            self.warn(early)

    def summarize(self) -> None:
        """The summary at the end, once."""
        if self.is_main:
            report = self.report
            logger.info("stepsync: %s counted %d updates, engine made %d (drift %+d)", report.counter,
                        report.trainer_steps, report.engine_steps, report.drift)
            self.owner.output.show("summary_view", report, logging.INFO)
