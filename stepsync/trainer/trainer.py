"""What the Trainer adapter must know of transformers' Trainer: finding it and its engine from a callback,
its resume point, its callback order, its count and logging mark, its flow decisions, and stepsync's record in
its state. Nothing here imports transformers at load time.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from types import FrameType
from typing import Any, Callable, List, Optional, Tuple

from ..core.frameworks import TRAINER
from ..core.record import ResumeRecord, load_record, read_json, record_in_trainer_state, save_record
from ..core.relayout import Layout
from ..engine.deepspeed import is_engine
from ..engine.loop_objects import accelerators_sharding_dropped
from ..engine.resume import record_of
from ..engine.run import Run
from ..engine.steering import Steering
from ..engine.trackers import MLflowRun, OpenedBy, TensorBoardWriter, Tracker, WandbRun

_MAX_FRAMES = 12  # Trainer -> CallbackHandler.on_x -> call_event -> our hook, plus subclasses' overrides


def _calling_frames(depth: int):
    """The frames above the caller of the function that calls this, nearest first, at most ``_MAX_FRAMES``."""
    frame: Optional[FrameType] = sys._getframe(depth + 1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def elect(trainer: Any, callback_class: type) -> Any:
    """The one ``callback_class`` instance that acts for ``trainer``."""
    ours: List[Any] = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, callback_class)]
    return max(ours, key=lambda cb: cb.policy.precedence)  # max() keeps the first of equals


def find_trainer(callback: Any) -> Optional[Any]:
    """The Trainer whose callback handler holds ``callback``, found on the calling stack.

    Called from inside a hook, so the Trainer (or a subclass) is a few frames up; matching on its
    ``callback_handler`` finds the right one even with nested Trainers.
    """
    for frame in _calling_frames(1):
        candidate = frame.f_locals.get("self")
        handler = getattr(candidate, "callback_handler", None)
        if handler is not None and any(cb is callback for cb in getattr(handler, "callbacks", ())):
            return candidate
    return None


def callback_being_restored(cls: type) -> Optional[Any]:
    """The instance of ``cls`` that the Trainer's ``_load_callback_state`` is rebuilding right now, or None.

    That method calls ``type(callback)(**saved_args)`` with the old instance in its local ``callback``.
    """
    frame = sys._getframe(2)  # our caller is cls.__new__; its caller is the one that called cls(...)
    if frame is None or frame.f_code.co_name != "_load_callback_state":
        return None
    candidate = frame.f_locals.get("callback")
    return candidate if type(candidate) is cls else None


def resume_checkpoint(trainer: Any) -> Optional[str]:
    """The ``resume_from_checkpoint`` path of the training loop now running ``trainer``, or None.

    Read from the loop's frame: no Trainer release passes it to callbacks.
    """
    for frame in _calling_frames(1):
        if frame.f_locals.get("self") is trainer and "resume_from_checkpoint" in frame.f_locals:
            path = frame.f_locals["resume_from_checkpoint"]
            return path if isinstance(path, str) else None
    return None


def run_after_the_flow_callback(trainer: Any, callback: Any) -> None:
    """Move ``callback`` just after the Trainer's flow callback.

    The reporting callbacks (TensorBoard, W&B, ...) get ``on_log`` before user callbacks, and the progress
    bar reads the plan at ``on_train_begin`` after them; running before both lets every record carry the
    stepsync metrics and the bar see a lowered plan. A new list leaves the loop that is calling us untouched.
    """
    handler = getattr(trainer, "callback_handler", None)
    if handler is None:
        return
    others = [cb for cb in handler.callbacks if cb is not callback]
    flow = [i for i, cb in enumerate(others) if type(cb).__name__ == "DefaultFlowCallback"]
    at = flow[0] + 1 if flow else 0
    handler.callbacks = [*others[:at], callback, *others[at:]]


def set_global_step(trainer: Any, state: Any, value: int) -> None:
    """Set ``state.global_step`` before the first step, and the marks the Trainer took from it."""
    if getattr(trainer, "_globalstep_last_logged", None) == state.global_step:
        trainer._globalstep_last_logged = value  # else the first log waits until the old count is passed
    if getattr(trainer, "_initial_global_step", None) == state.global_step:
        trainer._initial_global_step = value  # transformers >= 5 divides the final train_loss by the count from it
    state.global_step = value


def move_global_step_back(trainer: Any, state: Any, value: int) -> None:
    """Set ``state.global_step`` back to ``value`` in the middle of training, keeping the logged loss a mean.

    The Trainer logs the loss summed since its last log divided by ``global_step - _globalstep_last_logged``;
    a count moved back would shrink that divisor while the sum keeps every window, so the mark moves back too.
    The run's ``train_loss`` (its summed loss over ``global_step`` less its start) is left to count the engine's
    updates: the losses of micro-batches the engine never applies leave the sum at the end
    (:class:`stepsync.trainer.losses.UnappliedLosses`).
    """
    back = state.global_step - value
    mark = getattr(trainer, "_globalstep_last_logged", None)
    if isinstance(mark, int) and not isinstance(mark, bool):
        trainer._globalstep_last_logged = mark - back
    state.global_step = value


def examples_of(trainer: Any, dataloader: Any) -> Optional[int]:
    """The Trainer's own ``num_examples`` for ``dataloader`` (what 4.46-4.51 size windows from), or None."""
    try:
        return int(trainer.num_examples(dataloader))
    except Exception:  # no len(), or a Trainer without the method: the forecast assumes batch size 1
        return None


def find_engine(trainer: Any) -> Optional[Any]:
    """The DeepSpeed engine of ``trainer`` across transformers releases, or None."""
    wrapper = getattr(getattr(trainer, "accelerator", None), "deepspeed_engine_wrapped", None)
    for candidate in (getattr(trainer, "model_wrapped", None), getattr(trainer, "deepspeed", None),
                      getattr(wrapper, "engine", None)):
        if is_engine(candidate):
            return candidate
    return None


def layout_of(args: Any, engine: Any, examples: Optional[int]) -> Optional[Layout]:
    """How this run splits its data: data-parallel ranks, per-device batch, G, the dataset's length, ZeRO stage,
    whether the dataloader drops an epoch's tail; None where it cannot be told."""
    if examples is None:
        return None
    stage = getattr(engine, "zero_optimization_stage", None)
    world = getattr(engine, "dp_world_size", None) or args.world_size
    return Layout(int(world), args.per_device_train_batch_size, args.gradient_accumulation_steps, examples,
                  stage() if callable(stage) else None, getattr(args, "dataloader_drop_last", False) is True)


def window_ends(trainer: Any) -> Optional[Callable[[], bool]]:
    """Whether the Trainer's running micro-batch closes its window, read at its backward: accelerate's
    ``sync_gradients``, which the Trainer sets before each micro-batch (None where its accelerator has none)."""
    state = getattr(getattr(trainer, "accelerator", None), "gradient_state", None)
    if state is None or not hasattr(state, "sync_gradients"):
        return None
    return lambda: state.sync_gradients


def sharding_asked_and_dropped(trainer: Any, args: Any) -> str:
    """The Trainer was given ``fsdp`` and accelerate did not shard the model (a CPU: it wraps it in DDP); "" else."""
    accelerator = getattr(trainer, "accelerator", None)
    if not getattr(args, "fsdp", None) or accelerator is None:
        return ""
    return accelerators_sharding_dropped(accelerator)


def uses_deepspeed(trainer: Any, args: Any) -> bool:
    """Whether the Trainer was asked to use DeepSpeed."""
    return bool(getattr(args, "deepspeed", None)) or bool(getattr(trainer, "is_deepspeed_enabled", False))


def deepspeed_config(args: Any) -> Optional[dict]:
    """The DeepSpeed config the Trainer will build its engine from, as ``TrainingArguments`` hold it."""
    held = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if isinstance(held, dict):
        return held
    given = getattr(args, "deepspeed", None)
    if isinstance(given, str) and os.path.isfile(given):
        try:
            return read_json(given)
        except ValueError:
            return None
    return given if isinstance(given, dict) else None


def speaks(args: Any, state: Any) -> bool:
    """Whether this rank speaks: where the Trainer's own logs go (each node's local rank 0 with
    ``log_on_each_node``, the default; global rank 0 otherwise)."""
    return bool(getattr(args, "should_log", state.is_world_process_zero))


def steer(trainer: Any, steering: Steering, args: Any, state: Any, control: Any, at_step_end: bool) -> None:
    """Apply what the policy decided to the Trainer's count, plan and control."""
    if steering.max_steps is not None:
        state.max_steps = steering.max_steps
    if steering.trainer_steps is not None:
        move_global_step_back(trainer, state, steering.trainer_steps)
        if at_step_end:  # the flow callback decided logging and saving on the old count
            for flag in ("should_log", "should_evaluate", "should_save", "should_training_stop"):
                setattr(control, flag, False)
            if steering.decide_flow_again:
                from transformers.trainer_callback import DefaultFlowCallback

                DefaultFlowCallback().on_step_end(args, state, control)
    if steering.end_epoch:
        control.should_epoch_stop = True


def asked_clip(args: Any) -> Optional[float]:
    """The clip norm the user asked of the Trainer (``max_grad_norm``; 0 or None: no clipping)."""
    norm = getattr(args, "max_grad_norm", None)
    return float(norm) if isinstance(norm, (int, float)) else None


REPORTING = ("TensorBoardCallback", "MLflowCallback", "WandbCallback")  # report_to's callbacks stepsync writes to


class ReportingCallbacks(OpenedBy):
    """The trackers the Trainer's ``report_to`` callbacks opened: the forecast and the summary go to them as text,
    alerts to W&B; the metrics go in the Trainer's logs, which they log. Each callback opens its tracker at its own
    ``on_train_begin``, after stepsync's (which runs just after the flow callback): the forecast waits for the
    first log."""

    def __init__(self, trainer: Any) -> None:
        super().__init__()
        self.callbacks = [callback for callback in trainer.callback_handler.callbacks
                          if type(callback).__name__ in REPORTING]

    def opened(self) -> List[Tracker]:
        found: List[Tracker] = []
        for callback in self.callbacks:
            name = type(callback).__name__
            if name == "TensorBoardCallback" and getattr(callback, "tb_writer", None) is not None:
                found.append(TensorBoardWriter(callback.tb_writer))
            elif name == "MLflowCallback" and getattr(callback, "_initialized", False):
                found.append(MLflowRun(callback._ml_flow))  # the mlflow module, on the run the callback started
            elif name == "WandbCallback" and getattr(getattr(callback, "_wandb", None), "run", None) is not None:
                found.append(WandbRun(callback._wandb.run))
        return found


def add_metrics(state: Any, logs: dict, engine_steps: int, extra: Optional[dict] = None) -> None:
    """Add both counts and the drift to the record ``logs`` the Trainer is logging, and to its copy in
    ``log_history`` (the Trainer appended it there before calling the callbacks). ``engine_steps``: the count
    after the last micro-batch, not a best checkpoint's that ``load_best_model_at_end`` loaded since; ``extra``: more
    metrics (a resume's shift, what the updates did)."""
    last = state.log_history[-1] if state.log_history else {}
    in_history = logs.items() <= last.items()
    counted, engine, drift = TRAINER.metric_keys
    metrics = {counted: state.global_step, engine: engine_steps, drift: state.global_step - engine_steps,
               **(extra or {})}
    logs.update(metrics)
    if in_history and last:
        last.update(metrics)


def keep_a_place_in(state: Any, name: str, exported) -> None:
    """Give callback ``name`` an entry in ``state.stateful_callbacks`` when the state was loaded from a
    checkpoint written without it: transformers >= 4.41 indexes that entry at every save (a KeyError
    otherwise). ``exported`` builds the entry."""
    stored = getattr(state, "stateful_callbacks", None)
    if isinstance(stored, dict) and name not in stored:
        stored[name] = exported()


def saved_record(state: Any, resume_folder: Optional[str]) -> Tuple[Optional[ResumeRecord], str]:
    """(the record of the checkpoint this run resumed from or None, a problem reading it or "")."""
    if state.global_step <= 0:
        return None, ""
    try:
        raw = record_in_trainer_state(getattr(state, "stateful_callbacks", None))
        if raw is not None:
            record: Optional[ResumeRecord] = ResumeRecord.from_dict(raw)
        else:
            record = load_record(resume_folder) if resume_folder else None
    except ValueError as exc:
        return None, f"stepsync's record in the checkpoint is unreadable ({exc})"
    if record is not None and state.global_step not in (record.trainer_steps, record.resume_steps):
        return None, (f"stepsync's record is for global_step {record.trainer_steps}, the resumed run is at "
                      f"{state.global_step}")
    return record, ""


def save_the_record(run: Run, args: Any, state: Any, stored_by_trainer: bool, must_succeed: bool) -> None:
    """Write stepsync's record into the checkpoint the Trainer has just saved (its own file when the Trainer does
    not keep it); a write that fails is said with what a resume loses, and raises only when ``must_succeed``."""
    record = record_of(run)
    folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
    if not os.path.isdir(folder):
        return run.voice.note(f"no checkpoint folder {folder}: stepsync's record was not saved with it")
    try:
        save_record(folder, record, not stored_by_trainer, lambda: dataclasses.asdict(state))
    except OSError as exc:  # this checkpoint lacks the record; the run and its steering go on
        if must_succeed:
            raise
        lost = [] if stored_by_trainer else ["a resume from it starts a new report"]
        if record.resume_steps not in (None, record.trainer_steps):
            lost.append(f"its trainer_state.json keeps global_step {record.trainer_steps}, so a resume from it "
                        f"does not land at epoch {record.next_epoch + 1}, micro-batch {record.next_skip}")
        return run.voice.error(f"could not write stepsync's record into {folder} ({exc}); "
                               f"{'; '.join(lost) or 'a resume from it loses nothing'}; training goes on")
    if record.resume_steps is None:
        run.voice.note(f"{folder}: no global_step makes the Trainer resume at epoch {record.next_epoch + 1}, "
                       f"micro-batch {record.next_skip}; a resume from it repeats or skips micro-batches")
