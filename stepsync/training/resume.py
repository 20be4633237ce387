"""Resuming: the record stepsync saves with each checkpoint, and how a resumed run carries the report on.

The record's format and its files are in ``checkpoint.py``; this module builds it from a live run and reads
it back into the next one.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from ..core.forecast import resume_steps_for
from ..core.report import ResumeRecord
from . import checkpoint
from .run import RunTracker


def record_of(run: Optional[RunTracker]) -> Optional[ResumeRecord]:
    """What a checkpoint saved now must hold to carry the run on (None without a run)."""
    if run is None:
        return None
    report = run.report
    epoch, skip = run.next_position()
    return ResumeRecord(
        policy=report.policy.value,
        trainer_steps=report.trainer_steps,
        engine_steps=run.engine_steps_seen,
        resume_steps=resume_steps_for(epoch, skip, run.n, run.g, run.behaviour) if run.n else None,
        next_epoch=epoch,
        next_skip=skip,
        unapplied_at_save=run.since_engine_update,
        events=list(report.events),
        corrections=report.corrections,
        dropped_micro_batches=dict(report.dropped_micro_batches),
    )


def saved_record(state: Any, resume_folder: Optional[str]) -> Tuple[Optional[ResumeRecord], str]:
    """(the record of the checkpoint this run resumed from or None, a problem reading it or "")."""
    if state.global_step <= 0:
        return None, ""
    try:
        raw = checkpoint.record_in_trainer_state(getattr(state, "stateful_callbacks", None) or {})
        if raw is not None:
            record = ResumeRecord.from_dict(raw)
        else:
            record = checkpoint.load_record(resume_folder) if resume_folder else None
    except ValueError as exc:
        return None, f"stepsync's record in the checkpoint is unreadable ({exc})"
    if record is not None and state.global_step not in (record.trainer_steps, record.resume_steps):
        return None, (f"stepsync's record is for global_step {record.trainer_steps}, the resumed run is at "
                      f"{state.global_step}")
    return record, ""


def continue_from(run: RunTracker, record: ResumeRecord) -> None:
    """Carry the saved run's report on: its events open this one's."""
    report = run.report
    report.resumed_from = record
    report.events = list(record.events)
    report.corrections = record.corrections
    report.dropped_micro_batches = dict(record.dropped_micro_batches)
    run.last_drift = record.drift
    text = (f"resumed from a checkpoint saved at Trainer/engine {record.trainer_steps}/{record.engine_steps} "
            f"under policy '{record.policy}'; the report continues it")
    run.note(text + (f" (drift {record.drift:+d} carried over)" if record.drift else ""))
    if record.unapplied_at_save:
        run.note(f"the checkpoint was saved with {record.unapplied_at_save} micro-batch(es) in DeepSpeed's "
                 "open window; DeepSpeed saves neither their gradients nor its micro-step counter, so they "
                 "are lost and the engine's windows restart here")
