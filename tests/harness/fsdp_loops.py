"""A torch-native loop whose model is sharded with FSDP2 (``fully_shard`` on its layer and its root), as PyTorch's and
torchtitan's accumulation loops write it: ``model.set_requires_gradient_sync(last)`` before each micro-batch,
``loss.backward()``, and ``optimizer.step()`` at each window's last micro-batch (every G-th of an epoch and its last).
Or the same model in ``DistributedDataParallel``, each micro-batch whose sync is off run under ``model.no_sync()``,
as the docstring of torch/nn/parallel/distributed.py's ``no_sync`` writes it. Recorded by the loop itself,
independently of stepsync.

The model is one weight per sample and each micro-batch one sample's one-hot row (times a number of its own) under
plain SGD at lr 1, the loss the output's sum: each update's samples, and each one's share of it, are read from the
whole weights (gathered from their shards on every rank; DDP's, each rank's own copy). Rank r trains sample
``i * world + r`` at micro-batch i of every epoch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# Where the loop turns the gradient sync on: at each window's last micro-batch (right), never (the slip of a loop
# ported from no_sync()), at each window's first (the sync set once per window, before its first micro-batch).
SYNC_AT = {
    "last": lambda i, g, n: (i + 1) % g == 0 or i + 1 == n,
    "never": lambda i, g, n: False,
    "first": lambda i, g, n: i % g == 0,
}


@dataclass
class ShardedLoopRun:
    """What the loop saw: each update's samples with their shares times the ranks (1: the sample applied whole),
    the optimizer's steps, and the error a policy raised."""

    updates: List[Dict[int, float]] = field(default_factory=list)
    steps: int = 0
    watch: Any = None
    error: Optional[BaseException] = None
    world: int = 1


def run_sharded_loop(per_rank: int, g: int, epochs: int, sync_at: str = "last", policy: Optional[str] = None,
                     wrap: str = "fsdp", save_to: Optional[str] = None, save_after: int = 0,
                     tracker: Any = None) -> ShardedLoopRun:
    """The loop above on this process group (one is started for a single process), its model ``wrap``'s
    (``"fsdp"``: FSDP2, ``"ddp"``: DistributedDataParallel, ``"accelerate"``: DDP as ``Accelerator(cpu=True)``
    prepares it, with its dataloader and optimizer, the loop under ``accelerator.accumulate(model)`` as accelerate's
    examples/by_feature/gradient_accumulation.py writes it, or each backward under ``accelerator.no_sync(model)`` for
    ``sync_at="never"``); ``policy``: ``stepsync.watch(model, optimizer=...)`` under it (None: not watched);
    ``save_to``: a folder ``torch.distributed.checkpoint.save`` writes the model's and the optimizer's state into
    after the first epoch's first ``save_after`` micro-batches, as PyTorch's DCP recipe saves; ``tracker``: handed to
    the watch."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from stepsync.core.errors import StepSyncError

    if not dist.is_initialized():  # torchrun's ranks, else one process of its own
        from stepsync.tools.tiny_run import cpu_distributed_env

        cpu_distributed_env()
        dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = per_rank * world

    class OneWeightPerSample(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(samples, 1, bias=False)
            torch.nn.init.zeros_(self.layer.weight)

        def forward(self, rows):
            return self.layer(rows)

    model = OneWeightPerSample()
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif wrap == "fsdp":
        fully_shard(model.layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    # sample j's row is (j + 1) times its one-hot row (its gradient j + 1), so ranks that part differ in their sums
    scale = torch.arange(1, samples + 1, dtype=torch.float32)
    rows = torch.diag(scale)
    data = torch.utils.data.TensorDataset(rows)
    # each rank's share as DistributedSampler deals it without shuffling: rank r's i-th batch is sample i * world + r
    loader: Any = torch.utils.data.DataLoader(data, batch_size=1, sampler=torch.utils.data.DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=False))
    accelerator = None
    if wrap == "accelerate":  # accelerate shards the data itself, the same way
        from accelerate import Accelerator, FullyShardedDataParallelPlugin

        # asked for FSDP2, as a script written for GPUs asks: on a CPU accelerate wraps the model in DDP instead
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=g,
                                  fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        model, optimizer, loader = accelerator.prepare(model, optimizer,
                                                       torch.utils.data.DataLoader(data, batch_size=1))
    run = ShardedLoopRun(world=world)
    if policy is not None:
        import stepsync

        run.watch = stepsync.watch(model, optimizer=optimizer, policy=policy, dataloader=loader, num_epochs=epochs,
                                   gradient_accumulation_steps=g, console=False, tracker=tracker)

    def weights():
        if wrap == "fsdp":
            return model.layer.weight.full_tensor().detach().clone().flatten()
        return model.module.layer.weight.detach().clone().flatten()

    def train(i, batch):
        """One micro-batch; whether the loop's window ends at it (it steps there)."""
        ends = (i + 1) % g == 0 or i + 1 == per_rank
        if accelerator is not None and sync_at == "last":
            with accelerator.accumulate(model):
                accelerator.backward(model(batch[0]).sum())
                optimizer.step()
                optimizer.zero_grad()
            return accelerator.sync_gradients
        sync = SYNC_AT[sync_at](i, g, per_rank)
        if accelerator is not None:
            with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                accelerator.backward(model(batch[0]).sum())
        elif wrap == "ddp":
            with contextlib.nullcontext() if sync else model.no_sync():
                model(batch[0]).sum().backward()
        else:
            model.set_requires_gradient_sync(sync)
            model(batch[0]).sum().backward()
        if ends:
            optimizer.step()
            optimizer.zero_grad()
        return ends

    per_loss = g if accelerator is not None else 1  # accelerator.backward divides each loss by G
    last = weights()
    try:
        for epoch in range(epochs):
            for i, batch in enumerate(loader):
                if train(i, batch):
                    run.steps += 1
                    now = weights()
                    moves = ((last - now) * world / scale * per_loss).tolist()
                    run.updates.append({j: round(share, 6) for j, share in enumerate(moves) if abs(share) > 1e-9})
                    last = now
                if save_to is not None and (epoch, i + 1) == (0, save_after):
                    import torch.distributed.checkpoint as dcp

                    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                             checkpoint_id=save_to)
    except StepSyncError as exc:
        run.error = exc
    if run.watch is not None:
        run.watch.close()
    return run
