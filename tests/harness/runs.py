"""Real tiny runs for the tests, each with an independent recorder of both counters (never stepsync's view)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from stepsync.tools import tiny_run

PROCESS_GROUP_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def child_env(env=None) -> dict:
    """A copy of ``env`` (default: this process's) for a child that starts its own process group: without
    the rendezvous variables, whose port this process holds."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in PROCESS_GROUP_VARS}


def end_process_group(code: int = 0) -> None:
    """End this rank, last thing in a script whose results are written: exit at once. Left to the interpreter's exit
    (even after ``destroy_process_group``), gloo's and DDP's threads sometimes abort a rank whose run finished
    (``terminate called without an active exception``). No barrier: a rank that failed must not hold the others."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def torchrun_phase(script: str, out, name: str, world: int, args, timeout: float = 600, **env_vars) -> list:
    """``torchrun --nproc_per_node world script out name *args`` on a free port of 127.0.0.1 (a run that hangs fails
    the test); each rank's OUT/NAME-R.json."""
    import socket
    import subprocess
    import sys

    import pytest

    env = child_env(dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **env_vars))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", port,
               script, str(out), name, *map(str, args)]
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name} hung: {exc}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.load(open(os.path.join(out, f"{name}-{rank}.json"))) for rank in range(world)]


def forget_deepspeed() -> None:
    """Make this process's next run one without DeepSpeed: a DeepSpeed run leaves it switched on in accelerate's
    shared state, in transformers' global config and in the environment (ACCELERATE_USE_DEEPSPEED and its kin)."""
    from accelerate.state import AcceleratorState, GradientState

    try:
        AcceleratorState._reset_state(True)
    except TypeError:  # accelerate < 0.17 resets everything unasked
        AcceleratorState._reset_state()
    if hasattr(GradientState, "_reset_state"):
        GradientState._reset_state()
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:  # transformers < 4.33 keeps it in transformers.deepspeed
        from transformers.deepspeed import unset_hf_deepspeed_config
    unset_hf_deepspeed_config()
    for name in [name for name in os.environ if name.startswith(("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED",
                                                                  "ACCELERATE_MIXED_PRECISION"))]:
        del os.environ[name]


@dataclass
class Recording:
    """What the real run did, recorded independently of stepsync, one entry per micro-batch.

    ``checks`` lists ``(where, Trainer count, engine count)`` at train begin, every step end and every epoch
    end, as stepsync checks them; ``saves`` both counts at every save (``saved_after``: the micro-batches trained by
    then); ``logs`` every log record of this
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
    saved_after: List[int] = field(default_factory=list)  # the micro-batches trained at each save
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
            recording.saved_after.append(len(recording.engine_steps))

        def on_log(self, args, state, control, logs=None, **kwargs):
            engine = recording.engine_steps[-1] if recording.engine_steps else recording.engine_at_start
            recording.logs.append((dict(logs or {}), engine))

    return Recorder()


@dataclass
class RunResult(tiny_run.TinyRun):
    """A tiny run with its independent recording and its StepSyncCallback (None: the run without stepsync)."""

    recording: Recording = field(default_factory=Recording)
    callback: Any = None


def hooks_as_declared(ours, base) -> list:
    """The hooks ``ours`` defines, each checked to take ``base``'s positional parameters (what follows only names one
    of its ``**kwargs``); returns their names."""
    import inspect

    hooks = [name for name in vars(ours) if name.startswith("on_") and callable(getattr(base, name, None))]
    for name in hooks:
        mine = inspect.signature(getattr(ours, name)).parameters.values()
        theirs = [p.name for p in inspect.signature(getattr(base, name)).parameters.values()
                  if p.kind is not p.VAR_KEYWORD]
        required = [p.name for p in mine if p.default is p.empty and p.kind is not p.VAR_KEYWORD]
        assert required == theirs, (ours.__module__, name, required, theirs)
    return hooks


def record_losses(trainer, into: list) -> None:
    """The recorder's own view of the losses: what ``trainer.training_step`` returned on this rank (the Trainer sums
    it into its loss, and gathers the mean over ranks at each log), with the engine's count after each micro-batch."""
    original = trainer.training_step

    def training_step(*args, **kwargs):
        loss = original(*args, **kwargs)
        into.append((float(loss), trainer.model_wrapped.global_steps))
        return loss

    trainer.training_step = training_step


def run_tiny(output_dir: str, samples: int, gas: int, epochs: float = 2, max_steps: int = -1, stage: int = 0,
             callback: Any = None, extra_callbacks=(), **options) -> RunResult:
    """Train the tiny model once with the recorder first, then ``extra_callbacks``, then ``callback`` (a
    StepSyncCallback, or None: the run without stepsync)."""
    recording = Recording()
    trainer_ref: list = []
    callbacks = [recorder(trainer_ref, recording), *extra_callbacks] + ([callback] if callback is not None else [])
    user_hook = options.pop("on_trainer", None)

    def on_trainer(trainer):
        trainer_ref.append(trainer)
        if user_hook is not None:
            user_hook(trainer)

    done = tiny_run.run_tiny(output_dir, samples, gas, epochs, max_steps, stage, callbacks=callbacks,
                             on_trainer=on_trainer, **options)
    return RunResult(done.trainer, done.error, recording, callback)


def run(tmp_path, n, g, epochs, stage=0, policy="warn", **kwargs) -> RunResult:
    """The tiny run of ``n`` samples under ``policy`` (None: without stepsync)."""
    from stepsync import StepSyncCallback

    callback = StepSyncCallback(policy, console=False) if policy else None
    return run_tiny(str(tmp_path), samples=n, gas=g, epochs=epochs, stage=stage, callback=callback, **kwargs)


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


def save_final_parameters(result, out: str) -> None:
    """A child run's last word: its error raised, else its :func:`final_parameters` saved to ``out``, then its
    process ended at once (:func:`end_process_group`)."""
    import torch

    if result.error is not None:
        raise result.error
    torch.save(final_parameters(result), out)
    end_process_group()


def two_ranks(script: str, out, *args: str, what: str = "two-process run") -> list:
    """Run ``script OUT *args`` under ``torchrun --nproc_per_node 2`` on 127.0.0.1; each rank's JSON
    (``OUT/rank-R.json``). A rank left waiting in a collective fails the test instead of hanging CI."""
    import socket
    import subprocess
    import sys

    import pytest

    env = child_env(dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1"))
    with socket.socket() as sock:  # torchrun's --master_port 0 hangs the ranks: pick a free port
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", port, script, str(out), *args],
                              env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what} hung: {exc}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(os.path.join(str(out), f"rank-{rank}.json"))) for rank in (0, 1)]
    ranks.append(proc.stdout + proc.stderr)
    return ranks
