"""A tiny real run: GPT-2 built from a config, data in memory, the real Trainer and DeepSpeed on CPU.

What the demo, the notebook and the benchmark train. Nothing is downloaded.
"""
from __future__ import annotations

import hashlib
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..core.versions import installed_version, parse_version


def cpu_distributed_env() -> None:
    """The environment DeepSpeed needs in a single process on a CPU machine (kept when torchrun set it)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # One compiled-op cache per environment: another environment (another DeepSpeed release, or the same one
    # installed elsewhere) compiles its ops again over the first's (tests/integration/test_op_builds.py).
    here = hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]
    cache = os.path.join(os.path.expanduser("~"), ".cache", "stepsync",
                         f"deepspeed-{installed_version('deepspeed')}-{here}")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", cache)
    skip_shared_memory_op()
    if "RANK" in os.environ and os.environ.get("MASTER_PORT") != _OWN_PORT[0]:
        return  # a launcher's rank keeps its rendezvous
    # A free port for each process group this process starts: one kept for a whole session can be taken meanwhile by
    # another process (a test lane beside it), and the next group would fail to listen there.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    _OWN_PORT[0] = port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


_OWN_PORT = [""]  # the port cpu_distributed_env chose last in this process


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


def installed_at_least(package: str, version: str) -> bool:
    return parse_version(installed_version(package) or "0") >= parse_version(version)


def training_args(output_dir: str, gas: int, epochs: float = 2, max_steps: int = -1, stage: int = 0,
                  deepspeed: Any = True, **overrides):
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
    if "use_cpu" in fields and installed_at_least("accelerate", "1.0.0"):
        # On a machine without an accelerator, accelerate 1.16 under torchrun counts one process unless told
        # the run is on CPU (then the Trainer sees world_size=1 while DeepSpeed sees every rank); accelerate
        # 0.34 instead drops DeepSpeed for DDP when told so.
        options["use_cpu"] = True
    if "xpu_backend" in fields and not installed_at_least("transformers", "4.30.0"):
        # transformers < 4.30 sets up its own process group: gloo on CPU. Later releases leave the device to
        # accelerate, which drops DeepSpeed for DDP when told no_cuda.
        options.update(no_cuda=True, xpu_backend="gloo")
    options.update(overrides)
    return TrainingArguments(**options)


@dataclass
class TinyRun:
    """One finished tiny run: the Trainer, and the exception that ended it early (None when it did not)."""

    trainer: Any
    error: Optional[BaseException] = None

    @property
    def engine(self):
        return self.trainer.model_wrapped

    @property
    def model(self):
        return self.trainer.model


def run_tiny(output_dir: str, samples: int, gas: int, epochs: float = 2, max_steps: int = -1, stage: int = 0,
             callbacks: Sequence[Any] = (), deepspeed: Any = True, resume_from_checkpoint: Optional[str] = None,
             trainer_class=None, on_trainer=None, eval_samples: int = 0, model=None, train_dataset=None,
             **overrides) -> TinyRun:
    """Train the tiny model (or ``model``, on ``train_dataset`` or ``samples`` fixed sequences) once with
    ``callbacks``; an exception is kept, not raised."""
    cpu_distributed_env()
    from transformers import Trainer

    args = training_args(output_dir, gas, epochs, max_steps, stage, deepspeed, **overrides)
    trainer = (trainer_class or Trainer)(
        model=model if model is not None else tiny_model(), args=args,
        train_dataset=train_dataset if train_dataset is not None else TinyDataset(samples),
        eval_dataset=TinyDataset(eval_samples, seed=2) if eval_samples else None, callbacks=list(callbacks))
    if on_trainer is not None:
        on_trainer(trainer)
    result = TinyRun(trainer)
    try:
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    except Exception as exc:  # the caller decides what an early end means
        result.error = exc
    return result
