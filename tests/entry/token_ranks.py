"""Run under `torchrun --nproc_per_node 2`: DeepSpeed-Chat's loop, or an accelerate loop written as the examples are
(tests/harness/token_runs.py), on ZeRO-``stage``, G=4, one window per rank: rank 0's micro-batches hold 3, 9, 17 and 33 trained tokens, rank 1's 8 each (a window
that tells no rule apart); each micro-batch's own mean is the loss. Each rank writes what it saw, its update and
its own window's rule gradients to OUT/rank-R.json.

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/entry/token_ranks.py OUT STAGE engine|accelerate
       [none|warn|raise ...]
"""
import os
import sys

from harness.runs import dump, end_process_group
from harness.token_runs import run_accelerate_tokens, run_engine_tokens, trained_tokens, windowed

COUNTS = {0: [3, 9, 17, 33], 1: [8, 8, 8, 8]}


def flat(tensors) -> list:
    import torch

    return torch.cat([t.reshape(-1).float() for t in tensors]).tolist()


def main(out_dir: str, stage: int, loop: str, policies) -> None:
    rank = int(os.environ["RANK"])
    counts = COUNTS[rank]
    results = {}
    for policy in policies:
        policy_or_none = None if policy == "none" else policy
        run = run_engine_tokens(counts, 4, policy=policy_or_none, stage=stage) if loop == "engine" else \
            run_accelerate_tokens(counts, 4, loss="examples", policy=policy_or_none, stage=stage)
        weighting = run.report.token_weighting if run.report is not None else None
        results[policy] = {
            "error": type(run.error).__name__ if run.error else None, "engine_steps": run.engine_steps,
            "update": flat(run.update), "found": weighting.found.value if weighting else None,
            "as_expected": weighting.as_expected if weighting else None,
            "tokens": list(weighting.tokens) if weighting else None, "total": weighting.total if weighting else None,
            "ratio": weighting.ratio if weighting else None,
            "micro_batch_mean": flat(run.truths["micro_batch_mean"]), "token_mean": flat(run.truths["token_mean"]),
            "trained": sum(trained_tokens(row) for row in windowed(counts, 4)),
        }
    dump(os.path.join(out_dir, f"rank-{rank}.json"), results)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:] or ["none", "warn", "raise"])
    end_process_group()
