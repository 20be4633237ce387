"""`stepsync inspect` reads inside DeepSpeed's global_stepM/: real checkpoints of ZeRO 0, 2 and 3, damaged."""
import os
import shutil
import subprocess
import sys

import pytest

from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]

# What each ZeRO stage writes into global_stepM/ for one rank.
FILES = {
    0: ["mp_rank_00_model_states.pt"],
    2: ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
    3: ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
}
DAMAGE = {
    "truncated": (lambda path: os.truncate(path, os.path.getsize(path) // 2), "truncated"),
    "emptied": (lambda path: open(path, "w").close(), "empty (0 bytes)"),
    "missing": (os.remove, "is missing"),
    "flipped": (lambda path: _flip_a_byte(path), "fails its checksum"),
}


def _flip_a_byte(path, tensors_only=False):
    """Flip one byte inside the largest record (not in the zip's padding, which nothing reads)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        records = [i for i in archive.infolist() if "/data/" in i.filename or not tensors_only]
        largest = max(records, key=lambda info: info.file_size)
    data = bytearray(open(path, "rb").read())
    name_length, extra_length = struct.unpack("<HH", data[largest.header_offset + 26:largest.header_offset + 30])
    start = largest.header_offset + 30 + name_length + extra_length
    data[start + largest.file_size // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two whole checkpoints per ZeRO stage (aligned, so that damage is the only problem)."""
    from stepsync import StepSyncCallback
    from harness.runs import run_tiny

    out = {}
    for stage in FILES:
        folder = tmp_path_factory.mktemp(f"zero{stage}")
        result = run_tiny(str(folder), samples=4, gas=2, epochs=1, stage=stage, save_strategy="steps", save_steps=1,
                          callback=StepSyncCallback("sync", console=False))
        assert result.error is None
        out[stage] = folder
    return out


@pytest.mark.parametrize("stage", sorted(FILES))
def test_whole_checkpoints_are_safe(saved, stage):
    from stepsync.tools.audit import audit_output_dir

    audit = audit_output_dir(str(saved[stage]))
    tag_files = sorted(os.listdir(saved[stage] / "checkpoint-2" / "global_step2"))
    assert tag_files == sorted(FILES[stage])
    assert audit.ok and audit.safe.name == "checkpoint-2", audit.to_dict()


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("stage, name", [(s, f) for s in sorted(FILES) for f in FILES[s]])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_deepspeed_file_is_named_and_never_safe(saved, tmp_path, stage, name, damage):
    from stepsync.tools.audit import audit_output_dir

    run = tmp_path / "run"
    shutil.copytree(saved[stage], run)
    harm, reason = DAMAGE[damage]
    harm(str(run / "checkpoint-2" / "global_step2" / name))
    audit = audit_output_dir(str(run))
    newest = audit.checkpoints[-1]
    assert not newest.ok and audit.safe.name == "checkpoint-1"  # the older, whole one
    named = [p for p in newest.problems if name in p]
    assert len(named) == 1 and reason in named[0], newest.problems
    done = subprocess.run([sys.executable, "-m", "stepsync", "inspect", str(run / "checkpoint-2")],
                          capture_output=True, text=True, env=dict(os.environ, COLUMNS="200"))
    assert done.returncode == 1 and "BROKEN" in done.stdout and name in done.stdout
    assert "no checkpoint is safe to resume from" in done.stdout


def test_quick_checks_structure_not_every_tensor(saved, tmp_path):
    from stepsync.tools.audit import audit_output_dir

    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    _flip_a_byte(str(run / "checkpoint-2" / "global_step2" / "mp_rank_00_model_states.pt"), tensors_only=True)
    assert not audit_output_dir(str(run)).checkpoints[-1].ok
    assert audit_output_dir(str(run), verify_data=False).checkpoints[-1].ok  # the flipped byte is in a tensor


def test_an_output_dir_with_save_states_file_at_its_root_has_each_checkpoint_audited(tmp_path):
    """Every Trainer example ends with ``trainer.save_state()``, which writes trainer_state.json at the output
    folder's root (transformers' examples/pytorch/language-modeling/run_clm.py): the folder is still read for the
    checkpoints inside it."""
    from harness.runs import run_tiny
    from harness.stack import DRIFTS
    from stepsync.tools.audit import audit_output_dir

    result = run_tiny(str(tmp_path), samples=10, gas=3, epochs=3, save_strategy="epoch")
    assert result.error is None
    result.trainer.save_state()
    assert (tmp_path / "trainer_state.json").is_file()
    audit = audit_output_dir(str(tmp_path))
    assert [item.name for item in audit.checkpoints] == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    # The truth: the engine's count in each folder's DeepSpeed tag, as DeepSpeed wrote it.
    engine = [int(open(tmp_path / name / "latest").read().replace("global_step", "")) for name in
              ("checkpoint-4", "checkpoint-8", "checkpoint-12")]
    assert engine == ([3, 6, 10] if DRIFTS else [4, 8, 12])
    assert [item.drift for item in audit.checkpoints] == [4 - engine[0], 8 - engine[1], 12 - engine[2]]
    assert (audit.safe is None) == DRIFTS
