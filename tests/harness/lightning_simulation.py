"""Brute-force simulation of Lightning's training loop on DeepSpeed, one micro-batch at a time, written from its
loop (training_epoch_loop.py, automatic.py, the DeepSpeed precision plugin) with no closed form, so that the
forecast's arithmetic can be checked against it."""
from dataclasses import dataclass, field
from typing import List


@dataclass
class LightningRun:
    epoch_ends: List[tuple] = field(default_factory=list)  # (Lightning, engine) after each epoch
    applied: int = 0  # micro-batches whose gradients reached an update
    wiped: int = 0  # cleared by Lightning's zero_grad while the engine still accumulated them
    unapplied: int = 0  # left in the engine's window at the end
    dropped: int = 0


def simulate_lightning(n, g, epochs, stage, policy="warn", max_steps=-1):
    run = LightningRun()
    lightning = engine = micro = 0
    window = []  # micro-batches the engine holds since its last update (their gradients, cleared or not)
    drops = policy in ("drop_last", "sync")
    for _ in range(epochs):
        length = (n // g) * g if drops else n
        for batch_idx in range(length):
            if batch_idx % g == 0 and stage in (0, 1, 3) and policy != "sync":
                run.wiped += sum(1 for held in window if held)  # zero_grad before this batch's backward
                window = [False] * len(window)
            window.append(True)
            boundary = (batch_idx + 1) % g == 0 if policy == "sync" else (micro + 1) % g == 0
            micro += 1
            if boundary:  # engine.step() is called on every micro-batch
                engine += 1
                run.applied += sum(window)
                window = []
            if (batch_idx + 1) % g == 0:  # Lightning steps only on whole windows
                lightning += 1
            if 0 < max_steps <= lightning:
                break
        run.epoch_ends.append((lightning, engine))
        if 0 < max_steps <= lightning:
            break
        run.dropped += n - length  # an epoch that ran to its last whole window
    run.unapplied = len(window)
    run.wiped -= sum(1 for held in window if not held)  # the open window's cleared ones count as unapplied
    return run
