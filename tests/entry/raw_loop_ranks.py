"""Run under `torchrun --nproc_per_node 2`: open-instruct's learner loop (tests/harness/raw_loops.py) on ZeRO-2, K=4
backward() calls per step(), 2 steps per rank; each rank writes what it saw to OUT/rank-R.json.

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/entry/raw_loop_ranks.py OUT [none|warn|sync|raise ...]
"""
import os
import sys

from harness.raw_loops import run_learner_loop
from harness.runs import dump, end_process_group


def main(out_dir: str, policies) -> None:
    results = {}
    for policy in policies:
        run = run_learner_loop(4, 2, 2, policy=None if policy == "none" else policy)
        report = run.watch.report if run.watch is not None else None
        results[policy] = {
            "world_size": int(os.environ["WORLD_SIZE"]), "shares": run.shares, "engine_steps": run.engine_steps,
            "error": type(run.error).__name__ if run.error else None,
            "counts": [report.trainer_steps, report.engine_steps] if report else None,
            "lost": [list(lost.kept) for lost in report.lost_gradients] if report else None,
        }
    dump(os.path.join(out_dir, f"rank-{int(os.environ['RANK'])}.json"), results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["none", "warn", "sync", "raise"])
    end_process_group()
