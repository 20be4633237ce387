"""One phase of a resume on another layout, under torchrun (or as one process): each rank writes OUT/NAME-R.json
with the sample index of every micro-batch it trained (recorded by the Trainer's own training_step, not by
stepsync), the Trainer's count before it, and stepsync's report.

    python -m torch.distributed.run --nproc_per_node W tests/entry/relayout_runs.py OUT NAME SAMPLES G EPOCHS
        POLICY [CHECKPOINT]

STEPSYNC_ZERO_STAGE (default 0) sets the ZeRO stage ("none": without DeepSpeed, DDP on gloo); STEPSYNC_LOAD_UNIVERSAL=1 resumes from DeepSpeed's universal
copy of the checkpoint ("checkpoint": {"load_universal": true} in the DeepSpeed config); STEPSYNC_DROP_LAST=1 sets
dataloader_drop_last.
"""
import json
import os
import sys
import warnings

from harness.runs import end_process_group, run_tiny
from stepsync import StepSyncCallback


class Indexed:
    """``samples`` sequences whose first token is their index: what a micro-batch trained is read from it."""

    def __init__(self, samples):
        import torch

        generator = torch.Generator().manual_seed(3)
        self.rows = torch.randint(0, 64, (samples, 8), generator=generator)
        self.rows[:, 0] = torch.arange(samples)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def recording_trainer(trainer_class, trained: list):
    """``trainer_class`` recording into ``trained``, for every micro-batch: the Trainer's own epoch (its loop's
    variable), its count before it, and the samples, as it trains them."""

    class Recording(trainer_class):
        def _run_epoch(self, *args, **kwargs):
            self.recorded_epoch = kwargs["epoch"]
            return super()._run_epoch(*args, **kwargs)

        def training_step(self, model, inputs, *args, **kwargs):
            trained.append([self.recorded_epoch, self.state.global_step, inputs["input_ids"][:, 0].tolist()])
            return super().training_step(model, inputs, *args, **kwargs)

    return Recording


def main(out, name, samples, gas, epochs, policy, checkpoint=None):
    from transformers import Trainer

    warnings.filterwarnings("ignore")
    trained = []
    Recording = recording_trainer(Trainer, trained)

    from stepsync.tools.tiny_run import deepspeed_config

    stage = os.environ.get("STEPSYNC_ZERO_STAGE", "0")
    config = None if stage == "none" else deepspeed_config(int(stage))  # "none": DDP, or one process
    if os.environ.get("STEPSYNC_LOAD_UNIVERSAL") == "1":
        config["checkpoint"] = {"load_universal": True}
    from transformers import TrainerCallback

    logged = []

    class Logs(TrainerCallback):  # the records this run logs (stepsync completes them before this callback)
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append([logs.get("stepsync/samples_skipped"), logs.get("stepsync/samples_repeated")])

    callback = StepSyncCallback(policy, console=False) if policy != "none" else None  # "none": saved without it
    result = run_tiny(os.path.join(out, name), samples, gas, epochs, callback=callback, trainer_class=Recording,
                      extra_callbacks=[Logs()],
                      train_dataset=Indexed(samples), save_strategy="steps", save_steps=1,
                      resume_from_checkpoint=checkpoint, deepspeed=config,
                      dataloader_drop_last=os.environ.get("STEPSYNC_DROP_LAST") == "1")
    report = callback.report if callback is not None else None
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(out, f"{name}-{rank}.json"), "w") as handle:
        json.dump({"trained": trained, "error": type(result.error).__name__ if result.error else None,
                   "error_message": str(result.error) if result.error else None,
                   "shift": report.resume_shift.to_dict() if report and report.resume_shift else None,
                   "global_step": result.trainer.state.global_step, "report": report.to_dict() if report else None,
                   "logged": logged}, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6],
         *(sys.argv[7:8]))
    end_process_group()
