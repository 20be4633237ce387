"""A raw DeepSpeed loop's checkpoints: stepsync's record in every ``engine.save_checkpoint`` folder, a save that a
resume cannot continue from exactly said when it is made, and an ``engine.load_checkpoint`` before the first
micro-batch that carries the report on.

The loop decides itself where a resumed run starts in its data, which stepsync cannot see: a run resumed from a
checkpoint saved inside an epoch has its epochs counted from the loop's first micro-batch after the resume, said so.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..engine.run import Run
from ..engine.watch import ResumingSaves


def checkpoint_folder(save_dir: Any, tag: Any, engine: Any) -> str:
    """The folder ``engine.save_checkpoint(save_dir, tag)`` writes: DeepSpeed's default tag is ``global_stepN``."""
    return os.path.join(os.fspath(save_dir), str(tag if tag is not None else f"global_step{engine.global_steps}"))


class EngineCheckpoints(ResumingSaves):
    """What the engine watch knows of the checkpoints its loop saves (``engine.save_checkpoint``) and loads
    (``load_checkpoint``): the record it keeps in each, the saves a resume cannot continue from, the folder read."""

    save_where = "save after a step() that closes your loop's window"

    def __init__(self) -> None:
        super().__init__("load_checkpoint")


    def after_load(self, run: Run, folder: Optional[str], started: bool) -> None:
        """``load_checkpoint`` read ``folder`` (None: it found no checkpoint, and loaded nothing)."""
        if folder is not None:
            super().after_load(run, folder, started)
