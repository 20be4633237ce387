"""Resuming: the record a checkpoint saved now must hold, and how a resumed run carries the saved report on."""
from __future__ import annotations

from dataclasses import asdict

from ..core.plan import resume_steps_for
from ..core.record import ResumeRecord
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
