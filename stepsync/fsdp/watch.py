"""``stepsync.watch(model, optimizer=...)``: the check, and the fix, for a torch-native loop whose model is sharded
with FSDP2 (``fully_shard``).

Such a loop accumulates G micro-batches per update by turning the gradient sync off for all but the window's last
backward (``model.set_requires_gradient_sync(is_last)``): a backward with the sync off keeps its gradient unreduced,
one with the sync on reduces every gradient kept since, and ``optimizer.step()`` applies what was reduced. Where the
sync is on decides which micro-batches an update holds, and nothing in FSDP2 says so: with the sync never turned on
every update applies nothing (no error, the sharded gradients are None); turned on at a window's first micro-batch,
the rest of the window waits for the next update.

The watch wraps the model instance's ``set_requires_gradient_sync`` (the sync in force), a forward hook on the model
(each training micro-batch, its backward read at its output's gradient) and the optimizer's ``step``: before each
step it holds the micro-batches the update will apply against the window the loop closed. ``raise`` stops before
such an update applies anything; ``sync`` turns the sync on at the last micro-batch of each of the loop's windows
(every G-th of an epoch and its last) and off elsewhere; ``warn`` changes nothing.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.events import UnsyncedUpdate
from ..core.frameworks import FSDP_LOOP
from ..core.plan import RunPlan
from ..core.tokens import Normalisation
from ..engine.faults import guarded
from ..engine.lifecycle import RunStart
from ..engine.loop_objects import length_of
from ..engine.optimizer import count_optimizer_steps
from ..engine.policies import WatchOnly, action_for
from ..engine.run import Run
from ..engine.watch import NO_LENGTH, UserLoopWatch


def is_sharded(model: Any) -> bool:
    """A module ``fully_shard`` made (it has FSDP2's gradient sync switch)."""
    return callable(getattr(model, "set_requires_gradient_sync", None))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _grad_enabled() -> bool:
    import torch  # loaded already: the model is torch's

    return torch.is_grad_enabled()


def _grad_tensor(output: Any) -> Any:
    """The first tensor of a model's output that backward runs through (its ``loss`` first, as a transformers model
    returns it; else a tensor, or one in a tuple, list or dict); None where there is none."""
    loss = getattr(output, "loss", None)
    if getattr(loss, "requires_grad", False):
        return loss
    if hasattr(output, "requires_grad"):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((found for found in map(_grad_tensor, values) if found is not None), None)


class ShardedWatch(UserLoopWatch):
    """Watches one loop whose model is sharded with FSDP2; made by :func:`watch`. A context manager, or call
    :meth:`close`.

    A failure inside stepsync never reaches your loop (it is logged once, and a failure of its steering gives the
    gradient sync back to your loop), except under ``policy="raise"``.

    Attributes:
        report: the same :class:`stepsync.SyncReport` the callback keeps; ``trainer_steps`` counts your loop's
            ``optimizer.step()`` calls, ``engine_steps`` the steps the optimizer took; ``unsynced_updates`` the
            updates that did not hold the window your loop gave them.
        loop_steps: that count, live.
    """

    framework = FSDP_LOOP

    def __init__(self, model: Any, optimizer: Any, policy: Union[str, Policy], dataloader: Any,
                 num_epochs: Optional[float], gradient_accumulation_steps: int, console: Any,
                 loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> None:
        self._watch(policy, console, loss_normalisation)
        self.model, self.optimizer = model, optimizer
        self._sync = True  # FSDP2's default: every backward reduces
        self._window = 0  # backward() calls since the loop's last optimizer.step()
        self._held = 0  # of those, the ones reduced (up to the last with the sync on)
        self._from_earlier = 0  # micro-batches of earlier windows reduced since the last step
        self._waiting = 0  # micro-batches of earlier windows still unreduced
        self._reported_micro_batch = True  # the last backward's micro-batch is in the run's count
        self._hook: Any = None
        self._start(dataloader, num_epochs, gradient_accumulation_steps)

    def _start(self, dataloader: Any, num_epochs: Optional[float], g: int) -> None:
        behaviour = self._installed()
        if behaviour is None:
            return
        steps = count_optimizer_steps(self.optimizer, 0, self.model, lambda: self._sync)
        if steps is None:
            raise StepSyncConfigError("stepsync.watch(model, optimizer=...) needs the torch optimizer your loop "
                                      f"steps; {type(self.optimizer).__name__} has no step hooks")
        n = length_of(dataloader)
        plan = None if n is None or num_epochs is None else RunPlan(n, g, num_epochs)
        # sync is this watch's own steering (the gradient sync): the run's action only watches
        action = WatchOnly(self.policy) if self.policy.steers_the_boundary else action_for(self.policy)
        run = self._open(RunStart(FSDP_LOOP, self.policy, steps, behaviour, n, g, self.output, is_main=_rank() == 0,
                                  plan=plan, action=action, loss_normalisation=self.loss_normalisation))
        if n is None:
            run.voice.note(NO_LENGTH)
        self._wrap()

    def _wrap(self) -> None:
        model = self.model
        set_sync = model.set_requires_gradient_sync
        self._set_sync = set_sync

        def watched_set_sync(requires_gradient_sync: bool, *args: Any, **kwargs: Any) -> Any:
            result = set_sync(requires_gradient_sync, *args, **kwargs)
            self._sync = bool(requires_gradient_sync)
            return result

        self._patches.set(model, "set_requires_gradient_sync", watched_set_sync)
        step = self.optimizer.step

        def watched_step(*args: Any, **kwargs: Any) -> Any:
            self._before_step()
            result = step(*args, **kwargs)
            self._after_step()
            return result

        self._patches.set(self.optimizer, "step", watched_step, as_method=True)
        self._hook = model.register_forward_hook(self._forward_hook)

    def _undo_steering(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def close(self) -> Any:
        self._undo_steering()
        return super().close()

    # ------------------------------------------------------------ every micro-batch

    def _forward_hook(self, module: Any, args: Any, output: Any) -> None:
        if not module.training or not _grad_enabled():  # an evaluation's forward: no micro-batch
            return
        tensor = _grad_tensor(output)
        if tensor is None:
            return
        self._before_backward()
        sync = self._sync
        tensor.register_hook(lambda grad: self._backward(sync))

    @guarded(steering=True)
    def _before_backward(self, run: Run) -> None:
        self._micro_batch_begins(run, not self._reported_micro_batch)  # no optimizer.step() after the last one?
        self._reported_micro_batch = False
        if run.policy.steers_the_boundary:
            position = run.position + 1
            ends = position % run.g == 0 or (run.n is not None and position == run.n)
            if ends != self._sync:  # set where it changes only: FSDP2 walks every sharded module to set it
                self._set_sync(ends)
                self._sync = ends

    @guarded(steering=True)
    def _backward(self, run: Run, sync: bool) -> None:
        """A backward ran with the gradient sync ``sync``: on, it reduced every gradient kept since the last."""
        self._window += 1
        if sync:
            self._from_earlier += self._waiting
            self._held, self._waiting = self._window, 0

    @guarded(steering=True)
    def _before_step(self, run: Run) -> None:
        """The loop steps: the update applies what was reduced, held against the window the loop closed."""
        if self._held != self._window or self._from_earlier:
            found = UnsyncedUpdate(max(run.epoch, 0) + 1, run.position + (not self._reported_micro_batch),
                                   self.loop_steps + 1, self._window, self._held, self._from_earlier)
            run.updates.took_an_unsynced_update(run, found)

    @guarded(steering=True)
    def _after_step(self, run: Run) -> None:
        self._waiting += self._window - self._held
        self._window, self._held, self._from_earlier = 0, 0, 0
        self.loop_steps += 1
        self._reported_micro_batch = True
        run.after_micro_batch(True, self.loop_steps)

    def _unreported(self) -> bool:
        return not self._reported_micro_batch


def watch(model: Any, optimizer: Any = None, policy: Union[str, Policy] = Policy.WARN, dataloader: Any = None,
          num_epochs: Optional[float] = None, gradient_accumulation_steps: Optional[int] = None,
          console: Any = None,
          loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> ShardedWatch:
    """Watch a loop whose model is sharded with FSDP2; call it after ``fully_shard`` and the optimizer's creation.

    Args:
        model: the root module ``fully_shard`` returned (or sharded in place).
        optimizer: the torch optimizer the loop steps.
        policy: ``"warn"`` (name each update that does not hold its window), ``"raise"`` (stop before it) or
            ``"sync"`` (the sync on at the last micro-batch of each window: every G-th of an epoch and its last).
            ``"realign"`` and ``"drop_last"`` are refused.
        dataloader: the training dataloader (its length tells the epochs apart and makes the forecast).
        num_epochs: the epochs the loop runs, for the forecast.
        gradient_accumulation_steps: G, the micro-batches per optimizer.step() the loop means.
        console: as for :class:`stepsync.StepSyncCallback`.
        loss_normalisation: the rule each window's loss is meant to follow (default ``"token_mean"``), as for
            :class:`stepsync.StepSyncCallback`.

    Raises:
        StepSyncConfigError: (a ``ValueError``) an unknown or refused policy, no optimizer, or G missing or below 1.

    Example::

        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        with stepsync.watch(model, optimizer=optimizer, policy="sync", dataloader=loader, num_epochs=2,
                            gradient_accumulation_steps=4) as sync:
            for epoch in range(2):
                for i, batch in enumerate(loader):
                    last = (i + 1) % 4 == 0 or i + 1 == len(loader)
                    model.set_requires_gradient_sync(last)
                    model(batch).loss.backward()
                    if last:
                        optimizer.step(); optimizer.zero_grad()
        print(sync.report)
    """
    if optimizer is None:
        raise StepSyncConfigError("stepsync.watch(model) of an FSDP2 model needs the optimizer your loop steps: "
                                  "stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=G, ...)")
    g = gradient_accumulation_steps
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise StepSyncConfigError(f"gradient_accumulation_steps={g!r}: pass the micro-batches per optimizer.step() "
                                  "your loop means (stepsync.watch(model, ..., gradient_accumulation_steps=G))")
    return ShardedWatch(model, optimizer, policy, dataloader, num_epochs, g, console, loss_normalisation)
