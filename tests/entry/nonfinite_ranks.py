"""Run under `torchrun --nproc_per_node 2`: fp32 runs in which one micro-batch's loss is not finite on rank 1
only, on DeepSpeed releases that apply it; each rank writes what it saw to OUT/rank-R.json."""
import math
import os
import sys
import tempfile

from stepsync import StepSyncCallback
from harness.nonfinite import nan_trainer, whole_weights_sum
from harness.runs import dump, end_process_group, run_tiny

CASES = [("warn", 2), ("warn", 3), ("raise", 3)]


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for policy, stage in CASES:
        # 8 samples on 2 ranks, batch 1, G=2: 2 updates per rank; rank 1's third loss is not finite (update 2).
        callback = StepSyncCallback(policy, console=False)
        result = run_tiny(tempfile.mkdtemp(), samples=8, gas=2, epochs=1, stage=stage, callback=callback,
                          trainer_class=nan_trainer(3, rank=1))
        found = callback.report.non_finite
        results[f"{policy}-{stage}"] = {
            "engine": [result.engine.global_steps, result.engine.skipped_steps],
            "weights_finite": math.isfinite(whole_weights_sum(result.engine.module)),  # this rank's, read apart
            "non_finite": None if found is None else [found.epoch, found.micro_batch, found.engine_steps],
            "error": type(result.error).__name__ if result.error else None,
            "micro_batches": len(result.recording.engine_steps)}
    dump(os.path.join(out_dir, f"rank-{rank}.json"), results)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()
