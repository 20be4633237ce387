"""Runs in which one micro-batch's loss is not finite, in bf16: what DeepSpeed skips or applies."""
from __future__ import annotations

import math
import os
from typing import Optional


def nan_trainer(at: int, rank: Optional[int] = None):
    """A Trainer whose ``at``-th loss (1-based, over the run) is not finite; on rank ``rank`` only, when given."""
    from transformers import Trainer

    class NaNAt(Trainer):
        losses = 0

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            NaNAt.losses += 1
            here = rank is None or int(os.environ.get("RANK", "0")) == rank
            return loss * float("nan") if here and NaNAt.losses == at else loss

    return NaNAt


def bf16_config(monkeypatch=None):
    """Make the tiny runs' DeepSpeed config train in bf16 (through ``monkeypatch`` in a test, else for good)."""
    from stepsync.tools import tiny_run

    plain = tiny_run.deepspeed_config

    def config(stage=0):
        return dict(plain(stage), bf16={"enabled": "auto"})

    if monkeypatch is not None:
        monkeypatch.setattr(tiny_run, "deepspeed_config", config)
    else:
        tiny_run.deepspeed_config = config


def whole_weights_sum(module) -> float:
    """The sum of the weights of ``module`` this rank holds: ZeRO-3 keeps them in each parameter's ``ds_tensor``
    (the whole of it on one rank); gathering them from a callback breaks DeepSpeed 0.18's step."""
    return sum(float(getattr(p, "ds_tensor", p).detach().float().sum()) for p in module.parameters())


def deepspeed_skips(stage: int, bf16: bool = True) -> bool:
    """Whether this DeepSpeed skips an update whose gradients are not finite, as probed. bf16: 0.19.3 and later on
    every ZeRO stage; before, ZeRO-0 only (0.18.4: ZeRO 1, 2 and 3 apply it, and every weight turns NaN). fp32:
    0.19.8 on ZeRO 1, 2 and 3, not ZeRO-0; 0.18.4 on none (0.19.5's source checks none either)."""
    from importlib.metadata import version

    from packaging.version import Version

    release = Version(version("deepspeed"))
    if bf16:
        return release >= Version("0.19.3") or stage == 0
    return release >= Version("0.19.8") and stage > 0


def truth_recorder(trainer_ref, rows):
    """After every micro-batch: (epoch, position, global_steps, skipped_steps, LR, weights' fingerprint)."""
    from transformers import TrainerCallback

    class Truth(TrainerCallback):
        position = 0

        def on_epoch_begin(self, args, state, control, **kwargs):
            Truth.position = 0

        def _after(self, state):
            Truth.position += 1
            engine = trainer_ref[0].model_wrapped
            weights = whole_weights_sum(engine.module)
            rows.append((math.ceil(state.epoch or 0) or 1, Truth.position, engine.global_steps, engine.skipped_steps,
                         engine.lr_scheduler.get_last_lr()[0], weights))

        def on_substep_end(self, args, state, control, **kwargs):
            self._after(state)

        def on_step_end(self, args, state, control, **kwargs):
            self._after(state)

    return Truth()


def skipping_run(tmp_path, monkeypatch, stage, g, nan_at, policy="warn", samples=6, epochs=1, bf16=True, rank=None):
    """The tiny run with its ``nan_at``-th loss not finite, and the truth recorded beside it."""
    from accelerate.state import AcceleratorState

    from harness.runs import run

    # A bf16 Trainer leaves its precision in accelerate's state and in ACCELERATE_MIXED_PRECISION: an fp32 run
    # after it in the same process would train in bf16.
    AcceleratorState._reset_state()
    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    if bf16:
        bf16_config(monkeypatch)
    rows, trainer_ref = [], []
    result = run(tmp_path, samples, g, epochs, stage=stage, policy=policy, bf16=bf16,
                 trainer_class=nan_trainer(nan_at, rank), extra_callbacks=[truth_recorder(trainer_ref, rows)], on_trainer=trainer_ref.append)
    return result, rows
