"""Runs in which one micro-batch's loss is not finite, in bf16: what DeepSpeed skips or applies."""
from __future__ import annotations

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
