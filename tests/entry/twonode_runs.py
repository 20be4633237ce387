"""Run under torchrun (two nodes of one process, or one node of two): real runs, each rank writes what it saw.

    python -m torch.distributed.run ... tests/entry/twonode_runs.py OUT CASE [CASE ...]

Each case trains the tiny model on 6 samples (3 micro-batches per rank, G=2: a partial window at every epoch
end), saving every 2 updates. A case's output dir is shared (OUT/CASE/shared) or one per node
(OUT/CASE/node-R). A fault case makes stepsync's record write fail on one rank only, as a full disk would.
Each rank writes OUT/CASE/rank-R.json: the report, the independent recording and the audit of its output dir.
Markers on stdout and stderr ("=== case CASE") split each node's output by case.
"""
import errno
import os
import sys


from stepsync import StepSyncCallback
from harness.runs import dump, end_process_group, result_summary, run_tiny

# name: (policy, epochs, dir per node, save_on_each_node, log_on_each_node, fault: (rank, checkpoint) or None)
CASES = {
    "warn-shared": ("warn", 2, False, False, False, None),
    "sync-shared-each-node": ("sync", 2, False, True, True, None),
    "sync-node-dirs": ("sync", 2, True, True, True, None),
    "realign-shared-each-node": ("realign", 3, False, True, True, None),
    "raise-shared": ("raise", 2, False, False, True, None),
    "realign-fault-node1": ("realign", 3, True, True, True, (1, 2)),
    "drop_last-fault-node1": ("drop_last", 3, True, True, True, (1, 2)),
    # The node-1 fault left its checkpoint-2/trainer_state.json at another count than node 0's: resume both.
    "resume-apart": ("realign", 3, True, True, True, (1, 2)),
    "realign-fault-rank0": ("realign", 3, False, False, True, (0, 2)),
    "drop_last-fault-rank0": ("drop_last", 3, False, False, True, (0, 2)),
}


def fail_record_writes(at_checkpoint: int):
    """Make stepsync's record write into checkpoint-N fail on this rank (ENOSPC), as a full disk would."""
    import stepsync.trainer.trainer as checkpoint  # where the callback calls save_record

    real = checkpoint.save_record

    def save_record(folder, *args, **kwargs):
        if os.path.basename(folder) == f"checkpoint-{at_checkpoint}":
            raise OSError(errno.ENOSPC, "No space left on device (injected)", folder)
        return real(folder, *args, **kwargs)

    checkpoint.save_record = save_record
    return lambda: setattr(checkpoint, "save_record", real)


def resume_apart(output_dir: str, node: int):
    """Resume each node from its own checkpoint-2 (node 1 given node 0's 'latest', as inspect says)."""
    import shutil

    checkpoint = os.path.join(output_dir, "checkpoint-2")
    if node == 1:
        shutil.copy(os.path.join(os.path.dirname(output_dir), "node-0", "checkpoint-2", "latest"), checkpoint)
    return run_tiny(output_dir + "-resumed", samples=6, gas=2, epochs=3, callback=StepSyncCallback("realign"),
                    save_on_each_node=True, resume_from_checkpoint=checkpoint)


def run_case(out_dir: str, name: str) -> None:
    from stepsync.tools.audit import audit_output_dir

    policy, epochs, dir_per_node, save_on_each_node, log_on_each_node, fault = CASES[name]
    rank, node = int(os.environ["RANK"]), int(os.environ.get("GROUP_RANK", 0))
    for stream in (sys.stdout, sys.stderr):
        print(f"=== case {name}", file=stream, flush=True)
    case_dir = os.path.join(out_dir, name)
    output_dir = os.path.join(case_dir, f"node-{node}" if dir_per_node else "shared")
    restore = fail_record_writes(fault[1]) if fault is not None and fault[0] == rank else None
    try:
        result = run_tiny(output_dir, samples=6, gas=2, epochs=epochs, callback=StepSyncCallback(policy),
                          save_strategy="steps", save_steps=2, save_on_each_node=save_on_each_node,
                          log_on_each_node=log_on_each_node)
    finally:
        if restore is not None:
            restore()
    if name == "resume-apart":
        result = resume_apart(output_dir, node)
    summary = result_summary(result)
    summary.update(
        max_steps=result.trainer.state.max_steps, checks=result.recording.checks, saves=result.recording.saves,
        saved_after=result.recording.saved_after,
        output_dir=output_dir, should_save=bool(result.trainer.args.should_save),
        audit=audit_output_dir(output_dir).to_dict() if os.path.isdir(output_dir) and any(
            n.startswith("checkpoint-") for n in os.listdir(output_dir)) else None)
    dump(os.path.join(case_dir, f"rank-{rank}.json"), summary)


if __name__ == "__main__":
    for case in sys.argv[2:]:
        run_case(sys.argv[1], case)
    end_process_group()
