"""`inspect` on DeepSpeed's files, laid out as two ranks and two nodes save them (standard-library archives)."""
import json

import pytest

from harness.stack import write_torch_archive
from stepsync.tools.audit import audit_output_dir


def checkpoint(root, step, ranks, stage, world, latest=True, rng_ranks=None, skip=(), engine_step=None):
    """checkpoint-STEP as ranks ``ranks`` of a ``world``-rank ZeRO-``stage`` run save it (files in ``skip`` left out)."""
    folder = root / f"checkpoint-{step}"
    engine_step = step if engine_step is None else engine_step
    tag = folder / f"global_step{engine_step}"
    tag.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if latest:
        (folder / "latest").write_text(f"global_step{engine_step}")
    for rank in (ranks if rng_ranks is None else rng_ranks):
        write_torch_archive(folder / (f"rng_state_{rank}.pth" if world > 1 else "rng_state.pth"), {})
    content = {"dp_world_size": world, "ds_config": {"zero_optimization": {"stage": stage}}}
    names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks] if stage == 3 else \
        ["mp_rank_00_model_states.pt"]
    names += [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks] if stage else []
    for name in names:
        if name not in skip:
            write_torch_archive(tag / name, content)
    return folder


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_two_ranks_in_one_dir_are_whole(tmp_path, stage):
    checkpoint(tmp_path, 2, [0, 1], stage, 2)
    audit = audit_output_dir(str(tmp_path))
    assert audit.ok and audit.safe.name == "checkpoint-2"


@pytest.mark.parametrize("stage, name", [(2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                         (3, "zero_pp_rank_1_mp_rank_00_model_states.pt"),
                                         (3, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                         (0, "mp_rank_00_model_states.pt")])
@pytest.mark.parametrize("rng_files", [True, False])
def test_a_missing_rank_file_is_named(tmp_path, stage, name, rng_files):
    """The ranks a resume needs come from the Trainer's RNG files, else from the world size in the pickle."""
    checkpoint(tmp_path, 2, [0, 1], stage, 2, rng_ranks=None if rng_files else [], skip=(name,))
    item = audit_output_dir(str(tmp_path)).checkpoints[0]
    assert [p for p in item.problems if name in p and "is missing" in p], item.problems
    assert audit_output_dir(str(tmp_path)).safe is None


def test_a_nodes_own_copy_is_recognised_and_its_drift_checked(tmp_path):
    # Node 1 of two (save_on_each_node=True): its own model states and rank 1's optimizer states, no 'latest'.
    checkpoint(tmp_path, 4, [1], 2, 2, latest=False, engine_step=3)
    item = audit_output_dir(str(tmp_path)).checkpoints[0]
    assert item.node_local and item.deepspeed_step == 3 and item.drift == 1
    assert len(item.problems) == 1 and "Copy node 0's checkpoint-4/latest here (it says global_step3)" in item.problems[0]
    assert not item.ok


def test_a_save_that_stopped_before_latest_is_not_a_nodes_copy(tmp_path):
    checkpoint(tmp_path, 2, [0, 1], 2, 2, latest=False)
    item = audit_output_dir(str(tmp_path)).checkpoints[0]
    assert not item.node_local and "DeepSpeed's save did not finish" in item.problems[0]
    assert item.drift == 0


def test_a_renamed_folder_is_said_renamed_not_drift(tmp_path):
    """checkpoint-9 holding a run's step 4 (trainer_state.json and DeepSpeed's tag both say 4): no drift, a name."""
    folder = checkpoint(tmp_path, 4, [0], 0, 1)
    folder.rename(tmp_path / "checkpoint-9")
    item = audit_output_dir(str(tmp_path)).checkpoints[0]
    assert item.drift == 0 and item.counted == 4
    (said,) = item.mismatches
    assert "is named for step 9 but its trainer_state.json says global_step 4, which a resume from it carries" in said
    assert "the folder was renamed or copied" in said
    assert "7405" not in said and "realign" not in said


def test_the_7405_pattern_is_still_drift(tmp_path):
    checkpoint(tmp_path, 800, [0], 0, 1, engine_step=799)
    item = audit_output_dir(str(tmp_path)).checkpoints[0]
    assert item.drift == 1 and "the folder is named by the Trainer's count, the tag by the engine's" in item.mismatches[0]


def test_an_output_dir_without_deepspeed_is_not_said_to_inherit_drift(tmp_path):
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    write_torch_archive(folder / "rng_state.pth", {})
    audit = audit_output_dir(str(tmp_path))
    assert audit.ok and audit.checkpoints[0].drift is None
    assert audit.verdict() == "safe to resume from: checkpoint-3 (no DeepSpeed files: no engine count to compare)"


@pytest.mark.reliability("bad_input")
def test_inspect_framework_refuses_the_folders_another_framework_saved(tmp_path):
    """`inspect --framework` takes its choices from the framework descriptors: the Trainer's and accelerate's
    folders are read, each refused under the other's name, and Lightning's and Fabric's saves (neither) named."""
    from harness.cli import stepsync

    checkpoint(tmp_path / "trainer", 2, [0], 0, 1)
    loop = tmp_path / "loop" / "step_3"
    loop.mkdir(parents=True)
    (loop / "random_states_0.pkl").write_bytes(b"")
    said = {}
    for folder in ("trainer", "loop"):
        for framework in ("trainer", "accelerate", "lightning", "fabric"):
            proc = stepsync("inspect", str(tmp_path / folder), "--framework", framework, "--quick")
            said[folder, framework] = (proc.returncode, proc.stderr.strip().splitlines()[-1] if proc.stderr else "")
    assert said["trainer", "trainer"][0] == 0
    assert said["trainer", "accelerate"] == (2, f"stepsync: error: checkpoint-2 in {str(tmp_path / 'trainer')!r} "
                                                "were saved by the Trainer, not your loop: pass --framework trainer "
                                                "(or leave --framework out)")
    assert said["loop", "trainer"][0] == 2 and "saved by your loop" in said["loop", "trainer"][1]
    assert "--framework accelerate" in said["loop", "trainer"][1]
    assert said["loop", "accelerate"][0] in (0, 1)  # read: its audit says what the folder lacks
    for folder in ("trainer", "loop"):
        for framework in ("lightning", "fabric"):
            code, line = said[folder, framework]
            assert code == 2 and "reads the checkpoints of --framework trainer, accelerate and deepspeed" in line, line


def test_a_missing_latest_names_its_repair_and_the_earliest_checkpoint_is_not_sent_to_an_earlier_one(tmp_path):
    checkpoint(tmp_path, 2, [0, 1], 2, 2, latest=False)
    checkpoint(tmp_path, 4, [0, 1], 2, 2, latest=False)
    first, second = audit_output_dir(str(tmp_path)).checkpoints
    assert "write global_step4 into checkpoint-4/latest, else resume from an earlier checkpoint" in second.problems[0]
    assert "write global_step2 into checkpoint-2/latest, else there is no earlier checkpoint: repair this one, or " \
           "train from the start" in first.problems[0]
    assert not any("earlier checkpoint" in p and "no earlier" not in p for p in first.problems)


def test_inspect_on_another_number_of_ranks_names_the_checkpoint_that_resumes_there(tmp_path):
    """A ZeRO-2 checkpoint saved on one rank: whole, so the verdict as saved calls it safe; on two ranks DeepSpeed
    refuses its partitioned optimizer states, and the verdict for two ranks says no checkpoint resumes there."""
    from harness.cli import stepsync

    checkpoint(tmp_path, 2, [0], 2, 1)
    done = stepsync("inspect", str(tmp_path), "--world-size", "2", "--quick", "--json")
    said = json.loads(done.stdout)
    assert said["safe_to_resume"] == "checkpoint-2" and said["safe_to_resume_on_world_size"] is None
    assert done.returncode == 1 and not said["resume_on"][0]["works"]
    done = stepsync("inspect", str(tmp_path), "--world-size", "1", "--quick", "--json")
    assert json.loads(done.stdout)["safe_to_resume_on_world_size"] == "checkpoint-2"
    text = stepsync("inspect", str(tmp_path), "--world-size", "2", "--quick").stdout
    assert "on 2 rank(s): no checkpoint resumes as it stands" in " ".join(text.split())
