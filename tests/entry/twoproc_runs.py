"""Run under `torchrun --nproc_per_node 2`: a few real runs, each rank writes what it saw to OUT/rank-R.json."""
import os
import sys
import tempfile


from stepsync import StepSyncCallback
from harness.runs import dump, end_process_group, record_losses, result_summary, run_tiny

CASES = [("warn", 0), ("warn", 2), ("sync", 0), ("sync", 2), ("realign", 0), ("drop_last", 0), ("raise", 0)]


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for policy, stage in CASES:
        # 12 samples, batch 1, 2 ranks -> 6 micro-batches per rank; G=4 leaves a partial window of 2.
        work, losses = tempfile.mkdtemp(), []
        result = run_tiny(work, samples=12, gas=4, epochs=2, stage=stage,
                          callback=StepSyncCallback(policy, console=None if rank == 0 else False),
                          on_trainer=lambda trainer: record_losses(trainer, losses))
        results[f"{policy}-{stage}"] = {**result_summary(result), "losses": losses,
                                        "train_loss": (result.trainer.state.log_history or [{}])[-1].get("train_loss")}
    dump(os.path.join(out_dir, f"rank-{rank}.json"), results)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()
