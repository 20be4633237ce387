"""Run under `torchrun --nproc_per_node 2`: custom accelerate loops; each rank writes what it saw to OUT/rank-R.json.

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/entry/twoproc_loops.py OUT [none|warn|sync|raise ...]
"""
import os
import sys


from harness.runs import dump, end_process_group
from harness.loops import run_loop

def main(out_dir: str, policies) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for policy in policies:
        if policy.startswith("resume-"):  # save every update and epoch, then resume from epoch_0 on both ranks
            results[policy] = resumed_from_the_first_epoch(out_dir, policy.split("-", 1)[1])
            continue
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


def resumed_from_the_first_epoch(out_dir: str, policy: str) -> dict:
    """The loop saved as run_clm_no_trainer.py saves, then resumed with load_state from epoch_0: what the loop itself
    counted (the truth) and what the watch reported, on this rank."""
    saves = os.path.join(out_dir, f"saves-{policy}")
    full = run_loop(12, 4, 2, policy, save_to=saves)
    resumed = run_loop(12, 4, 2, policy, resume_from=os.path.join(saves, "epoch_0"))
    report = resumed.watch.report
    return {"error": type(resumed.error or full.error).__name__ if resumed.error or full.error else None,
            "saved": full.saved["epoch_0"], "full": [full.loop_steps[-1], full.engine_steps[-1]],
            "truth": [resumed.loop_steps[-1], resumed.engine_steps[-1]], "epoch_ends": resumed.epoch_ends,
            "report_counts": [report.trainer_steps, report.engine_steps],
            "report_epochs": [[r.trainer_steps, r.engine_steps] for r in report.epochs],
            "resumed_from": [report.resumed_from.trainer_steps, report.resumed_from.engine_steps]
            if report.resumed_from else None,
            "events": [[event.cause.name, event.drift] for event in report.events],
            "forecast_mismatches": report.forecast_mismatches}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["warn", "sync", "raise"])
    end_process_group()
