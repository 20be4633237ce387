"""Run under `torchrun --nproc_per_node 2`: Trainer runs of the tiny model (8 samples, batch 1, G=2, 2 epochs: 2
updates per epoch) in which rank 1's weights are moved after update 1 (a fault on one rank), and runs in which no rank
is touched. An independent recorder gathers every rank's weights at the end (the truth: do the copies differ?); each
rank writes the truth, where stepsync found the ranks apart, and how the run ended to OUT/rank-R.json."""
import os
import sys
import tempfile

from harness.runs import dump, end_process_group

# (name, ZeRO stage, policy, move rank 1's weights after update 1, save a checkpoint after every update)
CASES = (("untouched-z0", 0, "warn", False, False), ("untouched-z1", 1, "warn", False, True),
         ("moved-z0", 0, "warn", True, False), ("moved-z0-saved", 0, "warn", True, True),
         ("moved-z0-raise", 0, "raise", True, False))


def mover(rank: int):
    from transformers import TrainerCallback

    class MoveOneRank(TrainerCallback):
        """After update 1, rank 1 moves one weight: what a rank-private fault leaves behind."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1 and rank == 1:
                import torch

                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] += 1e-3

    return MoveOneRank()


def copies_differ(model) -> bool:
    """The truth, read apart from stepsync: every rank's weights gathered and compared."""
    import torch
    import torch.distributed as dist

    mine = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return any(not torch.equal(every[0], other) for other in every[1:])


def main(out_dir: str) -> None:
    from stepsync import StepSyncCallback
    from stepsync.tools.tiny_run import run_tiny

    from harness.touches import reader_of, touching_mode

    rank = int(os.environ["RANK"])
    results = {}
    for name, stage, policy, moved, saved in CASES:
        callback = StepSyncCallback(policy, console=False)
        saving = dict(save_strategy="steps", save_steps=1) if saved else {}
        watch = touching_mode()  # which of stepsync's readers touched a tensor, and whether anything else did
        with watch:
            result = run_tiny(tempfile.mkdtemp(), samples=8, gas=2, epochs=2, stage=stage,
                              callbacks=[*([mover(rank)] if moved else []), callback], **saving)
        apart = callback.report.ranks_apart
        results[name] = {
            "differ": copies_differ(result.engine.module) if stage < 3 else None,
            "apart": None if apart is None else [apart.epoch, apart.micro_batch, apart.engine_steps, apart.agreed_at,
                                                 apart.where, apart.ranks],
            "error": type(result.error).__name__ if result.error else None,
            "engine_steps": result.engine.global_steps,
            "readers": sorted({reader_of(path, name) or f"outside: {where} ({name})"
                               for name, path, where in watch.touches})}
    dump(os.path.join(out_dir, f"rank-{rank}.json"), results)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()
