"""The Trainer's loss sum under ``realign``: the micro-batches after the engine's last update are trained but never
applied, and the Trainer's ``train_loss`` (its loss sum over the updates counted) must not hold them."""
from __future__ import annotations

from typing import Any, List, Optional

from ..engine.deepspeed import mean_across_ranks
from ..engine.loop_objects import InstancePatches


class UnappliedLosses:
    """The losses ``trainer.training_step`` returned since the engine's last update (tensors kept, never read until
    the run's last step, where they are summed once: a bounded reader of at most G - 1 numbers).

    Attributes:
        pending: the losses of the micro-batches the engine has not applied yet.
    """

    def __init__(self, trainer: Any, engine: Any) -> None:
        self.engine = engine
        self.taken = False
        self.pending: List[Any] = []
        self.failure: Optional[Exception] = None  # reading the engine failed: nothing is taken out
        self.seen = engine.global_steps
        self._patches = InstancePatches()
        original = trainer.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            self._follow(before=True)  # an engine that updates at the loop's optimizer step applied them there
            loss = original(*args, **kwargs)
            self._follow(loss=loss)  # one that updates inside backward applied this micro-batch's window now
            return loss

        self._patches.set(trainer, "training_step", training_step)

    def _follow(self, before: bool = False, loss: Any = None) -> None:
        """Keep the losses since the engine's last update; a failure reading it stays here (training goes on) and
        is raised at :meth:`take_out`, where the callback says it."""
        if self.failure is not None:
            return
        try:
            if not self._moved() and not before:
                self.pending.append(loss)
        except Exception as exc:
            self.failure, self.pending = exc, []

    def _moved(self) -> bool:
        if self.engine.global_steps == self.seen:
            return False
        self.seen = self.engine.global_steps
        self.pending = []
        return True

    def take_out(self, trainer: Any, device: Any) -> float:
        """At the run's last step (once, on every rank): the pending losses (the mean over ranks of each rank's sum,
        as the Trainer gathers its loss) out of the Trainer's loss sum; returns what was taken out."""
        if self.taken:
            return 0.0
        self.taken = True
        if self.failure is not None:
            raise self.failure
        self._moved()
        total = mean_across_ranks(sum(float(loss) for loss in self.pending), device)
        trainer._total_loss_scalar = getattr(trainer, "_total_loss_scalar", 0.0) - total
        self.pending = []
        return total

    def remove(self) -> None:
        self._patches.restore()
