"""Run under `torchrun --nproc_per_node 2`: custom accelerate loops; each rank writes what it saw to OUT/rank-R.json.

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/multiprocess/twoproc_loops.py OUT [none|warn|sync|raise ...]
"""
import os
import sys


from harness.runs import dump, end_process_group
from harness.loops import run_loop

def main(out_dir: str, policies) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for policy in policies:
        # 12 samples, batch 1, 2 ranks -> 6 micro-batches per rank; G=4 leaves a partial window of 2.
        result = run_loop(12, 4, 2, None if policy == "none" else policy)
        if result.watch is None:  # without stepsync: what the loop itself saw
            results[policy] = {"world_size": result.accelerator.num_processes, "epoch_ends": result.epoch_ends,
                               "error": f"{type(result.error).__name__}: {result.error}" if result.error else None}
            continue
        report = result.watch.report
        results[policy] = {
            "world_size": result.accelerator.num_processes,
            "epoch_ends": result.epoch_ends,
            "loop_updates_at": result.loop_updates_at,
            "engine_updates_at": result.engine_updates_at,
            "error": type(result.error).__name__ if result.error else None,
            "report_epochs": [[r.trainer_steps, r.engine_steps] for r in report.epochs],
            "report_counts": [report.trainer_steps, report.engine_steps],
            "events": [event.to_dict() for event in report.events],
            "forecast": [[r.trainer_steps, r.engine_steps] for r in report.forecast.epochs],
        }
    dump(os.path.join(out_dir, f"rank-{rank}.json"), results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["warn", "sync", "raise"])
    end_process_group()
