"""Two nodes on one machine (two torchrun launches on 127.0.0.1, static rendezvous, gloo), and one node of two
processes: every rank takes the same decisions, faults on one rank included; reports equal an independent
record; checkpoints and messages land where they should."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from harness.stack import DRIFTS, needs_stack
from harness.paths import entry_script

pytestmark = [needs_stack, pytest.mark.integration, pytest.mark.twoproc]

SCRIPT = entry_script("twonode_runs.py")
TWO_NODE_CASES = ["warn-shared", "sync-shared-each-node", "sync-node-dirs", "realign-shared-each-node",
                  "raise-shared", "realign-fault-node1", "drop_last-fault-node1"]
ONE_NODE_CASES = ["realign-fault-rank0", "drop_last-fault-rank0"]
RESUME_CASES = ["resume-apart"]
TIMEOUT = 540  # a rank left waiting in a collective fails the test instead of hanging CI


def free_port() -> str:
    with socket.socket() as sock:  # torchrun's --master_port 0 hangs the ranks: pick a free port
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def launch(out, cases, nodes):
    """Run ``cases`` on ``nodes`` torchrun launches of 2 // nodes processes each; each node's (rc, stdout, stderr)."""
    from harness.runs import child_env

    env = child_env(dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1"))
    port = free_port()
    procs = []
    for node in range(nodes):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node",
                   str(2 // nodes), "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
                   SCRIPT, str(out), *cases]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"a launch of {cases} hung past {TIMEOUT} s")
        results.append((proc.returncode, stdout, stderr))
    return results


def by_case(text):
    """A node's output split at the "=== case NAME" markers."""
    parts = re.split(r"^=== case (\S+)$", text, flags=re.M)
    found = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        found[name] = found.get(name, "") + body
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("nodes")
    nodes = launch(out, TWO_NODE_CASES + RESUME_CASES, 2)
    one_node = launch(out, ONE_NODE_CASES, 1)
    for rc, stdout, stderr in nodes + one_node:
        assert rc == 0, stdout[-3000:] + stderr[-5000:]
    ranks = {case: [json.load(open(out / case / f"rank-{r}.json")) for r in (0, 1)]
             for case in TWO_NODE_CASES + ONE_NODE_CASES + RESUME_CASES}
    screens = [{case: by_case(stdout).get(case, "") + by_case(stderr).get(case, "") for case in TWO_NODE_CASES}
               for _, stdout, stderr in nodes]
    return ranks, screens


def expected(case):
    """(Trainer, engine) at the end, and max_steps: 3 micro-batches per rank, G=2 (independent of the forecast)."""
    policy, epochs = case.split("-")[0], (3 if "realign" in case or "drop_last" in case else 2)
    trainer = epochs * 2
    engine = (epochs * 3) // 2 if DRIFTS else trainer
    return {"warn": (trainer, engine, trainer), "sync": (trainer, trainer, trainer),
            "realign": (engine, engine, engine), "drop_last": (epochs, epochs, epochs),
            "raise": (0, 0, trainer) if DRIFTS else (trainer, trainer, trainer)}[policy]  # stopped as forecast


@pytest.mark.parametrize("case", TWO_NODE_CASES + ONE_NODE_CASES)
def test_every_rank_takes_the_same_decisions(runs, case):
    a, b = runs[0][case]
    for key in ("trainer_steps", "engine_steps", "max_steps", "trainer_updates_at", "engine_updates_at",
                "epoch_ends", "error"):
        assert a[key] == b[key], key
    assert (a["trainer_steps"], a["engine_steps"], a["max_steps"]) == expected(case)
    assert a["error"] == ("StepDriftError" if case.startswith("raise") and DRIFTS else None)


@pytest.mark.parametrize("case", [c for c in TWO_NODE_CASES + ONE_NODE_CASES if not c.startswith("raise")])
def test_each_report_equals_the_independent_record(runs, case):
    for rank in runs[0][case]:
        report = rank["report"]
        assert report["active"], report
        assert (report["trainer_steps"], report["engine_steps"]) == (rank["trainer_steps"], rank["engine_steps"])
        assert [(e["trainer_steps"], e["engine_steps"]) for e in report["epochs"]] == \
            [tuple(x) for x in rank["epoch_ends"]]
        # Every change of the drift the recorder saw is one event, at the same check.
        changes, drift = [], 0
        for where, trainer, engine in rank["checks"]:
            if trainer - engine != drift:
                changes.append((where, trainer, engine))
                drift = trainer - engine
        assert [(e["where"], e["trainer_steps"], e["engine_steps"]) for e in report["events"]] == changes


@pytest.mark.parametrize("case", [c for c in TWO_NODE_CASES + ONE_NODE_CASES if not c.startswith("raise")])
def test_every_checkpoint_holds_what_the_run_saved(runs, case):
    for rank in runs[0][case]:
        audit = rank["audit"]
        if not rank["should_save"]:
            continue
        saves = {trainer: engine for trainer, engine in rank["saves"]}
        # the micro-batches in the engine's open window at each save (since its last update): a resume loses them
        lost = {trainer: at - max([e for e in rank["engine_updates_at"] if e <= at] or [0])
                for (trainer, _), at in zip(rank["saves"], rank["saved_after"])}
        checkpoints = {c["trainer_step"]: c for c in audit["checkpoints"]}
        assert sorted(checkpoints) == sorted(saves)
        for step, item in checkpoints.items():
            assert item["deepspeed_step"] == saves[step] and item["unapplied_at_save"] == lost[step]
            assert bool(item["mismatches"]) == (step != saves[step] or lost[step] > 0)
            node_local = "node-dirs" in case or "fault-node1" in case
            assert item["node_local"] == (node_local and rank["output_dir"].endswith("node-1"))
            problems = [p for p in item["problems"] if "is a node's own copy" not in p]
            assert problems == [], problems
            record = item["stepsync_record"]
            assert record is not None and record["engine_steps"] == saves[step]


@pytest.mark.parametrize("case", ["realign-fault-node1", "drop_last-fault-node1"])
def test_a_fault_on_one_node_is_said_there_once(runs, case):
    _, screens = runs
    line = "stepsync: could not write stepsync's record into"
    assert screens[0][case].count(line) == 0
    assert screens[1][case].count(line) == 1
    assert "checkpoint-2" in screens[1][case] and "switched itself off" not in screens[1][case]


@pytest.mark.parametrize("case", [c for c in TWO_NODE_CASES if not c.startswith("raise")])
def test_messages_go_where_the_trainers_logs_go(runs, case):
    _, screens = runs
    each_node = case != "warn-shared"  # that case sets log_on_each_node=False
    assert screens[0][case].count("stepsync summary") == 1
    assert screens[1][case].count("stepsync summary") == (1 if each_node else 0)
    if not each_node:
        assert "stepsync" not in screens[1][case].replace("stepsync/", "")


def test_ranks_that_resume_from_checkpoints_that_differ_stop_together_before_any_micro_batch(runs):
    """Node 1's record write failed at checkpoint-2, so its trainer_state.json holds another count than node 0's:
    the Trainers would skip different micro-batches. Both ranks stop before the first one, with the fix."""
    a, b = runs[0]["resume-apart"]
    if not DRIFTS:  # nothing moved the count off the data position: both checkpoints say the same, both resume
        assert a["error"] is b["error"] is None and a["engine_updates_at"] == b["engine_updates_at"] != []
        return
    for rank in (a, b):
        assert rank["error"] == "StepSyncConfigError"
        assert "the ranks resumed at different points (global_step 2..3" in rank["error_message"]
        assert "copy node 0's" in rank["error_message"]
        assert rank["engine_updates_at"] == [] and rank["trainer_updates_at"] == []
