"""The command line against real runs: `check` forecasts what the real Trainer + DeepSpeed do, `inspect`
audits the checkpoint folders they wrote, and corrupted copies of them."""
import json
import os
import shutil

import pytest

from harness.stack import DRIFTS, needs_stack
from harness.cli import cut_lines, stepsync
from harness.runs import run

pytestmark = [needs_stack, pytest.mark.integration]


@pytest.mark.parametrize("n, g, epochs, policy", [(3, 2, 2, "warn"), (7, 3, 2, "warn"), (5, 4, 3, "warn"),
                                                  (5, 2, 3, "sync"), (5, 2, 3, "realign"), (5, 2, 3, "drop_last")])
def test_check_forecasts_the_real_counts(tmp_path, n, g, epochs, policy):
    result = run(tmp_path, n, g, epochs, policy=policy)
    proc = stepsync("check", "--samples", str(n), "--gas", str(g), "--epochs", str(epochs), "--policy", policy,
                    "--json")
    data = json.loads(proc.stdout)
    assert [(e["trainer_steps"], e["engine_steps"]) for e in data["epochs"]] == result.recording.epoch_ends
    assert (data["trainer_steps"], data["engine_steps"]) == (result.trainer.state.global_step,
                                                              result.engine.global_steps)
    assert proc.returncode == (0 if data["sound"] else 1)
    # realign (where it acts) ends at the engine's last update: the 15th micro-batch is never trained (the truth), as
    # drop_last's dropped ones are, by design and said as such.
    untrained = n * epochs - len(result.recording.engine_steps) - data["dropped_micro_batches"]
    assert data["sound"] == (data["aligned"] and not untrained) and (untrained == 1) == (policy == "realign" and DRIFTS)


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    """Output folders of real runs, N=3, G=2, 2 epochs, a checkpoint at every update."""
    base = tmp_path_factory.mktemp("runs")
    for name, policy in (("plain", None), ("sync", "sync"), ("drop_last", "drop_last")):
        run(base / name, 3, 2, 2, policy=policy, save_strategy="steps", save_steps=1)
    return base


@pytest.fixture(scope="module")
def realigned(tmp_path_factory):
    """A realign run, N=5, G=2, 3 epochs, a checkpoint at every update, with its independent recording."""
    base = tmp_path_factory.mktemp("realigned")
    return base, run(base, 5, 2, 3, policy="realign", save_strategy="steps", save_steps=1)


def inspect(path):
    proc = stepsync("inspect", str(path), "--json")
    assert "Traceback" not in proc.stderr
    return proc.returncode, json.loads(proc.stdout) if proc.stdout else None


def test_inspect_a_run_without_stepsync(run_dirs):
    code, data = inspect(run_dirs / "plain")
    rows = {c["name"]: (c["trainer_step"], c["deepspeed_tag"]) for c in data["checkpoints"]}
    if DRIFTS:  # the DeepSpeed 7405 pattern: checkpoint-2 holds global_step1, checkpoint-4 global_step3
        assert rows == {"checkpoint-1": (1, "global_step1"), "checkpoint-2": (2, "global_step1"),
                        "checkpoint-3": (3, "global_step2"), "checkpoint-4": (4, "global_step3")}
        assert code == 1 and data["mismatches"] == 3 and data["safe_to_resume"] == "checkpoint-1"
        bad = next(c for c in data["checkpoints"] if c["name"] == "checkpoint-4")
        assert bad["drift"] == 1 and "holds DeepSpeed's global_step3" in bad["mismatches"][0]
    else:
        assert all(step == int(tag[len("global_step"):]) for step, tag in rows.values())
        assert code == 0 and data["safe_to_resume"] == "checkpoint-4"


@pytest.mark.parametrize("name, last", [("sync", "checkpoint-4"), ("drop_last", "checkpoint-2")])
def test_inspect_a_run_with_a_remedy(run_dirs, name, last):
    code, data = inspect(run_dirs / name)
    assert code == 0 and data["ok"] and data["safe_to_resume"] == last
    assert all(c["stepsync_record"]["trainer_steps"] == c["trainer_step"] for c in data["checkpoints"])


def test_inspect_of_a_drifting_run_says_each_explanation_once_and_breaks_no_word(run_dirs):
    """The table view in a pipe: every name and path whole, and the drift's explanation once for all the checkpoints
    that have it (it was printed again for each one)."""
    proc = stepsync("inspect", str(run_dirs / "plain"), columns=80)
    assert cut_lines(proc.stdout) == [] and str(run_dirs / "plain") in proc.stdout.split()
    flat = " ".join(proc.stdout.split())
    assert flat.count("DeepSpeed's issue #7405") == (1 if DRIFTS else 0)
    if DRIFTS:
        assert "checkpoint-2, checkpoint-3, checkpoint-4 hold DeepSpeed tags other than the Trainer's count" in flat
    # saved without stepsync: no record to show, and no open window known
    assert "trainer_state" in flat and "Trainer/engine" not in flat and "open window" not in flat


def test_inspect_of_a_realign_run_says_what_differs_on_purpose_and_what_a_save_lost(realigned):
    """realign writes into trainer_state.json the step that lands the Trainer's resume (not the folder's number):
    said once, as meant. A checkpoint saved inside the engine's window loses its micro-batches on resume: not safe,
    with the number the truth gives (micro-batches since the engine's last update at each save)."""
    out, result = realigned
    code, data = inspect(out)
    recording = result.recording
    lost = [at - max([e for e in recording.engine_updates_at if e <= at] or [0]) for at in recording.saved_after]
    assert [c["unapplied_at_save"] for c in data["checkpoints"]] == lost
    assert [c["ok"] for c in data["checkpoints"]] == [n == 0 for n in lost]
    assert (code == 1) == any(lost) == DRIFTS
    adjusted = [c["name"] for c in data["checkpoints"] if c["trainer_state_step"] != c["trainer_step"]]
    assert [c["name"] for c in data["checkpoints"] if c["adjusted_by"] == "realign"] == adjusted
    flat = " ".join(stepsync("inspect", str(out), columns=80).stdout.split())
    assert flat.count("differs from the folder's number on purpose") == (1 if adjusted else 0)
    assert flat.count("DeepSpeed saves neither their gradients nor its micro-step counter") == (1 if any(lost) else 0)


def corrupt(run_dirs, tmp_path, how):
    copy = tmp_path / "copy"
    shutil.copytree(run_dirs / "sync", copy)
    target = copy / "checkpoint-4"
    if how == "no latest":
        (target / "latest").unlink()
    elif how == "bad trainer_state":
        (target / "trainer_state.json").write_text("{truncated")
    elif how == "empty folder":
        shutil.rmtree(target)
        target.mkdir()
    elif how == "a file":
        shutil.rmtree(target)
        target.write_text("")
    elif how == "latest names a missing folder":
        (target / "latest").write_text("global_step9")
    elif how == "bad record":
        state = json.loads((target / "trainer_state.json").read_text())
        state["stateful_callbacks"]["StepSyncCallback"]["attributes"]["saved_record"]["trainer_steps"] = "x"
        (target / "trainer_state.json").write_text(json.dumps(state))
    return copy


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("how, message", [
    ("no latest", "but no 'latest' file: DeepSpeed's save did not finish"),
    ("bad trainer_state", "is not valid JSON"),
    ("empty folder", "is empty: the save did not complete"),
    ("a file", "is not a directory"),
    ("latest names a missing folder", "names global_step9 but there is no such folder"),
    ("bad record", "stepsync's record is unreadable"),
])
def test_inspect_a_corrupted_copy(run_dirs, tmp_path, how, message):
    code, data = inspect(corrupt(run_dirs, tmp_path, how))
    broken = next(c for c in data["checkpoints"] if c["name"] == "checkpoint-4")
    assert code == 1 and not broken["ok"]
    assert any(message in text for text in broken["problems"] + broken["mismatches"]), broken
    assert data["safe_to_resume"] == "checkpoint-3"  # the newest whole one
    proc = stepsync("inspect", str(tmp_path / "copy"))  # the table view says the same, without a traceback
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "checkpoint-3" in proc.stdout


def test_demo_compare_shows_the_drift_and_the_fix():
    import subprocess
    import sys

    from harness.runs import child_env

    proc = subprocess.run([sys.executable, "-m", "stepsync", "demo", "--compare"], env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    flat = " ".join(out.split())
    # The problem first, with its verdict, then the fix, then one line that compares them.
    assert out.index("policy 'warn' (only watches") < out.index("policy 'sync' (the remedy)")
    if DRIFTS:
        assert "affected: the Trainer counts 4 updates, the engine makes 3" in flat
        assert "policy 'warn': Trainer 4, engine 3 (drift +1); policy 'sync': Trainer 4, engine 4 (drift +0)" in flat
    else:  # an aligned stack says so, and how to see the drift
        assert "This stack does not drift" in flat and "accelerate < 1.8" in flat
        assert "policy 'warn': Trainer 4, engine 4 (drift +0)" in flat
    # A pipe gets 80 columns: nothing cut.
    assert [line for line in out.splitlines() if "…" in line or len(line) > 80] == []
    # Its checkpoints are there for inspect, which names the drift the first run's carry.
    import re
    import tempfile

    saved = re.search(r"stepsync inspect (\S+) says", flat).group(1)
    # Each demo saves under a folder of its own: a second one never overwrites what the first told to inspect.
    assert saved.startswith(os.path.join(tempfile.gettempdir(), "stepsync-demo-")) and saved.endswith("warn")
    inspected = subprocess.run([sys.executable, "-m", "stepsync", "inspect", saved, "--quick", "--json"],
                               env=child_env(), capture_output=True, text=True, timeout=120)
    steps = [c["trainer_step"] for c in json.loads(inspected.stdout)["checkpoints"]]
    assert steps == [2, 4] and inspected.returncode == (1 if DRIFTS else 0)
