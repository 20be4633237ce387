"""stepsync.resume_settings and Ray Train's storage, on checkpoint folders written as the Trainer and Ray write them
(the real Ray jobs: tests/multiprocess/test_ray_train.py; a real ZeRO-2 conversion:
tests/multiprocess/test_resume_on_other_ranks.py)."""
import json

import pytest

import stepsync
from stepsync.core.errors import AuditInputError, StepSyncConfigError
from stepsync.tools.audit import audit_output_dir
from stepsync.tools.storage import checkpoints_under, locate

TWO_RANKS = ["rng_state_0.pth", "rng_state_1.pth"]


def checkpoint(folder, step, files=TWO_RANKS, epoch=None, record=None, max_steps=6):
    """A Trainer checkpoint saved on 2 ranks, batch 1, G=4, 12 samples (2 updates an epoch, 3 epochs)."""
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_bytes(b"")
    state = {"global_step": step, "epoch": step / 2 if epoch is None else epoch, "max_steps": max_steps,
             "num_train_epochs": 3, "train_batch_size": 1}
    if record is not None:
        state["stateful_callbacks"] = {"StepSyncCallback": {"args": {}, "attributes": {"saved_record": record}}}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def ray_storage(root, steps=(1, 2, 3, 4)):
    """Ray Train's <storage_path>/<name>: checkpoint_<timestamp>/checkpoint/ per report, in the order of time."""
    job = root / "job"
    for second, step in enumerate(steps):
        checkpoint(job / f"checkpoint_2026-12-06_07-35-{50 + second:02d}.123456" / "checkpoint", step)
    (job / "checkpoint_manager_snapshot.json").write_text("{}")
    return job


def test_rays_storage_is_read_by_step(tmp_path):
    job = ray_storage(tmp_path, steps=(3, 1, 4, 2))  # the order of time is not the order of steps after a restore
    found = checkpoints_under(str(job))
    assert [item.step for item in found] == [1, 2, 3, 4]
    assert all(item.name.startswith("checkpoint_2026") and item.path.endswith("checkpoint") for item in found)
    audit = audit_output_dir(str(job), verify_data=False)
    assert [c.trainer_step for c in audit.checkpoints] == [1, 2, 3, 4] and audit.ok


def test_one_ray_checkpoint_is_found_from_its_folder_or_the_one_inside(tmp_path):
    """Its DeepSpeed tag inside (global_step4, as the Trainer saves it) is part of it, not a checkpoint of its own:
    Ray's checkpoint/ is not named checkpoint-N."""
    job = ray_storage(tmp_path, steps=(4,))
    (outer,) = [p for p in job.iterdir() if p.is_dir()]
    tag = outer / "checkpoint" / "global_step4"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (outer / "checkpoint" / "latest").write_text("global_step4")
    assert locate(str(outer)) == locate(str(outer / "checkpoint")) == (outer.name, str(outer / "checkpoint"), 4, "trainer")
    assert stepsync.resume_settings(str(outer / "checkpoint"), 2, 1, 4, examples=12).lands_exactly


def test_a_ray_folder_whose_state_is_missing_is_a_problem_not_a_crash(tmp_path):
    job = ray_storage(tmp_path, steps=(1,))
    (job / "checkpoint_2026-12-06_08-00-00.000001" / "checkpoint").mkdir(parents=True)
    audit = audit_output_dir(str(job), verify_data=False)
    assert not audit.ok and "no readable trainer_state.json" in audit.checkpoints[-1].problems[0]


def test_a_folder_with_no_checkpoint_names_both_layouts(tmp_path):
    with pytest.raises(AuditInputError, match="nor Ray Train checkpoint_<timestamp> folders"):
        audit_output_dir(str(tmp_path))


def test_settings_keep_the_global_batch_and_land(tmp_path):
    """Saved on 2 ranks at step 4 (the end of epoch 2), restored on 1: G=8 lands at epoch 3."""
    folder = checkpoint(tmp_path / "checkpoint-4", 4)
    settings = stepsync.resume_settings(str(folder), 1, 1, 4, examples=12)
    assert settings.training_arguments() == {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8}
    assert settings.lands_exactly and not settings.load_universal
    assert settings.shift.repeated == {2: 8} and "no stepsync record in the checkpoint" in settings.message()
    assert settings.message().count("gradient_accumulation_steps=8") == 1  # the advice once
    assert "these settings resume with gradient_accumulation_steps=8 instead" in settings.message()
    # The same ranks: nothing changes, and the message says so.
    same = stepsync.resume_settings(str(folder), 2, 1, 4, examples=12)
    assert same.training_arguments()["gradient_accumulation_steps"] == 4 and same.shift is None
    assert same.message().endswith("the resume on 2 rank(s) with per_device_train_batch_size=1, "
                                   "gradient_accumulation_steps=4 lands where the run stood: nothing to change")


def test_without_a_record_or_the_data_length_the_settings_say_they_cannot_tell(tmp_path):
    folder = checkpoint(tmp_path / "checkpoint-4", 4)
    settings = stepsync.resume_settings(str(folder), 1, 1, 4)
    assert settings.lands_exactly is None and "give resume_settings(..., examples=N)" in settings.message()
    assert settings.gradient_accumulation_steps == 4


def test_no_layout_on_these_ranks_lands_and_it_is_said(tmp_path):
    """Saved on 2 ranks, batch 1, G=2, 12 samples, at step 3 (inside epoch 1 of 3 updates); 3 ranks: nothing fits."""
    folder = checkpoint(tmp_path / "checkpoint-3", 3, epoch=1.0, max_steps=9)
    settings = stepsync.resume_settings(str(folder), 3, 1, 2, examples=12)
    assert settings.lands_exactly is False and "no layout on 3 rank(s) lands there" in settings.message()


def test_a_fresh_start_and_bad_settings(tmp_path):
    assert stepsync.resume_settings(None, 4, 2, 8).training_arguments() == {"per_device_train_batch_size": 2,
                                                                             "gradient_accumulation_steps": 8}
    with pytest.raises(ValueError, match="world_size must be a whole number >= 1"):
        stepsync.resume_settings(None, 0, 1, 1)
    with pytest.raises(ValueError, match="holds no Trainer checkpoint"):
        stepsync.resume_settings(str(tmp_path), 1, 1, 1)


def test_a_partitioned_checkpoint_is_refused_before_anything_loads(tmp_path):
    """ZeRO-2 saved on 2 ranks: DeepSpeed refuses it on 1; the error names the conversion (the real conversion and
    resume: tests/multiprocess/test_resume_on_other_ranks.py)."""
    from harness.stack import write_torch_archive

    folder = checkpoint(tmp_path / "checkpoint-4", 4)
    tag = folder / "global_step4"
    tag.mkdir()
    (folder / "latest").write_text("global_step4")
    write_torch_archive(tag / "mp_rank_00_model_states.pt", {"ds_version": "0.19.8"})
    for rank in (0, 1):
        write_torch_archive(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                            {"optimizer_state_dict": {"zero_stage": 2, "partition_count": 2}})
    with pytest.raises(StepSyncConfigError, match="ds_to_universal --input_folder .*global_step4") as raised:
        stepsync.resume_settings(str(folder), 1, 1, 4, examples=12)
    assert "convert=True" in str(raised.value)
    (tmp_path / "checkpoint-4" / "global_step4_universal").mkdir()  # a universal copy: no refusal, load it
    settings = stepsync.resume_settings(str(folder), 1, 1, 4, examples=12)
    assert settings.load_universal and settings.deepspeed_config({"gradient_accumulation_steps": 4}) == {
        "gradient_accumulation_steps": 8, "checkpoint": {"load_universal": True}}


def test_an_accelerate_loop_resumed_as_the_examples_resume(tmp_path):
    """The examples' arithmetic, on folders accelerator.save_state() writes (the real runs:
    tests/multiprocess/test_accelerate_resume.py)."""
    one = tmp_path / "step_4"
    one.mkdir()
    (one / "random_states_0.pkl").write_bytes(b"")
    settings = stepsync.resume_settings(str(one), 2, 1, 4, examples=12, loop="accelerate")
    assert settings.shift.skipped == {2: 8, 3: 8} and settings.gradient_accumulation_steps == 2
    assert "the examples' arithmetic (4 updates x G=4 micro-batches" in settings.message()
    assert stepsync.resume_settings(str(one), 1, 1, 4, examples=12, loop="accelerate").shift is None
    epoch = tmp_path / "epoch_1"
    epoch.mkdir()
    assert "start the next epoch whole" in stepsync.resume_settings(str(epoch), 2, 1, 4, loop="accelerate").message()
    with pytest.raises(ValueError, match="examples=... .the training set's length"):
        stepsync.resume_settings(str(one), 2, 1, 4, loop="accelerate")
    with pytest.raises(ValueError, match="pass the step_N or epoch_N folder"):
        stepsync.resume_settings(str(tmp_path), 2, 1, 4, examples=12, loop="accelerate")
    with pytest.raises(ValueError, match="Unsupported loop 'lightning'. Possible choices are: 'trainer', 'accelerate'"):
        stepsync.resume_settings(str(one), 2, 1, 4, loop="lightning")
