"""Ray Train (TorchTrainer, CPU workers, Ray's RayTrainReportCallback and prepare_trainer around the Trainer +
DeepSpeed ZeRO-0 + StepSyncCallback): a job saved on 2 workers fails after its 4th checkpoint and Ray restores it on
1 worker. What stepsync says the restore trains twice equals what every worker trained; the settings
stepsync.resume_settings() gives the training function make it land; `stepsync inspect` reads Ray's storage, by step.
Each job runs in its own process, bounded by a timeout that fails rather than hangs."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from harness.cli import stepsync
from harness.runs import child_env
from harness.samples import said, skipped_and_repeated
from harness.stack import STACK, needs_stack
from harness.paths import entry_script

# Ray's train extra is installed on one stack (tests/harness/matrix.py), where it must run: about 2 minutes there.
pytestmark = [needs_stack, pytest.mark.skipif(STACK not in ("", "aligned"), reason="ray[train] is on the aligned stack"),
              pytest.mark.skipif(STACK == "" and importlib.util.find_spec("ray") is None, reason="needs ray[train]")]
SCRIPT = entry_script("ray_runs.py")
STOP_AT = 4  # saved on 2 workers: 6 samples each, G=4, 2 updates per epoch; checkpoint 4 ends epoch 2


def job(out, name, storage, workers, *flags):
    """One Ray job; each worker's record."""
    env = child_env(dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
                         RAY_USAGE_STATS_ENABLED="0"))
    command = [sys.executable, SCRIPT, str(out), name, str(storage), str(workers), "4", "warn", *flags]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the Ray job {name} hung: {exc}")
    records = [out / f"{name}-{rank}.json" for rank in range(workers)]
    assert all(path.exists() for path in records), done.stdout[-3000:] + done.stderr[-3000:]
    return [json.load(open(path)) for path in records]


def truth(saved, resumed):
    return skipped_and_repeated(saved, resumed, STOP_AT, 12, 3)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ray")
    saved = job(out, "saved", out / "storage", 2, str(STOP_AT))
    shutil.copytree(out / "storage", out / "storage-for-settings")  # the same storage, restored twice
    plain = job(out, "plain", out / "storage", 1)
    fixed = job(out, "fixed", out / "storage-for-settings", 1, "--settings")
    return out, saved, plain, fixed


def test_the_saved_job_failed_after_its_fourth_checkpoint(jobs):
    _, saved, _, _ = jobs
    for rank in saved:
        assert rank["world"] == 2 and "node lost after checkpoint 4" in rank["error"]
        assert max(step for _, step, _ in rank["trained"]) == STOP_AT - 1  # its last window made update 4


def test_a_restore_on_one_worker_trains_twice_what_stepsync_says(jobs):
    _, saved, plain, _ = jobs
    (rank,) = plain
    assert rank["world"] == 1 and rank["error"] is None and rank["resumed_from"].endswith("checkpoint")
    assert truth(saved, plain) == said(rank) == ({}, {2: 8})
    assert rank["report"]["resume_shift"]["fixes"] == ["gradient_accumulation_steps=8",
                                                        "per_device_train_batch_size=2"]


def test_the_settings_resume_settings_gives_make_the_restore_land(jobs):
    _, saved, _, fixed = jobs
    (rank,) = fixed
    assert rank["gas"] == 8 and rank["error"] is None
    assert "these settings resume with gradient_accumulation_steps=8 instead" in rank["settings"][-1]
    assert truth(saved, fixed) == said(rank) == ({}, {})


def test_inspect_reads_rays_storage_by_step(jobs):
    out, _, _, _ = jobs
    inspected = json.loads(stepsync("inspect", str(out / "storage-for-settings" / "job"), "--world-size", "1",
                                    "--quick", "--json", env=child_env()).stdout)
    checkpoints = inspected["checkpoints"]
    assert [c["trainer_step"] for c in checkpoints][:STOP_AT] == [1, 2, 3, 4]
    assert all(c["name"].startswith("checkpoint_") and c["ok"] for c in checkpoints)
    last_saved = inspected["resume_on"][STOP_AT - 1]["shift"]
    assert (last_saved["skipped"], last_saved["repeated"]) == ({}, {"2": 8})
