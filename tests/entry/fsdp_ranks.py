"""Run under `torchrun --nproc_per_node 2`: the FSDP2 and DDP loops of tests/harness/fsdp_loops.py, 5 micro-batches per
rank, G=2, 2 epochs, for each way they turn the gradient sync on and each policy, and accelerate's DDP loop (right,
and with the sync never on); each rank writes what it saw to OUT/rank-R.json; a torch.distributed.checkpoint of the
FSDP2 loop saved inside its first epoch goes to OUT/dcp-inside-epoch-1.

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/entry/fsdp_ranks.py OUT
"""
import importlib.util
import itertools
import os
import sys

from harness.fsdp_loops import run_sharded_loop
from harness.runs import dump, end_process_group


def main(out_dir: str) -> None:
    results = {}
    runs = list(itertools.product(("fsdp", "ddp"), ("last", "never", "first"), ("none", "warn", "raise", "sync")))
    if importlib.util.find_spec("accelerate") is not None:  # not on the torch stack
        runs += [("accelerate", "last", "none"), ("accelerate", "last", "warn"), ("accelerate", "last", "sync"),
                 ("accelerate", "never", "none"), ("accelerate", "never", "warn")]
    for wrap, sync_at, policy in runs:
        run = run_sharded_loop(5, 2, 2, sync_at, None if policy == "none" else policy, wrap)
        report = run.watch.report if run.watch is not None else None
        results[f"{wrap}-{sync_at}-{policy}"] = {
            "world_size": run.world, "steps": run.steps,
            "updates": [sorted(update.items()) for update in run.updates],
            "error": f"{type(run.error).__name__}: {run.error}" if run.error else None,
            "counts": [report.trainer_steps, report.engine_steps] if report else None,
            "unsynced": [[u.update, u.window, u.held, u.from_earlier, u.applied_alone]
                         for u in report.unsynced_updates] if report else None,
            "unsynced_total": report.updates_unsynced if report else None,
            "forecast": [[r.trainer_steps, r.engine_steps] for r in report.forecast.epochs]
            if report and report.forecast else None,
            "epochs": [[r.trainer_steps, r.engine_steps] for r in report.epochs] if report else None,
            "notes": report.notes if report else None,
            "summary": str(report) if report else None,
            "ranks_apart": str(report.ranks_apart) if report and report.ranks_apart else None,
        }
    # a checkpoint of the FSDP2 loop, saved inside its first epoch (after 2 of each rank's 5 micro-batches)
    run_sharded_loop(5, 2, 1, "last", "warn", save_to=os.path.join(out_dir, "dcp-inside-epoch-1"), save_after=2)
    dump(os.path.join(out_dir, f"rank-{int(os.environ['RANK'])}.json"), results)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()
