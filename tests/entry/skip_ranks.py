"""Run under `torchrun --nproc_per_node 2`: bf16 runs in which one micro-batch's loss is not finite on rank 1
only; each rank writes what it saw to OUT/rank-R.json."""
import os
import sys
import tempfile

from stepsync import StepSyncCallback
from harness.nonfinite import bf16_config, nan_trainer
from harness.runs import dump, end_process_group, run_tiny

CASES = [("warn", 0), ("warn", 2), ("raise", 2)]


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    bf16_config()
    results = {}
    for policy, stage in CASES:
        # 8 samples on 2 ranks, batch 1, G=2: 2 updates per rank; rank 1's third loss is not finite (update 2).
        callback = StepSyncCallback(policy, console=False)
        result = run_tiny(tempfile.mkdtemp(), samples=8, gas=2, epochs=1, stage=stage, callback=callback, bf16=True,
                          trainer_class=nan_trainer(3, rank=1))
        report = callback.report
        results[f"{policy}-{stage}"] = {
            "engine": [result.engine.global_steps, result.engine.skipped_steps],
            "skipped": [[s.epoch, s.micro_batch, s.engine_steps] for s in report.skipped_updates],
            "applied": report.applied_steps, "error": type(result.error).__name__ if result.error else None,
            "micro_batches": len(result.recording.engine_steps)}
    dump(os.path.join(out_dir, f"rank-{rank}.json"), results)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()
