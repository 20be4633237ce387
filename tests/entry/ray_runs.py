"""One Ray Train job (TorchTrainer, CPU workers, the Trainer + DeepSpeed ZeRO-0 + StepSyncCallback, Ray's own
RayTrainReportCallback and prepare_trainer): each worker writes OUT/NAME-R.json with the sample index of every
micro-batch it trained (recorded by the Trainer's own training_step, not by stepsync) and stepsync's report.

    python tests/entry/ray_runs.py OUT NAME STORAGE WORKERS G POLICY [STOP_AT] [--settings]

A job in STORAGE that saved before resumes from its latest checkpoint, as Ray restores a run. STOP_AT: the job fails
after that many updates (the fault a restart follows); --settings: the training function builds its TrainingArguments
with stepsync.resume_settings() for the world size Ray hands it.
"""
import json
import os
import sys

SAMPLES, EPOCHS = 12, 3
HERE = os.path.dirname(os.path.abspath(__file__))


def train_func(config):
    sys.path[:0] = config["paths"]
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
    from transformers import Trainer, TrainerCallback

    import stepsync
    from harness.runs import run_tiny
    from relayout_runs import Indexed, recording_trainer
    from stepsync.tools.tiny_run import deepspeed_config

    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    trained = []
    Recording = recording_trainer(Trainer, trained)

    class Fault(TrainerCallback):  # a node lost after a checkpoint
        def on_save(self, args, state, control, **kwargs):
            if config["stop_at"] and state.global_step >= config["stop_at"]:
                raise RuntimeError(f"node lost after checkpoint {state.global_step}")

    checkpoint = ray.train.get_checkpoint()
    folder = os.path.join(checkpoint.path, "checkpoint") if checkpoint else None
    batch, gas = 1, config["gas"]
    notes = []
    if config["settings"]:
        settings = stepsync.resume_settings(folder, world, batch, gas)
        batch, gas = settings.per_device_train_batch_size, settings.gradient_accumulation_steps
        notes = settings.notes
    callback = stepsync.StepSyncCallback(config["policy"], console=False)
    result = run_tiny(os.path.join(config["out"], f"{config['name']}-trainer"), SAMPLES, gas, EPOCHS,
                      callback=callback, trainer_class=Recording, train_dataset=Indexed(SAMPLES),
                      extra_callbacks=[RayTrainReportCallback(), Fault()], on_trainer=prepare_trainer,
                      save_strategy="steps", save_steps=1, resume_from_checkpoint=folder, deepspeed=deepspeed_config(0),
                      per_device_train_batch_size=batch)
    report = callback.report
    with open(os.path.join(config["out"], f"{config['name']}-{rank}.json"), "w") as handle:
        json.dump({"trained": trained, "world": world, "gas": gas, "resumed_from": folder, "settings": notes,
                   "report": report.to_dict(), "error": repr(result.error) if result.error else None}, handle)
    if result.error is not None:
        raise result.error


def main(out, name, storage, workers, gas, policy, stop_at=0, settings=False):
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    paths = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]  # relayout_runs, harness, stepsync
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}})
    trainer = TorchTrainer(train_func, train_loop_config={
        "out": out, "name": name, "gas": gas, "policy": policy, "stop_at": stop_at, "settings": settings,
        "paths": paths}, scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(storage_path=storage, name="job", failure_config=FailureConfig(max_failures=0)))
    try:
        trainer.fit()
    except Exception as exc:  # the fault asked for; the workers' files say what they trained
        print(f"fit ended: {type(exc).__name__}: {str(exc)[-2500:]}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0], args[1], args[2], int(args[3]), int(args[4]), args[5], int(args[6]) if len(args) > 6 else 0,
         "--settings" in flags)
