"""``stepsync.watch``: one entry point for the loops stepsync watches, chosen by what it is given."""
from __future__ import annotations

from typing import Any, Optional, Union

from ..accelerate.watch import LoopWatch
from ..accelerate.watch import watch as watch_accelerator
from ..core.choices import Policy
from ..core.errors import StepSyncConfigError
from ..core.tokens import Normalisation
from ..deepspeed.watch import EngineWatch
from ..deepspeed.watch import watch as watch_engine
from ..engine.deepspeed import is_engine
from ..fsdp.watch import ShardedWatch, is_replicated, is_sharded
from ..fsdp.watch import watch as watch_sharded


def watch(loop: Any, policy: Union[str, Policy] = Policy.WARN, dataloader: Any = None,
          num_epochs: Optional[float] = None, console: Any = None,
          gradient_accumulation_steps: Optional[int] = None,
          loss_normalisation: Union[str, Normalisation] = Normalisation.TOKEN_MEAN,
          optimizer: Any = None, tracker: Any = None) -> Union[LoopWatch, EngineWatch, ShardedWatch]:
    """Watch a custom training loop: give it the loop's ``accelerate.Accelerator`` (after
    ``accelerator.prepare(...)``), the engine ``deepspeed.initialize(...)`` returned for a loop that drives the engine
    itself, or the model ``fully_shard`` sharded (FSDP2) or DDP wraps, with the ``optimizer`` its loop steps.

    Args:
        loop: the Accelerator, the DeepSpeed engine, or the FSDP2 or DDP model.
        policy: ``"warn"``, ``"raise"`` or ``"sync"``; ``"realign"`` and ``"drop_last"`` are refused (stepsync cannot
            change your loop's count or end its dataloader's epochs).
        dataloader: the training dataloader (its length tells the epochs apart, and makes the forecast).
        num_epochs: the epochs the loop runs, for the forecast.
        console: as for :class:`stepsync.StepSyncCallback`.
        gradient_accumulation_steps: an accelerate loop's: the G your code gave ``Accelerator(...)``; an FSDP2 or DDP
            loop's: the micro-batches per ``optimizer.step()`` it means; a loop that calls an engine's
            ``backward()`` K times before each ``step()``: K.
        loss_normalisation: how each window's loss is meant to weigh its trained tokens: ``"token_mean"``
            (default), ``"micro_batch_mean"`` or ``"sequence_mean"`` where that is deliberate; as for
            :class:`stepsync.StepSyncCallback`.
        optimizer: an FSDP2 or DDP loop's: the torch optimizer it steps.
        tracker: an engine's or an FSDP2 or DDP loop's: where the run's metrics, its forecast and summary and an
            alert at each finding go (a ``SummaryWriter``, ``mlflow``, ``(MlflowClient, run_id)``, a wandb run, a
            callable, or a list of them; ``docs/trackers.md``). An accelerate loop's go to the trackers its
            Accelerator initialised.

    Returns the watch (:class:`stepsync.LoopWatch`, :class:`stepsync.EngineWatch` for an engine, or
    :class:`stepsync.ShardedWatch` for an FSDP2 or DDP model): a context manager; its ``report`` is the run's. Each
    kind's own ``watch`` says more (``stepsync.accelerate.watch.watch``, ``stepsync.deepspeed.watch.watch``,
    ``stepsync.fsdp.watch.watch``).
    """
    if (is_sharded(loop) or is_replicated(loop)) and not is_engine(loop):
        return watch_sharded(loop, optimizer, policy, dataloader, num_epochs, gradient_accumulation_steps, console,
                             loss_normalisation, tracker)
    if optimizer is not None:
        raise StepSyncConfigError("optimizer= is for a loop whose model is FSDP2's or DDP's: an accelerate loop's "
                                  "and a DeepSpeed engine's optimizer is their own; leave it out")
    if not is_engine(loop):
        if tracker is not None:
            raise StepSyncConfigError("tracker= is for a loop that drives an engine or an FSDP2 or DDP model itself: "
                                      "an accelerate loop's findings go to the trackers its Accelerator initialised "
                                      "(accelerator.init_trackers); leave tracker= out")
        return watch_accelerator(loop, policy, dataloader, num_epochs, console, gradient_accumulation_steps,
                                 loss_normalisation)
    return watch_engine(loop, policy, dataloader, num_epochs, console, loss_normalisation, gradient_accumulation_steps,
                        tracker)
