"""A tiny real run: GPT-2 built from a config, data in memory, the real Trainer and DeepSpeed on CPU.

Used by the tests, the demo, the notebook and the benchmark. Nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any, List, Optional


PROCESS_GROUP_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def child_env(env=None) -> dict:
    """A copy of ``env`` (default: this process's) for a child that starts its own process group: without
    the rendezvous variables, whose port this process holds."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in PROCESS_GROUP_VARS}


def cpu_distributed_env() -> None:
    """Single-process environment DeepSpeed needs on a CPU machine (kept when torchrun set it)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from ..core.versions import installed_version

    # One compiled-op cache per DeepSpeed release: two releases must never share it.
    cache = os.path.join(os.path.expanduser("~"), ".cache", "stepsync", f"deepspeed-{installed_version('deepspeed')}")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", cache)
    skip_shared_memory_op()
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


def skip_shared_memory_op() -> None:
    """Tell DeepSpeed not to build its shared-memory collective for CPU (a minute of g++ per environment).

    It is an optional speed-up of CPU all-reduce: where it cannot be built, DeepSpeed uses gloo, exactly as
    it does on every platform but Linux. The engine, its counters and its updates are untouched. DeepSpeed
    keeps the table of buildable ops in ``deepspeed.ops.__compatible_ops__`` for such edits. Set
    ``STEPSYNC_BUILD_SHM_OP=1`` to build it anyway.
    """
    if os.environ.get("STEPSYNC_BUILD_SHM_OP") == "1":
        return
    try:
        import deepspeed.ops
    except ImportError:  # no DeepSpeed here: nothing to build
        return
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(stage: int = 0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_allow_untested_optimizer": True,
    }


def tiny_model(seed: int = 0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


class TinyDataset:
    """``samples`` fixed sequences of 8 tokens, the same on every call."""

    def __init__(self, samples: int, seed: int = 1) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, 64, (samples, 8), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


@dataclass
class Recording:
    """What the real run did, recorded independently of stepsync, one entry per micro-batch.

    ``checks`` lists ``(where, Trainer count, engine count)`` at train begin, every step end and every epoch
    end, as stepsync checks them; ``saves`` both counts at every save; ``logs`` every log record of this
    run with the engine's count after the last micro-batch before it.
    """

    trainer_steps: List[int] = field(default_factory=list)
    engine_steps: List[int] = field(default_factory=list)
    trainer_updates_at: List[int] = field(default_factory=list)
    engine_updates_at: List[int] = field(default_factory=list)
    epoch_ends: List[tuple] = field(default_factory=list)
    engine_at_start: Optional[int] = 0
    checks: List[tuple] = field(default_factory=list)
    saves: List[tuple] = field(default_factory=list)
    logs: List[tuple] = field(default_factory=list)
    history_at_start: int = 0  # log records the state held when training began (a resumed checkpoint's)


def recorder(trainer_ref: list, recording: Recording):
    """A callback that writes both counters after every micro-batch into ``recording``."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def _engine(self):
            return trainer_ref[0].model_wrapped

        def on_train_begin(self, args, state, control, **kwargs):
            recording.engine_at_start = getattr(self._engine(), "global_steps", None)
            recording.checks.append(("train_begin", state.global_step, recording.engine_at_start))
            recording.history_at_start = len(state.log_history)

        def _after(self, state, trainer_updated):
            engine = self._engine()
            steps = getattr(engine, "global_steps", None)
            if steps is None:
                return
            index = len(recording.engine_steps) + 1
            before = recording.engine_steps[-1] if recording.engine_steps else recording.engine_at_start
            if steps != before:
                recording.engine_updates_at.append(index)
            if trainer_updated:
                recording.trainer_updates_at.append(index)
                recording.checks.append(("step_end", state.global_step, steps))
            recording.trainer_steps.append(state.global_step)
            recording.engine_steps.append(steps)

        def on_substep_end(self, args, state, control, **kwargs):
            self._after(state, False)

        def on_step_end(self, args, state, control, **kwargs):
            self._after(state, True)

        def on_epoch_end(self, args, state, control, **kwargs):
            steps = getattr(self._engine(), "global_steps", None)
            recording.epoch_ends.append((state.global_step, steps))
            recording.checks.append(("epoch_end", state.global_step, steps))

        def on_save(self, args, state, control, **kwargs):
            recording.saves.append((state.global_step, getattr(self._engine(), "global_steps", None)))

        def on_log(self, args, state, control, logs=None, **kwargs):
            engine = recording.engine_steps[-1] if recording.engine_steps else recording.engine_at_start
            recording.logs.append((dict(logs or {}), engine))

    return Recorder()


@dataclass
class RunResult:
    trainer: Any
    recording: Recording
    callback: Any
    error: Optional[BaseException] = None

    @property
    def engine(self):
        return self.trainer.model_wrapped

    @property
    def model(self):
        return self.trainer.model


def training_args(output_dir: str, gas: int, epochs: float = 2, max_steps: int = -1, stage: int = 0,
                  deepspeed: bool = True, **overrides):
    from transformers import TrainingArguments

    options = dict(
        output_dir=output_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=gas,
        num_train_epochs=epochs,
        max_steps=max_steps,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        deepspeed=deepspeed if isinstance(deepspeed, dict) else deepspeed_config(stage) if deepspeed else None,
    )
    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    if "use_cpu" in fields and _installed_at_least("accelerate", "1.0.0"):
        # On a machine without an accelerator, accelerate 1.16 under torchrun counts one process unless told
        # the run is on CPU (then the Trainer sees world_size=1 while DeepSpeed sees every rank); accelerate
        # 0.34 instead drops DeepSpeed for DDP when told so.
        options["use_cpu"] = True
    if "xpu_backend" in fields and not _installed_at_least("transformers", "4.30.0"):
        # transformers < 4.30 sets up its own process group: gloo on CPU. Later releases leave the device to
        # accelerate, which drops DeepSpeed for DDP when told no_cuda.
        options.update(no_cuda=True, xpu_backend="gloo")
    options.update(overrides)
    return TrainingArguments(**options)


def _installed_at_least(package: str, version: str) -> bool:
    from ..core.versions import installed_version, parse_version

    return parse_version(installed_version(package) or "0") >= parse_version(version)


def run_tiny(output_dir: str, samples: int, gas: int, epochs: float = 2, max_steps: int = -1, stage: int = 0,
             callback: Any = None, deepspeed: bool = True, resume_from_checkpoint: Optional[str] = None,
             extra_callbacks=(), trainer_class=None, on_trainer=None, eval_samples: int = 0, model=None,
             **overrides) -> RunResult:
    """Train the tiny model (or ``model``) once; ``callback`` is a StepSyncCallback or None (run without stepsync)."""
    cpu_distributed_env()
    from transformers import Trainer

    recording = Recording()
    trainer_ref: list = []
    callbacks = [recorder(trainer_ref, recording), *extra_callbacks]
    if callback is not None:
        callbacks.append(callback)
    args = training_args(output_dir, gas, epochs, max_steps, stage, deepspeed, **overrides)
    trainer = (trainer_class or Trainer)(model=model if model is not None else tiny_model(), args=args, train_dataset=TinyDataset(samples),
                                         eval_dataset=TinyDataset(eval_samples, seed=2) if eval_samples else None,
                                         callbacks=callbacks)
    trainer_ref.append(trainer)
    if on_trainer is not None:
        on_trainer(trainer)
    result = RunResult(trainer, recording, callback)
    try:
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    except Exception as exc:  # the caller asserts on it
        result.error = exc
    return result


def result_summary(result: RunResult) -> dict:
    """JSON-ready facts of a run (for two-process runs, written per rank)."""
    report = result.callback.report if result.callback is not None else None
    rec = result.recording
    return {
        "trainer_steps": result.trainer.state.global_step,
        "engine_steps": getattr(result.engine, "global_steps", None),
        "trainer_updates_at": rec.trainer_updates_at,
        "engine_updates_at": rec.engine_updates_at,
        "epoch_ends": rec.epoch_ends,
        "error": type(result.error).__name__ if result.error else None,
        "error_message": str(result.error) if result.error else None,
        "report": report.to_dict() if report is not None else None,
        "forecast": report.forecast.to_dict() if report is not None and report.forecast else None,
        "log_keys": [sorted(k for k in rec_log if k.startswith("stepsync/")) for rec_log in result.trainer.state.log_history],
        "final_lr": _last_lr(result),
    }


def _last_lr(result: RunResult):
    scheduler = getattr(result.engine, "lr_scheduler", None)
    if scheduler is None:
        return None
    try:
        return float(scheduler.get_last_lr()[0])
    except Exception:
        return None


def dump(path: str, data: Any) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle)


def final_parameters(result: RunResult):
    """Every trained parameter, flattened into one fp32 tensor (ZeRO 0-2 keep full parameters on each rank)."""
    import torch

    return torch.cat([p.detach().float().flatten() for p in result.model.parameters()])


@dataclass
class LoopRun:
    """A custom accelerate loop's run, recorded by the loop itself (independently of stepsync)."""

    accelerator: Any
    engine: Any
    watch: Any
    loop_steps: List[int] = field(default_factory=list)
    engine_steps: List[int] = field(default_factory=list)
    epoch_ends: List[tuple] = field(default_factory=list)
    error: Optional[BaseException] = None

    @property
    def model(self):
        return self.engine.module

    @property
    def loop_updates_at(self) -> List[int]:
        return rises(self.loop_steps)

    @property
    def engine_updates_at(self) -> List[int]:
        return rises(self.engine_steps)


def rises(counts: List[int]) -> List[int]:
    """1-based micro-batch indices after which a counter went up."""
    return [i + 1 for i, value in enumerate(counts) if value > (counts[i - 1] if i else 0)]


def loop_deepspeed_config(gas: int, stage: int = 0) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}


def run_loop(samples: int, gas: int, epochs: int, policy: Optional[str] = "warn", stage: int = 0,
             outside_accumulate: bool = False, seed: int = 0, trackers=()) -> LoopRun:
    """Train the tiny model with a loop shaped like transformers' run_clm_no_trainer.py on accelerate + DeepSpeed.

    ``policy=None`` runs without stepsync; ``outside_accumulate`` calls ``accelerator.backward`` outside
    ``accelerator.accumulate()`` (the pattern stepsync warns about).
    """
    cpu_distributed_env()
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from transformers import get_scheduler

    import stepsync

    from accelerate.state import AcceleratorState, GradientState

    # One process may run several loops (the tests do): accelerate keeps one shared state per process.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=gas,
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=loop_deepspeed_config(gas, stage)))
    accelerator.trackers.extend(trackers)  # what init_trackers() would hold: accelerator.log() writes to them
    model = tiny_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataloader = torch.utils.data.DataLoader(TinyDataset(samples), batch_size=1)
    steps_per_epoch = -(-len(dataloader) // gas)  # as run_clm_no_trainer.py plans them
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0,
                              num_training_steps=epochs * steps_per_epoch)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    engine = accelerator.deepspeed_engine_wrapped.engine
    watch = stepsync.watch(accelerator, policy, dataloader=dataloader, num_epochs=epochs, console=False) \
        if policy else None
    result = LoopRun(accelerator, engine, watch)
    completed = 0
    try:
        for _ in range(epochs):
            model.train()
            for batch in dataloader:
                if outside_accumulate:
                    accelerator.backward(model(**batch).loss)
                    optimizer.step(), scheduler.step(), optimizer.zero_grad()
                else:
                    with accelerator.accumulate(model):
                        accelerator.backward(model(**batch).loss)
                        optimizer.step(), scheduler.step(), optimizer.zero_grad()
                if accelerator.sync_gradients:  # the loop's own count of updates, as in the examples
                    completed += 1
                result.loop_steps.append(completed)
                result.engine_steps.append(engine.global_steps)
            result.epoch_ends.append((completed, engine.global_steps))
    except Exception as exc:  # the caller asserts on it
        result.error = exc
    finally:
        if watch is not None:
            watch.close()
    return result
