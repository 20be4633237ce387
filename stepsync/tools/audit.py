"""``stepsync inspect``: audit the checkpoints of a Trainer output directory. Pure file reading.

For every ``checkpoint-N/``: the Trainer's step (folder name and ``trainer_state.json``), DeepSpeed's
tag (``latest`` and ``global_stepM/``), the DeepSpeed files a resume reads from ``global_stepM/`` and
stepsync's record; each mismatch (DeepSpeed issue 7405's ``checkpoint-800/global_step799/``) and each
missing, partial or corrupt file is a message, never a traceback. Nothing is unpickled: torch's files are
zip archives that the standard library checks, and the few counts read from inside them come from the
pickle's opcodes, never from running it.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

from ..core import record as checkpoint
from ..core.errors import AuditInputError
from ..core.frameworks import Framework, known_frameworks
from ..core.record import ResumeRecord, rng_state_ranks
from ..core.relayout import places_by_name
from .archives import archive_problem, int_in_pickle
from .audit_words import ADJUSTED, EXPLAINED, NAMES_ELSEWHERE, SEVERAL, Mismatch, listed
from .storage import Located, checkpoints_under, locate

_TAG = re.compile(r"^global_step(\d+)$")
# DeepSpeed's files in global_stepM/: model states per model-parallel rank (ZeRO 0-2) or per data-parallel and
# model-parallel rank (ZeRO-3), optimizer states per data-parallel rank (ZeRO >= 1; bf16_ for the bf16 optimizer).
_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_STATES = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass
class CheckpointAudit:
    """One ``checkpoint-N`` folder (or Ray Train's ``checkpoint_<timestamp>/checkpoint/``).

    Attributes:
        trainer_step: N, from the folder name (Ray's: from its ``trainer_state.json``).
        trainer_state_step: ``global_step`` in ``trainer_state.json`` (None when unreadable).
        deepspeed_tag: the tag in ``latest``; deepspeed_step: its number.
        tag_folders: the numbers of the ``global_stepM/`` folders present.
        record: stepsync's record, when the run had stepsync.
        node_local: the folder a node other than node 0 saved for itself (``save_on_each_node=True``): DeepSpeed
            wrote no ``latest`` there, the tag comes from its ``global_stepM/``.
        zero_stage, saved_world_size: the ZeRO stage and the data-parallel ranks the DeepSpeed files were saved
            with, read from their names and the pickle's opcodes (None when they do not say).
        universal: a universal copy (``global_stepM_universal/``, DeepSpeed's ``ds_to_universal``) is there.
        num_train_epochs: the epochs the run planned (``trainer_state.json``).
        loop: a custom loop's ``accelerator.save_state`` folder: ``trainer_step`` is the loop's count in stepsync's
            record (without one it is not known, and neither is the drift).
        findings: counts that disagree (:attr:`mismatches` in words); problems: missing, partial or corrupt files.
    """

    name: str
    path: str
    trainer_step: int
    trainer_state_step: Optional[int] = None
    deepspeed_tag: Optional[str] = None
    deepspeed_step: Optional[int] = None
    tag_folders: List[int] = field(default_factory=list)
    record: Optional[ResumeRecord] = None
    node_local: bool = False
    zero_stage: Optional[int] = None
    saved_world_size: Optional[int] = None
    universal: bool = False
    num_train_epochs: Optional[int] = None
    loop: bool = False
    findings: List[Mismatch] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    @property
    def mismatches(self) -> List[str]:
        """Each finding as a sentence of its own: this checkpoint's numbers, then what it means and the fix."""
        return [f"{self.name} {found.detail}: {EXPLAINED[found.kind]}" for found in self.findings]

    @property
    def ok(self) -> bool:
        return not self.findings and not self.problems

    @property
    def unapplied_at_save(self) -> int:
        """Micro-batches in DeepSpeed's open window at the save (stepsync's record; 0 without one)."""
        return self.record.unapplied_at_save if self.record is not None else 0

    @property
    def adjusted_by(self) -> Optional[str]:
        """The policy that wrote a ``global_step`` other than the folder's into trainer_state.json on purpose (the
        step that lands the Trainer's resume on the next untrained micro-batch), or None."""
        record, state = self.record, self.trainer_state_step
        if record is None or state is None or state == self.trainer_step or record.resume_steps != state:
            return None
        return record.policy

    @property
    def counted(self) -> int:
        """The Trainer's count a resume from here carries: its ``trainer_state.json``'s (a renamed folder keeps
        it), or the folder's where stepsync's record explains the state's (the data position it keeps there)."""
        state, record = self.trainer_state_step, self.record
        if state is None or (record is not None and record.trainer_steps == self.trainer_step
                             and record.resume_steps == state):
            return self.trainer_step
        return state

    @property
    def drift(self) -> Optional[int]:
        """What a resume from here inherits: the Trainer's (or loop's) count minus DeepSpeed's step."""
        if self.deepspeed_step is None or (self.loop and self.record is None):
            return None
        return self.counted - self.deepspeed_step

    @property
    def name_places(self) -> Optional[str]:
        """For a loop's ``save_state`` folder whose record keeps its layout: where the examples' arithmetic on its
        name places a resume, where that is not where the run stood (None where it is, or cannot be told)."""
        record = self.record
        layout = record.layout if record is not None and self.loop else None
        if record is None or layout is None:
            return None
        n = layout.micro_batches_per_epoch
        stood = (record.next_epoch + 1, 0) if record.next_skip >= n else (record.next_epoch, record.next_skip)
        places = places_by_name(self.name, n, layout.gradient_accumulation_steps)
        if not places or any(place == stood for _, place in places):
            return None
        named = " or ".join(f"epoch {epoch + 1}, after micro-batch {skip} ({how})" for how, (epoch, skip) in places)
        return f"{self.name}'s name places a resume at {named}; it holds the run at epoch {stood[0] + 1}, after " \
               f"micro-batch {stood[1]}"

    def to_dict(self) -> dict:
        data = asdict(replace(self, record=None, findings=[]))
        del data["record"], data["findings"]
        return {**data, "mismatches": self.mismatches, "drift": self.drift, "ok": self.ok,
                "unapplied_at_save": self.unapplied_at_save, "adjusted_by": self.adjusted_by,
                "name_places": self.name_places,
                "stepsync_record": self.record.to_dict() if self.record else None}


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
        head = (f"{len(bad)} of {len(self.checkpoints)} checkpoint(s) need attention: {listed(bad, counted=False)}; "
                if bad else "")
        if safe is None:
            return head + "no checkpoint is safe to resume from: each one carries drift or missing files into a resume"
        inherits = (f"a resume inherits drift {safe.drift:+d}" if safe.drift is not None else
                    "saved without stepsync: the loop's count is not kept there" if safe.loop else
                    "no DeepSpeed files: no engine count to compare")
        return head + f"safe to resume from: {safe.name} ({inherits})"

    def findings_once(self) -> List[str]:
        """Each kind of finding once: one checkpoint's in full, several checkpoints' named together (their numbers
        are in the table), with the explanation and the fix."""
        said = []
        for kind in EXPLAINED:
            having = [(item, found) for item in self.checkpoints for found in item.findings if found.kind == kind]
            if len(having) == 1:
                item, found = having[0]
                said.append(f"{item.name} {found.detail}: {EXPLAINED[kind]}")
            elif having:
                said.append(f"{listed([item.name for item, _ in having])} {SEVERAL[kind]}: {EXPLAINED[kind]}")
        return said

    def on_purpose(self) -> List[str]:
        """What a reader must know of the folders, each kind said once: a trainer_state.json step that stepsync wrote
        on purpose (realign and drop_last) beside the folder's own number, once per policy; and a loop's folders whose
        names place a resume elsewhere than their record holds the run."""
        adjusted: Dict[str, List[str]] = {}
        for item in self.checkpoints:
            if item.adjusted_by:
                adjusted.setdefault(item.adjusted_by, []).append(item.name)
        said = [f"{listed(names)} (policy '{policy}'): {ADJUSTED}" for policy, names in adjusted.items()]
        named = [item.name_places for item in self.checkpoints if item.name_places]
        if named:
            more = f"; and {len(named) - 2} more like them" if len(named) > 2 else ""
            said.append("; ".join(named[:2]) + f"{more}: {NAMES_ELSEWHERE}")
        return said

    def to_dict(self) -> dict:
        safe = self.safe
        return {"output_dir": self.output_dir, "ok": self.ok, "safe_to_resume": safe.name if safe else None,
                "mismatches": sum(len(c.mismatches) for c in self.checkpoints),
                "problems": sum(len(c.problems) for c in self.checkpoints),
                "verdict": self.verdict(), "checkpoints": [c.to_dict() for c in self.checkpoints]}


def audit_output_dir(path: str, verify_data: bool = True, framework: Optional[Framework] = None) -> OutputAudit:
    """Audit every checkpoint in a Trainer output directory or a Ray Train run's storage folder
    (:mod:`stepsync.tools.storage`), or the one checkpoint named.

    ``verify_data=False`` checks each DeepSpeed file's structure and pickle but not every tensor's checksum
    (which reads every byte of the checkpoint). ``framework``: the one that saved them (default: told by the
    folders); a folder another framework saved is refused, naming it."""
    if framework is not None and not framework.checkpoints:
        readable = [f.key for f in known_frameworks() if f.checkpoints]
        keys = ", ".join(readable[:-1]) + f" and {readable[-1]}" if len(readable) > 1 else readable[0]
        raise AuditInputError(f"stepsync inspect reads the checkpoints of --framework {keys}; {framework.name} "
                              f"saves none of them (--framework {framework.key}): pass a folder one of those saved")
    if not os.path.exists(path):
        raise AuditInputError(f"{path!r} does not exist: pass the Trainer's output_dir")
    if not os.path.isdir(path):
        raise AuditInputError(f"{path!r} is not a directory: pass the Trainer's output_dir, not a file in it")
    named = locate(path)
    found = [named] if named is not None else checkpoints_under(path)
    if not found:
        raise AuditInputError(f"no checkpoint-N folders (nor Ray Train checkpoint_<timestamp> folders, nor "
                              f"accelerator.save_state or engine.save_checkpoint folders) in {path!r}: "
                              "pass the output_dir of a Trainer run that saved, or Ray Train's <storage_path>/<name>")
    if framework is not None:
        saved_by = {item.name: next(f for f in known_frameworks() if f.checkpoints == item.saved_by) for item in found}
        other = sorted(name for name, by in saved_by.items() if by.checkpoints != framework.checkpoints)
        if other:
            by = saved_by[other[0]]
            raise AuditInputError(f"{', '.join(other)} in {path!r} were saved by {by.name}, not {framework.name}: "
                                  f"pass --framework {by.key} (or leave --framework out)")
    audits = [audit_checkpoint(item.path, verify_data, item) for item in found]
    if named is None and audits:  # the earliest of a run's checkpoints has none earlier to resume from
        first = audits[0]
        first.problems = [problem.replace("resume from an earlier checkpoint", "there is no earlier checkpoint: "
                                          "repair this one, or train from the start") for problem in first.problems]
    return OutputAudit(path, audits)


def audit_checkpoint(path: str, verify_data: bool = True, located: Optional[Located] = None) -> CheckpointAudit:
    """Audit one checkpoint folder (``located``: its name and step where the folder's name does not say them)."""
    located = located or locate(path)
    if located is None:
        raise AuditInputError(f"{path!r} is not a checkpoint-N folder (nor Ray Train's checkpoint_<timestamp>): "
                              "pass one the Trainer saved")
    name = located.name
    if located.loop:
        return _audit_loop(located, verify_data)
    if located.step is None:  # Ray's folder names no step: its trainer_state.json must
        return CheckpointAudit(name, path, 0, problems=[f"{name}: no readable {checkpoint.TRAINER_STATE} gives its "
                                                        "step: the save is incomplete"])
    audit = CheckpointAudit(name, path, located.step)
    if not os.path.isdir(path):
        audit.problems.append(f"{name} is not a directory")
        return audit
    entries = os.listdir(path)
    if not entries:
        audit.problems.append(f"{name} is empty: the save did not complete; delete it")
        return audit
    _read_trainer_state(audit)
    try:
        audit.record = checkpoint.load_record(audit.path)
    except ValueError as exc:
        audit.problems.append(f"{audit.name}: stepsync's record is unreadable ({exc})")
    _read_deepspeed(audit, entries, verify_data)
    _check_record(audit)
    return audit


def _audit_loop(located: Located, verify_data: bool) -> CheckpointAudit:
    """One folder a custom loop saved (``accelerator.save_state``'s, DeepSpeed's files in the tag its ``latest`` names;
    ``engine.save_checkpoint``'s, the tag folder itself): DeepSpeed's step read from its files, against the loop's
    count in stepsync's record (its name may count updates or micro-batches: it is not read)."""
    name, path = located.name, located.path
    audit = CheckpointAudit(name, path, located.step or 0, loop=True)
    try:
        audit.record = checkpoint.load_record(path)
    except ValueError as exc:
        audit.problems.append(f"{name}: stepsync's record is unreadable ({exc})")
    record = audit.record
    if record is not None:
        audit.trainer_step = record.trainer_steps
    by_the_engine = located.saved_by.is_the_tag
    if by_the_engine:  # the folder is DeepSpeed's tag itself (its save_dir holds 'latest')
        audit.deepspeed_tag = name
    else:
        try:
            with open(os.path.join(path, "latest")) as handle:
                audit.deepspeed_tag = handle.read().strip()
        except (OSError, UnicodeDecodeError):
            audit.problems.append(f"{name} has no readable 'latest' file: DeepSpeed's save did not finish (or this "
                                  "loop did not train with DeepSpeed); resume from an earlier checkpoint")
            return audit
    audit.deepspeed_step = located.step
    if located.step is None:
        audit.problems.append(f"{name}/{audit.deepspeed_tag}: no readable model states give DeepSpeed's step: the "
                              "save is incomplete; resume from an earlier checkpoint")
        return audit
    _read_tag_folder(audit, os.listdir(path), verify_data, audit.deepspeed_tag, path if by_the_engine else None)
    if record is None:
        return audit
    if record.trainer_steps != located.step:
        audit.findings.append(Mismatch("engine_loop_count" if by_the_engine else "loop_count",
                                       f"holds DeepSpeed's step {located.step}: your loop counted "
                                       f"{record.trainer_steps} updates (drift {audit.drift:+d})"))
    _check_open_window(audit)
    return audit


def _check_open_window(audit: CheckpointAudit) -> None:
    if audit.unapplied_at_save:
        audit.findings.append(Mismatch("open_window", f"was saved with {audit.unapplied_at_save} micro-batch(es) in "
                                                      "DeepSpeed's open window"))


def _read_trainer_state(audit: CheckpointAudit) -> None:
    state_path = os.path.join(audit.path, checkpoint.TRAINER_STATE)
    if not os.path.isfile(state_path):
        audit.problems.append(f"{audit.name} has no {checkpoint.TRAINER_STATE}: the save is incomplete")
        return
    try:
        state = checkpoint.read_json(state_path, checkpoint.TRAINER_STATE)
    except ValueError as exc:
        audit.problems.append(f"{audit.name}: {exc}")
        return
    step, epochs = state.get("global_step"), state.get("num_train_epochs")
    audit.num_train_epochs = epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else None
    if isinstance(step, bool) or not isinstance(step, int):
        audit.problems.append(f"{audit.name}: {checkpoint.TRAINER_STATE} has no integer global_step")
        return
    audit.trainer_state_step = step


def _read_deepspeed(audit: CheckpointAudit, entries: List[str], verify_data: bool) -> None:
    audit.tag_folders = sorted(int(m.group(1)) for m in map(_TAG.match, entries)
                               if m and os.path.isdir(os.path.join(audit.path, m.group(0))))
    latest = os.path.join(audit.path, "latest")
    if not os.path.isfile(latest):
        if audit.tag_folders:
            _without_latest(audit, entries, verify_data)
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
        return
    _compare_steps(audit)
    _read_tag_folder(audit, entries, verify_data)


def _without_latest(audit: CheckpointAudit, entries: List[str], verify_data: bool) -> None:
    """No ``latest``: a node's own folder (DeepSpeed writes ``latest`` on global rank 0 only), or a save that
    did not finish. The drift is still read from the one ``global_stepM/``."""
    ranks = rng_state_ranks(entries)
    audit.node_local = bool(ranks) and 0 not in ranks
    if len(audit.tag_folders) > 1:
        audit.problems.append(f"{audit.name} has several global_step folders and no 'latest' file: DeepSpeed cannot "
                              "tell which one to load; keep the one this checkpoint was saved with")
        return
    audit.deepspeed_step = audit.tag_folders[0]
    tag = f"global_step{audit.deepspeed_step}"
    if audit.node_local:
        audit.problems.append(
            f"{audit.name} is a node's own copy (save_on_each_node=True; this node saved ranks "
            f"{', '.join(map(str, sorted(ranks)))}) and has no 'latest' file: DeepSpeed writes it on global rank 0 "
            f"only, and a resume here fails without it. Copy node 0's {audit.name}/latest here (it says {tag}), "
            f"or write {tag} into {audit.name}/latest")
    else:
        audit.problems.append(f"{audit.name} has {tag}/ but no 'latest' file: DeepSpeed's save did not finish "
                              f"(or 'latest' was deleted); where {tag}/ is whole (no other line below names it), "
                              f"write {tag} into {audit.name}/latest, else resume from an earlier checkpoint")
    _compare_steps(audit)
    _read_tag_folder(audit, entries, verify_data)


def _compare_steps(audit: CheckpointAudit) -> None:
    if audit.deepspeed_step != audit.counted:
        audit.findings.append(Mismatch(
            "named_by_the_trainer", f"holds DeepSpeed's global_step{audit.deepspeed_step}: the Trainer counted "
                                    f"{audit.counted} updates, the engine made {audit.deepspeed_step} "
                                    f"(drift {audit.drift:+d})"))


def _read_tag_folder(audit: CheckpointAudit, entries: List[str], verify_data: bool, tag: str = "",
                     folder: Optional[str] = None) -> None:
    """Every file DeepSpeed will read from ``global_stepM/`` (a loop's: ``tag``; ``folder``: where that tag folder
    is, when it is the checkpoint itself) is there and whole."""
    tag = tag or f"global_step{audit.deepspeed_step}"
    where = f"{audit.name}/{tag}" if folder is None else audit.name
    folder = folder or os.path.join(audit.path, tag)
    files = sorted(os.listdir(folder))
    broken = {name: why for name in files if name.endswith(".pt")
              for why in [archive_problem(os.path.join(folder, name), verify_data)] if why}
    audit.problems.extend(f"{where}/{name}: {why}" for name, why in broken.items())
    model = [m for m in map(_MODEL_STATES.match, files) if m]
    optim = [m for m in map(_OPTIM_STATES.match, files) if m]
    readable = [os.path.join(folder, m.group(0)) for m in model + optim if m.group(0) not in broken]
    stage = next((v for v in (int_in_pickle(path, "stage") for path in readable) if v is not None), None)
    if stage is None and any(m.group(1) is not None for m in model + optim):
        stage = 3 if any(m.group(1) is not None for m in model) else 1
    # The data-parallel ranks whose files a resume needs: those that saved here (their RNG files), else the
    # world size the files recorded, else every rank a file names.
    ranks = rng_state_ranks(entries)
    world = next((v for v in (int_in_pickle(path, "dp_world_size") for path in readable) if v), None)
    named = {int(m.group(1)) for m in model + optim if m.group(1) is not None}
    audit.zero_stage, audit.saved_world_size = stage, world or (len(named) if named else None)
    audit.universal = os.path.isdir(os.path.join(audit.path, f"{tag}_universal"))
    if not ranks:
        ranks = set(range(world)) if world else named or {0}
    expected = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in sorted(ranks)] if stage == 3 else \
        sorted({m.group(0) for m in model if m.group(1) is None} or {"mp_rank_00_model_states.pt"})
    if stage is not None and stage >= 1:
        prefix = "bf16_" if any(m.group(0).startswith("bf16_") for m in optim) else ""
        expected += [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in sorted(ranks)]
    for name in expected:
        if name not in files:
            whose = "the parameters" if "model_states" in name else "the optimizer states"
            audit.problems.append(f"{where}/{name} is missing: {whose} it holds were not saved (or were deleted); "
                                  "a resume fails there; resume from an earlier checkpoint")


def _check_record(audit: CheckpointAudit) -> None:
    record = audit.record
    state_step = audit.trainer_state_step
    if state_step is not None and audit.counted == state_step != audit.trainer_step:  # unexplained by a record
        audit.findings.append(Mismatch(
            "renamed", f"is named for step {audit.trainer_step} but its trainer_state.json says global_step "
                       f"{state_step}, which a resume from it carries (its name: checkpoint-{state_step})"))
    if record is not None and audit.deepspeed_step is not None and record.engine_steps != audit.deepspeed_step:
        audit.findings.append(Mismatch("record_and_tag", f"has stepsync's record of engine step {record.engine_steps} "
                                                         f"beside DeepSpeed's tag {audit.deepspeed_tag}"))
    _check_open_window(audit)
