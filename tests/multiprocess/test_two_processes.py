"""Two ranks with torchrun: same decisions on every rank at the same step, output once, no hang."""
import json
import os
import socket
import subprocess
import sys

import pytest

from harness.stack import DRIFTS, needs_stack

pytestmark = [
    needs_stack, pytest.mark.integration, pytest.mark.twoproc,
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    from harness.runs import child_env

    env = child_env(dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1"))
    with socket.socket() as sock:  # torchrun's --master_port 0 hangs the ranks: pick a free port
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    script = os.path.join(os.path.dirname(__file__), "twoproc_runs.py")
    try:  # a rank left waiting in a collective fails the test instead of hanging CI
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", port, script, str(out)],
                              env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"two-process run hung: {exc}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(out / f"rank-{r}.json")) for r in (0, 1)]
    return ranks, proc.stdout + proc.stderr


def test_every_rank_sees_and_decides_the_same(two_ranks):
    ranks, _ = two_ranks
    for case in ranks[0]:
        a, b = ranks[0][case], ranks[1][case]
        assert (a["trainer_steps"], a["engine_steps"], a["error"]) == (b["trainer_steps"], b["engine_steps"], b["error"])
        assert a["report"]["events"] == b["report"]["events"]
        assert a["engine_updates_at"] == b["engine_updates_at"]


@pytest.mark.parametrize("case", ["warn-0", "warn-2"])
def test_warn_counts(two_ranks, case):
    result = two_ranks[0][0][case]
    # 6 micro-batches per rank, G=4, 2 epochs: the Trainer counts 2 per epoch, the engine 12 // 4.
    assert (result["trainer_steps"], result["engine_steps"]) == ((4, 3) if DRIFTS else (4, 4))
    assert [(r["trainer_steps"], r["engine_steps"]) for r in result["forecast"]["epochs"]] == \
        [tuple(x) for x in result["epoch_ends"]]


@pytest.mark.parametrize("case", ["sync-0", "sync-2", "realign-0", "drop_last-0"])
def test_remedies_agree(two_ranks, case):
    result = two_ranks[0][0][case]
    expected = {"sync": 4, "realign": 3 if DRIFTS else 4, "drop_last": 2}[case.split("-")[0]]
    assert result["error"] is None
    assert (result["trainer_steps"], result["engine_steps"]) == (expected, expected)
    if case.startswith("sync"):
        assert result["engine_updates_at"] == result["trainer_updates_at"]


def test_raise_stops_every_rank(two_ranks):
    ranks, _ = two_ranks
    for rank in ranks:
        result = rank["raise-0"]
        assert result["error"] == ("StepDriftError" if DRIFTS else None)
        assert result["trainer_steps"] == (2 if DRIFTS else 4)


def test_output_appears_once(two_ranks):
    _, output = two_ranks
    assert output.count("stepsync summary") == (6 if DRIFTS else 7)  # a raised run ends before its summary
    assert output.count("step drift +1 at epoch 1, micro-batch 6") == (3 if DRIFTS else 0)
