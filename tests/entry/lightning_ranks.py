"""Run under `torchrun --nproc_per_node 2`: real Lightning + DeepSpeed runs; each rank writes what it saw to
OUT/rank-R.json (the report, the independent recording, the error if any)."""
import json
import os
import sys
import warnings

from harness.lightning_runs import run_lightning
from harness.runs import end_process_group
from stepsync.lightning import StepSyncCallback

CASES = [("warn", 0), ("sync", 0), ("sync", 2), ("drop_last", 2), ("raise", 0)]


def main(out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    results = {}
    for policy, stage in CASES:
        callback = StepSyncCallback(policy, console=False)
        result = run_lightning(3, 2, 2, stage, callback, devices=2, num_nodes=1)
        report = callback.report
        results[f"{policy}-{stage}"] = {
            "error": type(result.error).__name__ if result.error else None,
            # what raise stopped at (the forecast's first drift), else the first drift seen
            "event": (result.error.event.to_dict() if hasattr(result.error, "event") else
                      report.events[0].to_dict() if report.events else None),
            "counts": [report.trainer_steps, report.engine_steps],
            "epochs": [[e.trainer_steps, e.engine_steps] for e in report.epochs],
            "recorded": result.recording.epoch_ends, "batches": result.recording.batches,
            "updates": [{str(k): v for k, v in update.items()} for update in result.recording.updates],
            "dropped": {str(k): v for k, v in report.dropped_micro_batches.items()},
        }
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()
