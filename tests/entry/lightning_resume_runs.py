"""One phase of a Lightning run resumed on another number of ranks, under torchrun (or as one process): Lightning's
own DistributedSampler shards the data; each rank writes OUT/NAME-R.json with (epoch, Lightning's global_step before
it, [sample]) and the batch_idx of every batch it trained, recorded beside stepsync. A checkpoint is saved after every update.

    python -m torch.distributed.run --nproc_per_node W tests/entry/lightning_resume_runs.py OUT NAME SAMPLES G
        EPOCHS POLICY [CKPT]
"""
import json
import os
import sys
import warnings

from harness.lightning_runs import run_lightning
from harness.runs import end_process_group


def main(out, name, samples, gas, epochs, policy, ckpt=None):
    import lightning.pytorch as pl

    from stepsync.lightning import StepSyncCallback

    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", 1))
    trained, batch_indices = [], []

    class Samples(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            trained.append([trainer.current_epoch, trainer.global_step, [int(batch.argmax())]])
            batch_indices.append(batch_idx)

    saving = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(out, name), every_n_train_steps=1, save_top_k=-1,
                                          filename="{step}")
    callback = StepSyncCallback(policy, console=False) if policy != "none" else None
    result = run_lightning(samples, gas, epochs, 0, callback, devices=world, ckpt_path=ckpt,
                           callbacks=[Samples(), saving], use_distributed_sampler=True, enable_checkpointing=True)
    report = callback.report if callback is not None else None
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(out, f"{name}-{rank}.json"), "w") as handle:
        json.dump({"trained": trained, "batch_indices": batch_indices, "error": type(result.error).__name__ if
                   result.error else None, "error_message": str(result.error) if result.error else None,
                   "global_step": result.trainer.global_step,
                   "report": report.to_dict() if report is not None else None}, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6],
         *(sys.argv[7:8]))
    end_process_group()
