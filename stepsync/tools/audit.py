"""``stepsync inspect``: audit the checkpoints of a Trainer output directory. Pure file reading.

For every ``checkpoint-N/``: the Trainer's step (folder name and ``trainer_state.json``), DeepSpeed's
tag (``latest`` and ``global_stepM/``) and stepsync's record; each mismatch (DeepSpeed issue 7405's
``checkpoint-800/global_step799/``) and each missing or unreadable file is a message, never a traceback.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import List, Optional

from ..training import checkpoint
from ..core.report import ResumeRecord

_TAG = re.compile(r"^global_step(\d+)$")


class AuditInputError(ValueError):
    """The path is not a Trainer output directory; the message names the fix."""


@dataclass
class CheckpointAudit:
    """One ``checkpoint-N`` folder.

    Attributes:
        trainer_step: N, from the folder name.
        trainer_state_step: ``global_step`` in ``trainer_state.json`` (None when unreadable).
        deepspeed_tag: the tag in ``latest``; deepspeed_step: its number.
        tag_folders: the numbers of the ``global_stepM/`` folders present.
        record: stepsync's record, when the run had stepsync.
        mismatches: counts that disagree; problems: missing, partial or corrupt files.
    """

    name: str
    path: str
    trainer_step: int
    trainer_state_step: Optional[int] = None
    deepspeed_tag: Optional[str] = None
    deepspeed_step: Optional[int] = None
    tag_folders: List[int] = field(default_factory=list)
    record: Optional[ResumeRecord] = None
    mismatches: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.problems

    @property
    def drift(self) -> Optional[int]:
        """What a resume from here inherits: Trainer step minus DeepSpeed step."""
        return None if self.deepspeed_step is None else self.trainer_step - self.deepspeed_step

    def to_dict(self) -> dict:
        return {
            "name": self.name, "path": self.path, "trainer_step": self.trainer_step,
            "trainer_state_step": self.trainer_state_step, "deepspeed_tag": self.deepspeed_tag,
            "deepspeed_step": self.deepspeed_step, "tag_folders": self.tag_folders, "drift": self.drift,
            "stepsync_record": self.record.to_dict() if self.record else None,
            "mismatches": self.mismatches, "problems": self.problems, "ok": self.ok,
        }


@dataclass
class OutputAudit:
    output_dir: str
    checkpoints: List[CheckpointAudit]

    @property
    def safe(self) -> Optional[CheckpointAudit]:
        """The newest checkpoint whose counts agree and whose files are whole."""
        return next((c for c in reversed(self.checkpoints) if c.ok), None)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checkpoints)

    def verdict(self) -> str:
        safe = self.safe
        bad = [c.name for c in self.checkpoints if not c.ok]
        head = f"{len(bad)} of {len(self.checkpoints)} checkpoint(s) need attention ({', '.join(bad)}); " if bad else ""
        if safe is None:
            return head + "no checkpoint is safe to resume from: each one would carry drift or missing files in"
        return head + f"safe to resume from: {safe.name} (a resume inherits drift {safe.drift or 0:+d})"

    def to_dict(self) -> dict:
        safe = self.safe
        return {"output_dir": self.output_dir, "ok": self.ok, "safe_to_resume": safe.name if safe else None,
                "mismatches": sum(len(c.mismatches) for c in self.checkpoints),
                "problems": sum(len(c.problems) for c in self.checkpoints),
                "verdict": self.verdict(), "checkpoints": [c.to_dict() for c in self.checkpoints]}


def audit_output_dir(path: str) -> OutputAudit:
    """Audit every ``checkpoint-N`` in a Trainer output directory, or the one ``checkpoint-N`` folder named."""
    if not os.path.exists(path):
        raise AuditInputError(f"{path!r} does not exist: pass the Trainer's output_dir")
    if not os.path.isdir(path):
        raise AuditInputError(f"{path!r} is not a directory: pass the Trainer's output_dir, not a file in it")
    if checkpoint.step_of(path) is not None:
        return OutputAudit(path, [audit_checkpoint(os.path.normpath(path))])  # the checkpoint that was named
    names = sorted((n for n in os.listdir(path) if checkpoint.step_of(n) is not None), key=checkpoint.step_of)
    if not names:
        raise AuditInputError(f"no checkpoint-N folders in {path!r}: pass the output_dir of a Trainer run that saved")
    return OutputAudit(path, [audit_checkpoint(os.path.join(path, name)) for name in names])


def audit_checkpoint(path: str) -> CheckpointAudit:
    name = os.path.basename(path)
    audit = CheckpointAudit(name, path, checkpoint.step_of(name))
    if not os.path.isdir(path):
        audit.problems.append(f"{name} is not a directory")
        return audit
    entries = os.listdir(path)
    if not entries:
        audit.problems.append(f"{name} is empty: the save did not complete; delete it")
        return audit
    _read_trainer_state(audit)
    _read_deepspeed(audit, entries)
    _read_record(audit)
    return audit


def _read_trainer_state(audit: CheckpointAudit) -> None:
    state_path = os.path.join(audit.path, checkpoint.TRAINER_STATE)
    if not os.path.isfile(state_path):
        audit.problems.append(f"{audit.name} has no {checkpoint.TRAINER_STATE}: the save is incomplete")
        return
    try:
        step = checkpoint.read_json(state_path, checkpoint.TRAINER_STATE).get("global_step")
    except ValueError as exc:
        audit.problems.append(f"{audit.name}: {exc}")
        return
    if isinstance(step, bool) or not isinstance(step, int):
        audit.problems.append(f"{audit.name}: {checkpoint.TRAINER_STATE} has no integer global_step")
        return
    audit.trainer_state_step = step


def _read_deepspeed(audit: CheckpointAudit, entries: List[str]) -> None:
    audit.tag_folders = sorted(int(m.group(1)) for m in map(_TAG.match, entries)
                               if m and os.path.isdir(os.path.join(audit.path, m.group(0))))
    latest = os.path.join(audit.path, "latest")
    if not os.path.isfile(latest):
        if audit.tag_folders:
            audit.problems.append(f"{audit.name} has global_step folders but no 'latest' file: DeepSpeed's save "
                                  "did not finish (or 'latest' was deleted)")
        return
    try:
        with open(latest) as handle:
            tag = handle.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        audit.problems.append(f"{audit.name}: cannot read 'latest': {exc}")
        return
    audit.deepspeed_tag = tag
    match = _TAG.match(tag)
    if not match:
        audit.problems.append(f"{audit.name}: 'latest' says {tag!r}, not a global_stepM tag")
        return
    audit.deepspeed_step = int(match.group(1))
    if audit.deepspeed_step not in audit.tag_folders:
        audit.problems.append(f"{audit.name}: 'latest' names {tag} but there is no such folder")
    if audit.deepspeed_step != audit.trainer_step:
        audit.mismatches.append(
            f"{audit.name} holds DeepSpeed's {tag}: the Trainer counted {audit.trainer_step} updates, the engine "
            f"made {audit.deepspeed_step} (drift {audit.drift:+d}, the DeepSpeed issue 7405 pattern); "
            "a resume inherits it: resume with StepSyncCallback(policy='realign') or use policy='sync' from the start")


def _read_record(audit: CheckpointAudit) -> None:
    try:
        audit.record = checkpoint.load_record(audit.path)
    except ValueError as exc:
        audit.problems.append(f"{audit.name}: stepsync's record is unreadable ({exc})")
    record = audit.record
    state_step = audit.trainer_state_step
    if state_step is not None and state_step != audit.trainer_step:
        explained = record is not None and record.trainer_steps == audit.trainer_step and record.resume_steps == state_step
        if not explained:
            audit.mismatches.append(f"{audit.name}: trainer_state.json says global_step {state_step}")
    if record is not None and audit.deepspeed_step is not None and record.engine_steps != audit.deepspeed_step:
        audit.mismatches.append(f"{audit.name}: stepsync recorded engine step {record.engine_steps}, DeepSpeed's tag "
                                f"is {audit.deepspeed_tag}")
