"""Resumes on another number of ranks (torchrun on 127.0.0.1, gloo; ZeRO-0): what stepsync says the Trainer will
skip and train twice equals, epoch by epoch, what the samples each rank trained show (recorded by the Trainer's own
training_step); the fix it names trains every sample once; raise stops every rank before any micro-batch; a rank
left waiting fails the test instead of hanging CI."""
import json
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest

from harness.runs import child_env
from harness.stack import needs_stack

pytestmark = [needs_stack]
SCRIPT = os.path.join(os.path.dirname(__file__), "relayout_runs.py")


def launch(out, name, world, samples, gas, epochs, policy="warn", checkpoint=None):
    """One phase on ``world`` ranks; each rank's record."""
    env = child_env(dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", port,
               SCRIPT, str(out), name, str(samples), str(gas), str(epochs), policy] + ([checkpoint] if checkpoint else [])
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name} hung: {exc}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.load(open(out / f"{name}-{rank}.json")) for rank in range(world)]


def truth(saved, resumed, checkpoint_step, samples, epochs):
    """(skipped, repeated) per 1-based epoch, from the samples every rank trained: the saved run up to its
    checkpoint, then the resumed run."""
    counts = {epoch: Counter() for epoch in range(epochs)}
    for rank in saved:
        for epoch, step_before, indices in rank["trained"]:
            if step_before < checkpoint_step:
                counts[epoch].update(indices)
    for rank in resumed:
        for epoch, _, indices in rank["trained"]:
            counts[epoch].update(indices)
    skipped = {e + 1: samples - len(c) for e, c in counts.items() if samples - len(c)}
    repeated = {e + 1: sum(n - 1 for n in c.values()) for e, c in counts.items() if sum(n - 1 for n in c.values())}
    return skipped, repeated


def said(rank):
    shift = rank["shift"]
    if shift is None:
        return {}, {}
    return ({int(k): v for k, v in shift["skipped"].items()}, {int(k): v for k, v in shift["repeated"].items()})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("relayout")
    return out, {"one": launch(out, "one", 1, 12, 4, 3), "two": launch(out, "two", 2, 10, 3, 3)}


@pytest.mark.parametrize("name, world, gas, base, samples, step, expected", [
    # 12 samples, G=4, saved on 1 rank; on 2 ranks an epoch is 2 updates, not 3.
    ("one-to-two-at-an-epoch-end", 2, 4, "one", 12, 6, ({3: 12}, {})),
    ("one-to-two-inside-an-epoch", 2, 4, "one", 12, 4, ({2: 8}, {})),
    # 10 samples, G=3, saved on 2 ranks; on 1 rank an epoch is 4 updates, not 2.
    ("two-to-one-at-an-epoch-end", 1, 3, "two", 10, 4, ({}, {2: 10})),
    ("two-to-one-inside-an-epoch", 1, 3, "two", 10, 3, ({}, {1: 1, 2: 6})),
    # Controls: the same layout, and the fix stepsync names (the global batch kept).
    ("one-to-one", 1, 4, "one", 12, 4, ({}, {})),
    ("two-to-two", 2, 3, "two", 10, 3, ({}, {})),
    ("one-to-two-with-the-fix", 2, 2, "one", 12, 4, ({}, {})),
    ("two-to-one-with-the-fix", 1, 6, "two", 10, 3, ({}, {})),
])
def test_what_stepsync_says_the_resume_does_is_what_it_trains(saved, name, world, gas, base, samples, step, expected):
    out, runs = saved
    resumed = launch(out, name, world, samples, gas, 3, checkpoint=str(out / base / f"checkpoint-{step}"))
    assert all(rank["error"] is None for rank in resumed)
    assert truth(runs[base], resumed, step, samples, 3) == expected
    assert all(said(rank) == expected for rank in resumed)  # every rank says the same, counted over all ranks
    if expected != ({}, {}):
        report = resumed[0]["report"]
        assert report["resume_shift"]["fixes"] and "resumed on another layout" not in json.dumps(report["notes"])


def test_a_fix_is_named_and_raise_stops_every_rank_before_any_micro_batch(saved):
    out, _ = saved
    stopped = launch(out, "raise", 2, 12, 4, 3, policy="raise", checkpoint=str(out / "one" / "checkpoint-4"))
    for rank in stopped:
        assert rank["error"] == "StepSyncConfigError" and rank["trained"] == []
        assert "resume with gradient_accumulation_steps=2" in rank["error_message"]
