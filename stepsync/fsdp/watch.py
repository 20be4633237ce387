"""``stepsync.watch(model, optimizer=...)``: the check, and the fix, for a torch-native loop whose model is sharded
with FSDP2 (``fully_shard``) or replicated with DDP (``DistributedDataParallel``).

Such a loop accumulates G micro-batches per update by turning the gradient sync off for all but the window's last
backward (``model.set_requires_gradient_sync(is_last)``): a backward with the sync off keeps its gradient unreduced,
one with the sync on reduces every gradient kept since, and ``optimizer.step()`` applies what was reduced. Where the
sync is on decides which micro-batches an update holds, and nothing in FSDP2 says so: with the sync never turned on
every update applies nothing (no error, the sharded gradients are None); turned on at a window's first micro-batch,
the rest of the window waits for the next update. A DDP loop runs the window's other micro-batches under
``model.no_sync()``; DDP reads the sync at each forward, and an update applies the micro-batches after the window's
last synced backward on their own rank alone, so the ranks' weights part.

The watch wraps the model instance's ``set_requires_gradient_sync`` (the sync in force), hooks the model's forward
(each training micro-batch; each backward is told by FSDP2's own per-backward callback, DDP's sync read at the
forward), and wraps the torch optimizer's ``step`` and ``zero_grad`` and ``torch.distributed.checkpoint``'s ``save``
and ``load``: before each step it holds the micro-batches the update will apply against the window the loop closed.
``raise`` stops before such an update applies anything; ``sync`` turns the sync on at the last micro-batch of each of
the loop's windows (every G-th of an epoch and its last) and off elsewhere; ``warn`` changes nothing.
"""
from __future__ import annotations

from typing import Any, Optional, Type, Union

from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.events import DroppedWindow, UnsyncedUpdate
from ..core.frameworks import DDP_LOOP, FSDP_LOOP
from ..core.plan import RunPlan
from ..core.relayout import Layout
from ..core.tokens import Normalisation
from ..core.versions import installed_version
from ..engine.faults import guarded
from ..engine.lifecycle import RunStart
from ..engine.loop_objects import length_of, sharding_dropped
from ..engine.optimizer import count_optimizer_steps, innermost_optimizer
from ..engine.policies import WatchOnly, action_for
from ..engine.run import Run
from ..engine.watch import UserLoopWatch, accumulation_given
from .checkpoints import DistributedCheckpoints, checkpoint_folder
from .precision import precision_in_force


def is_sharded(model: Any) -> bool:
    """A module ``fully_shard`` made (it has FSDP2's gradient sync switch)."""
    return callable(getattr(model, "set_requires_gradient_sync", None))


def is_replicated(model: Any) -> bool:
    """A ``DistributedDataParallel`` module (DDP's gradient sync switch and its ``no_sync()``)."""
    return hasattr(model, "require_backward_grad_sync") and callable(getattr(model, "no_sync", None))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _layout(dataloader: Any, ranks: int, g: int) -> Optional[Layout]:
    """How the loop splits its data (kept in every record), where its dataloader says its batch and dataset."""
    batch, dataset = getattr(dataloader, "batch_size", None), getattr(dataloader, "dataset", None)
    examples = length_of(dataset)
    if not isinstance(batch, int) or batch < 1 or not examples:
        return None
    return Layout(ranks, batch, g, examples, drop_last=bool(getattr(dataloader, "drop_last", False)))


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


# FSDP2's callback at the end of each backward (queued once per backward by the state whose pre-backward hook
# fired first): torch 2.13's name, read where it exists
FSDP_BACKWARD_CALLBACK = "_root_post_backward_final_callback"


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
    _checkpoints: DistributedCheckpoints
    keeps_unreduced = True  # a backward with the sync off leaves its gradient for the next synced one, past a step
    reads_the_sync_at_forward = False  # FSDP2 reads it at the backward: sync sets it in the forward's own hook

    def __init__(self, model: Any, optimizer: Any, policy: Union[str, Policy], dataloader: Any,
                 num_epochs: Optional[float], gradient_accumulation_steps: int, console: Any,
                 loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN) -> None:
        self._watch(policy, console, loss_normalisation)
        self.model, self.optimizer = model, optimizer
        import torch  # loaded already: the model is torch's

        self._grad_enabled = torch.is_grad_enabled  # read at every forward: no import there
        self._sync = True  # FSDP2's default: every backward reduces
        self._window = 0  # backward() calls since the loop's last optimizer.step()
        self._held = 0  # of those, the ones reduced (up to the last with the sync on)
        self._from_earlier = 0  # micro-batches of earlier windows reduced since the last step
        self._waiting = 0  # micro-batches of earlier windows still unreduced
        self._cleared = 0  # of the window, those an optimizer.zero_grad() inside it cleared
        self._last_synced = False  # the sync the loop set for its last backward: on where it closes its window
        self._alone = False  # one DDP rank: a gradient left unreduced is the average already (set at the start)
        self._reported_micro_batch = True  # the last backward's micro-batch is in the run's count
        self._hooks: list = []
        self._steers_after_forward = False  # sync sets the sync in the forward's hook (set at the start)
        self._checkpoints = DistributedCheckpoints()
        self._num_epochs = num_epochs
        self._start(dataloader, num_epochs, gradient_accumulation_steps)

    def _start(self, dataloader: Any, num_epochs: Optional[float], g: int) -> None:
        behaviour = self._installed()
        if behaviour is None:
            return
        steps = count_optimizer_steps(self.optimizer, 0, self.model, self._sync_in_force, reads_weights=True)
        if steps is None:
            raise StepSyncConfigError("stepsync.watch(model, optimizer=...) needs the torch optimizer your loop "
                                      f"steps; {type(self.optimizer).__name__} has no step hooks")
        ranks = steps.facts.data_parallel_size
        self._alone = not self.keeps_unreduced and ranks == 1
        n = length_of(dataloader)
        plan = None if n is None or num_epochs is None else RunPlan(n, g, num_epochs)
        # sync is this watch's own steering (the gradient sync): the run's action only watches
        action = WatchOnly(self.policy) if self.policy.steers_the_boundary else action_for(self.policy)
        self._opened = RunStart(self.framework, self.policy, steps, behaviour, n, g, self.output,
                                is_main=_rank() == 0, plan=plan, action=action,
                                loss_normalisation=self.loss_normalisation,
                                layout=_layout(dataloader, ranks, g))
        # Training starts at the first micro-batch: a checkpoint loaded before it carries the report on.
        run = self._open(self._opened, training_starts=False)
        said = self._said_at_start()
        if said:
            run.voice.note(said)
        self._wrap()

    def _said_at_start(self) -> Optional[str]:
        """What the start says of the model: the precision in force."""
        return precision_in_force(self.model, installed_version("torch"))

    def _sync_in_force(self) -> bool:
        """Whether the running (or next) backward reduces the gradients kept since the last that did."""
        return self._sync

    def _set_sync(self, on: bool) -> None:
        self._set_requires_gradient_sync(on)
        self._sync = on

    def _watch_the_sync(self) -> None:
        set_sync = self._set_requires_gradient_sync = self.model.set_requires_gradient_sync

        def watched_set_sync(requires_gradient_sync: bool, *args: Any, **kwargs: Any) -> Any:
            result = set_sync(requires_gradient_sync, *args, **kwargs)
            self._sync = bool(requires_gradient_sync)
            return result

        self._patches.set(self.model, "set_requires_gradient_sync", watched_set_sync)

    def _wrap(self) -> None:
        self._watch_the_sync()
        # the torch optimizer's own step: accelerate's wrapper calls it only where it updates (sync_gradients)
        optimizer = innermost_optimizer(self.optimizer)
        assert optimizer is not None  # _start refuses one without step hooks
        self._call_around(optimizer, "step", self._before_step, self._after_step, as_method=True)
        self._call_before(optimizer, "zero_grad", self._before_zero_grad)
        self._watch_checkpoints()
        self._backwards_seen = self._see_backwards()
        self._steers_after_forward = self.policy.steers_the_boundary and not self.reads_the_sync_at_forward
        if self.policy.steers_the_boundary and self.reads_the_sync_at_forward:
            self._hooks.append(self.model.register_forward_pre_hook(self._steer))
        self._hooks.append(self.model.register_forward_hook(self._forward_hook))

    def _watch_checkpoints(self) -> None:
        """``torch.distributed.checkpoint``'s ``save`` and ``load``, as the loop calls them through the module
        (``dcp.save(...)``), keep and read stepsync's record while the watch is open."""
        import torch.distributed.checkpoint as dcp

        self._call_after(dcp, "save", lambda _, *args, **kwargs: self._saved(checkpoint_folder(kwargs)))
        self._call_after(dcp, "load", lambda _, *args, **kwargs: self._loaded(checkpoint_folder(kwargs)))

    def _saved(self, folder: Optional[str]) -> None:
        if folder is not None:
            self._after_save(folder)

    def _loaded(self, folder: Optional[str]) -> None:
        if self._opened is None or folder is not None:  # a load after training began is said whatever its folder
            self._after_load(folder)

    def _in_window(self) -> int:
        return self._window

    def _undo_steering(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def close(self) -> Any:
        self._undo_steering()
        return super().close()

    # ------------------------------------------------------------ every micro-batch

    def _forward_hook(self, module: Any, args: Any, output: Any) -> None:
        if not module.training or not self._grad_enabled():  # an evaluation's forward: no micro-batch
            return
        tensor = _grad_tensor(output)
        if tensor is None:
            return
        self._micro_batch()
        self._backward_follows(module, tensor)

    def _backward_follows(self, module: Any, tensor: Any) -> None:
        """The micro-batch's backward will run through ``tensor``: FSDP2 reads the sync at the backward, so it is
        read there (at FSDP2's own callback, else at a hook on ``tensor``)."""
        if not self._backwards_seen:
            tensor.register_hook(self._backward_begins)

    def _backward_begins(self, grad: Any) -> None:
        self._backward(self._sync)

    def _see_backwards(self) -> bool:
        """Each backward's end, told by FSDP2 itself: its per-backward callback (one per backward whichever of the
        model's sharded modules queued it) wrapped on each of their states, cheaper than a hook on every output
        tensor. False where this torch has none (the watch then hooks each micro-batch's output)."""
        states = [getattr(module, "_get_fsdp_state", lambda: None)() for module in self.model.modules()]
        states = [state for state in states if callable(getattr(state, FSDP_BACKWARD_CALLBACK, None))]
        if not states:
            return False
        for state in states:
            self._call_after(state, FSDP_BACKWARD_CALLBACK, lambda *_: self._backward(self._sync))
        return True

    @guarded(steering=True)
    def _steer(self, run: Run, module: Any, args: Any) -> None:
        """Under ``sync``, before a training micro-batch's forward (where the sync is read there: DDP)."""
        if not module.training or not self._grad_enabled():
            return
        self._sync_for(run, run.position + (not self._reported_micro_batch))  # the last is counted at the next

    def _sync_for(self, run: Run, done: int) -> None:
        """Under ``sync``, for the micro-batch after ``done`` of the epoch: the sync on where it ends one of the
        loop's windows (every G-th micro-batch of an epoch and its last), off elsewhere."""
        position = 1 if run.n is not None and done >= run.n else done + 1
        ends = position % run.g == 0 or position == run.n
        if ends != self._sync_in_force():  # set where it changes only: FSDP2 walks every sharded module to set it
            self._set_sync(ends)

    @guarded(steering=True)
    def _micro_batch(self, run: Run) -> None:
        """A training micro-batch's forward ran (the first starts training, from a checkpoint loaded by then)."""
        if self._opened is not None:
            started = self._checkpoints.start_training(run, self._opened, self._num_epochs, forecast_now=True)
            self.loop_steps, self._opened = started.trainer_steps, None
        self._micro_batch_begins(run, not self._reported_micro_batch)  # no optimizer.step() after the last one?
        self._reported_micro_batch = False
        if self._steers_after_forward:  # before the backward that reads it: no hook of its own before the forward
            self._sync_for(run, run.position)

    @guarded(steering=True)
    def _backward(self, run: Run, sync: bool) -> None:
        """A micro-batch's backward runs with the gradient sync ``sync``: on, it reduces every gradient kept since
        the last that did."""
        self._window += 1
        self._last_synced = sync
        if sync or self._alone:
            self._from_earlier += self._waiting
            self._held, self._waiting = self._window, 0

    @guarded(steering=True)
    def _before_step(self, run: Run) -> None:
        """The loop steps: the update applies what was reduced, held against the window the loop closed."""
        held = max(self._held - self._cleared, 0)
        if held != self._window or self._from_earlier:
            found = UnsyncedUpdate(max(run.epoch, 0) + 1, run.position + (not self._reported_micro_batch),
                                   self.loop_steps + 1, self._window, held, self._from_earlier,
                                   applied_alone=not self.keeps_unreduced, cleared=self._cleared)
            run.updates.took_an_unsynced_update(run, found)

    @guarded(steering=False)
    def _before_zero_grad(self, run: Run) -> None:
        """The loop clears the gradients with micro-batches since its last step: a window it closed (the last
        backward reduced) is dropped without an update; inside a window, what the clearing reaches is lost: FSDP2's
        reduced gradients (those left unreduced wait in FSDP2's own buffers), DDP's every gradient so far."""
        if not self._window:
            return
        if self._last_synced:  # closed: the sync was on at its last backward
            dropped = DroppedWindow(max(run.epoch, 0) + 1, run.position + (not self._reported_micro_batch),
                                    self.loop_steps, self._window)
            self._window = self._held = self._from_earlier = self._cleared = 0
            run.updates.took_a_dropped_window(run, dropped)
            return
        self._cleared = self._held if self.keeps_unreduced else self._window
        self._from_earlier = 0

    @guarded(steering=True)
    def _after_step(self, run: Run) -> None:
        if self.keeps_unreduced:
            self._waiting += self._window - self._held
        self._window, self._held, self._from_earlier, self._cleared = 0, 0, 0, 0
        self.loop_steps += 1
        self._reported_micro_batch = True
        run.after_micro_batch(True, self.loop_steps)

    def _unreported(self) -> bool:
        return not self._reported_micro_batch


class ReplicatedWatch(ShardedWatch):
    """Watches one loop whose model is DDP's (``DistributedDataParallel``); made by :func:`watch`. As
    :class:`ShardedWatch`, but DDP reads the sync at each forward (``model.no_sync()`` turns it off) and applies the
    micro-batches after a window's last synced backward at once, each on its own rank alone."""

    framework = DDP_LOOP
    keeps_unreduced = False
    reads_the_sync_at_forward = True

    def _backward_follows(self, module: Any, tensor: Any) -> None:
        """DDP reads the sync at the forward: the backward's sync is known at once (on one rank every micro-batch
        counts as reduced: a gradient left unreduced is the average already)."""
        self._backward(module.require_backward_grad_sync)

    def _see_backwards(self) -> bool:
        return True  # DDP's sync is read at the forward, with the micro-batch

    def _said_at_start(self) -> Optional[str]:
        """A model accelerate was asked to shard and wrapped in DDP instead (on a CPU)."""
        return sharding_dropped("wrapped in DDP") or None

    def _sync_in_force(self) -> bool:
        return bool(self.model.require_backward_grad_sync)

    def _set_sync(self, on: bool) -> None:
        self.model.require_backward_grad_sync = on

    def _watch_the_sync(self) -> None:
        """DDP's switch is an attribute, read at each forward: nothing to wrap."""

    def close(self) -> Any:
        if self.policy.steers_the_boundary and self._hooks:
            self._set_sync(True)  # DDP's default, as outside no_sync()
        return super().close()


def watch(model: Any, optimizer: Any = None, policy: Union[str, Policy] = Policy.WARN, dataloader: Any = None,
          num_epochs: Optional[float] = None, gradient_accumulation_steps: Optional[int] = None,
          console: Any = None,
          loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN,
          tracker: Any = None) -> ShardedWatch:
    """Watch a loop whose model is sharded with FSDP2 or replicated with DDP; call it after ``fully_shard`` (or
    ``DistributedDataParallel(...)``) and the optimizer's creation.

    Args:
        model: the root module ``fully_shard`` returned (or sharded in place), or the ``DistributedDataParallel``
            module.
        optimizer: the optimizer the loop steps (a torch optimizer, or accelerate's wrapper of one: the watch reads
            the torch optimizer's own steps).
        policy: ``"warn"`` (name each update that does not hold its window), ``"raise"`` (stop before it) or
            ``"sync"`` (the sync on at the last micro-batch of each window: every G-th of an epoch and its last, off
            at the others: ``set_requires_gradient_sync`` for FSDP2, DDP's ``require_backward_grad_sync``).
            ``"realign"`` and ``"drop_last"`` are refused.
        dataloader: the training dataloader (its length tells the epochs apart and makes the forecast).
        num_epochs: the epochs the loop runs, for the forecast.
        gradient_accumulation_steps: G, the micro-batches per optimizer.step() the loop means.
        console: as for :class:`stepsync.StepSyncCallback`.
        loss_normalisation: the rule each window's loss is meant to follow (default ``"token_mean"``), as for
            :class:`stepsync.StepSyncCallback`.
        tracker: where the run's metrics, its forecast and summary (as text) and an alert at each finding go, as
            for :func:`stepsync.deepspeed.watch.watch` (``docs/trackers.md``).

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
        raise StepSyncConfigError("stepsync.watch(model) of an FSDP2 or DDP model needs the optimizer your loop steps: "
                                  "stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=G, ...)")
    g = accumulation_given(gradient_accumulation_steps, "the micro-batches per optimizer.step() your loop means "
                           "(stepsync.watch(model, ..., gradient_accumulation_steps=G))")
    return watch_kind(model)(model, optimizer, policy, dataloader, num_epochs, g, console,
                             loss_normalisation)._track_into(tracker)


def watch_kind(model: Any) -> Type[ShardedWatch]:
    """The watch of ``model``'s loop: FSDP2's, else DDP's."""
    return ShardedWatch if is_sharded(model) else ReplicatedWatch
