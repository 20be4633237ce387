"""Resuming: the record a checkpoint saved now must hold, and how a resumed run carries the saved report on."""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, NamedTuple, Optional, Sequence, Tuple

from ..core.errors import UnsafeCheckpointError
from ..core.plan import resume_steps_for
from ..core.record import RECORD_FILE, ResumeRecord, load_record, write_json
from .run import Run


def record_of(run: Run) -> ResumeRecord:
    """What a checkpoint saved now must hold to carry the run on."""
    report = run.report
    epoch, skip = run.next_position()
    return ResumeRecord(
        policy=run.policy.value,
        trainer_steps=run.trainer_steps_seen,
        engine_steps=run.engine_steps_seen,
        resume_steps=resume_steps_for(epoch, skip, run.n, run.g, run.behaviour) if run.n else None,
        next_epoch=epoch,
        next_skip=skip,
        unapplied_at_save=run.since_engine_update,
        events=list(report.events),
        corrections=report.corrections,
        dropped_micro_batches=dict(report.dropped_micro_batches),
        **({} if run.layout is None else asdict(run.layout)),
    )


def continue_from(run: Run, record: ResumeRecord) -> None:
    """Carry the saved run's report on: its events open this one's."""
    report = run.report
    report.resumed_from = record
    report.events = list(record.events)
    report.corrections = record.corrections
    report.dropped_micro_batches = dict(record.dropped_micro_batches)
    run.last_drift = record.drift
    text = (f"resumed from a checkpoint saved at {report.counter}/{report.updater} {record.trainer_steps}/"
            f"{record.engine_steps} "
            f"under policy '{record.policy}'; the report continues it")
    run.voice.note(text + (f" (drift {record.drift:+d} carried over)" if record.drift else ""))
    if record.unapplied_at_save:
        run.voice.note(f"the checkpoint was saved with {record.unapplied_at_save} micro-batch(es) in DeepSpeed's "
                        "open window; DeepSpeed saves neither their gradients nor its micro-step counter, so they "
                        "are lost and the engine's windows restart here")


class UnsafeSaves:
    """The saves a resume cannot continue from exactly: the first warned (later ones go to the report only), each
    a stop under a policy that stops.

    Attributes:
        said: a save was warned about (said once); later: the saves like it since, kept as one note of the report
            (at index ``at``) that names the last.
    """

    def __init__(self) -> None:
        self.said = False
        self.later = 0  # the saves like the first, counted in one note of the report
        self.at: Optional[int] = None

    def check(self, run: Run, folder: str, since_loop_update: int, save_where: str, more: Sequence[str] = ()) -> None:
        """A save into ``folder`` now: micro-batches in DeepSpeed's open window (lost by a resume), or a save inside
        the loop's window (``since_loop_update`` micro-batches after its last update: ``save_where`` says where to
        save instead), with what else the adapter found (``more``)."""
        said = []
        if run.since_engine_update:
            said.append(f"{run.since_engine_update} micro-batch(es) are in DeepSpeed's open window: DeepSpeed saves "
                        "neither their gradients nor its micro-step counter, so a resume from it loses them")
        elif since_loop_update:
            said.append(f"it was saved inside your loop's window ({since_loop_update} micro-batch(es) after its last "
                        f"update): {save_where}")
        said += more
        if not said:
            return
        text = f"checkpoint {os.path.basename(os.path.normpath(folder))}: " + "; ".join(said)
        if run.policy.stops:  # raises: a save a resume cannot continue from exactly
            run.object_to(text, "at this save", UnsafeCheckpointError)
        if self.said:
            self.later += 1
            self.at = run.voice.running_note(self.at, f"{self.later} later save(s) like it, the last {text}")
        else:
            self.said = True
            run.voice.warn(text + " (later saves like it are counted in the report)")


class LoopSaves:
    """What a loop watch knows of the checkpoints its loop saves and loads: the record it keeps in each, the saves a
    resume cannot continue from (:class:`UnsafeSaves`), and the folder read before the first micro-batch.

    Attributes:
        load_call: the loop's load, as messages name it (``"load_state"``).
        loaded: the folder read before the first micro-batch and its record (None: none read).
        saves: the saves a resume cannot continue from exactly, said.
    """

    def __init__(self, load_call: str) -> None:
        self.load_call = load_call
        self.loaded: Optional[Tuple[str, Optional[ResumeRecord]]] = None
        self.saves = UnsafeSaves()

    @staticmethod
    def keep_the_record(run: Run, folder: str, writes: bool) -> None:
        """The record in the folder, where this process ``writes`` (each node's first: a node saving into a folder
        of its own keeps it too, the same one)."""
        if writes:
            write_json(os.path.join(folder, RECORD_FILE), record_of(run).to_dict())

    def after_load(self, run: Run, folder: Optional[str], started: bool) -> None:
        """The loop's load read ``folder`` (None: which one is not known): its record is read for the first
        micro-batch; after training began, the report's counts are not taken from it."""
        if started:
            run.voice.warn(f"{self.load_call}({folder!r}) after training began: the report's counts are not taken "
                           "again from it")
            return
        record = None
        if folder is not None:
            try:
                record = load_record(folder)
            except ValueError as exc:
                run.voice.error(f"{folder}: stepsync's record is unreadable ({exc}); the report covers this run only")
        self.loaded = (folder or "the newest checkpoint", record)

    @staticmethod
    def say_saved_without_stepsync(run: Run, name: str, engine_steps: int) -> None:
        run.voice.note(f"resumed from {name}, saved without stepsync: your loop's count before it is not kept there, "
                       f"so it is taken as the engine's ({engine_steps}); a drift the checkpoint carries cannot be "
                       "seen, and epochs are numbered from the resume")


class Schedule(NamedTuple):
    """An LR scheduler a run steps, and what steps it: ``by_engine`` (DeepSpeed steps it at each update it applies)
    or the framework's count times ``per_update`` (accelerate steps a prepared scheduler once per process at each
    update of the loop); ``kept_in`` says which checkpoint file restores it."""

    scheduler: Any
    by_engine: bool
    kept_in: str
    per_update: int = 1


ENGINE_KEEPS = ("DeepSpeed restores it with the engine's count from global_stepN/mp_rank_00_model_states.pt (its "
                "lr_scheduler entry) only where the checkpoint is loaded with load_lr_scheduler_states=True")


def engines_schedule(engine: Any) -> Tuple[Schedule, ...]:
    """The LR scheduler DeepSpeed steps at each update it applies, where the engine holds one."""
    scheduler = getattr(engine, "lr_scheduler", None)
    return () if scheduler is None else (Schedule(scheduler, True, ENGINE_KEEPS),)


def schedule_position(scheduler: Any) -> Optional[int]:
    """The steps ``scheduler`` has taken: DeepSpeed's own (``last_batch_iteration + 1``) or torch's (``last_epoch``:
    its construction's own step counts 0), through accelerate's wrappers; None where it keeps neither."""
    inner = getattr(scheduler, "scheduler", scheduler)
    for name, offset in (("last_batch_iteration", 1), ("last_epoch", 0)):
        value = getattr(inner, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value + offset
    return None


def check_the_schedules(run: Run, schedules: Sequence[Schedule], trainer_steps: int, where: str) -> None:
    """Each LR schedule stands where the updates made say it should (at a resume: where the checkpoint left it); one
    that restarted or stepped more is said with the file that should have restored it, or refused under raise."""
    applied = run.engine.global_steps - (run.engine.skipped_steps if run.counts_skips else 0)
    for schedule in schedules:
        position = schedule_position(schedule.scheduler)
        expected = applied if schedule.by_engine else trainer_steps * schedule.per_update
        if position is None or position == expected:
            continue
        counted = (f"the {run.report.updater} applied {applied} update(s)" if schedule.by_engine else
                   f"{run.report.counter} counted {trainer_steps} update(s)"
                   + (f", {schedule.per_update} scheduler steps each" if schedule.per_update > 1 else ""))
        what = "restarted" if position == 0 else f"is {position - expected:+d} step(s) off"
        kind = type(getattr(schedule.scheduler, "scheduler", schedule.scheduler)).__name__
        text = (f"{where}, the LR schedule ({kind}) stands at step {position} where {counted}: it {what}, and the "
                f"learning rate follows it; {schedule.kept_in}")
        run.object_to(text, "before the first micro-batch", UnsafeCheckpointError)
