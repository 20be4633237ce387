"""Two ranks with torchrun, ZeRO-1 in bf16 with an fp32 gradient accumulation, G=4 (tests/entry/bf16_ranks.py): DeepSpeed
0.18.5 - 0.18.9 add each window's last micro-batch after the average across ranks (scripts/probe_bf16_ranks.py,
DeepSpeed's engine._backward_epilogue before its PR 7985). Each sample's share is read from its own weight (the
truth): in the part of the update a rank holds, its own last micro-batch weighs 1/G, twice its share on two ranks,
and the other rank's last micro-batch 0. stepsync must name the fault on every rank before the first micro-batch
exactly where the shares are wrong, in an accelerate loop and in the Trainer, stop every rank there under raise and
sync (bf16.immediate_grad_update is read only when the engine is built), and say nothing where it is avoided."""
from importlib.metadata import version

import pytest

from harness.paths import entry_script
from stepsync.core.versions import parse_version
from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration, pytest.mark.twoproc]
G, WORLD = 4, 2
RUNS = ("loop", "trainer")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from harness.runs import two_ranks

    return two_ranks(entry_script("bf16_ranks.py"), tmp_path_factory.mktemp("bf16_ranks"))[:2]


def faulty(immediate=False) -> bool:
    from stepsync.core.weights import Accumulation, weight_faults

    return bool(weight_faults(version("deepspeed"), 1, False, "bf16", G, "accelerate", False, version("accelerate"),
                              WORLD, Accumulation(True, immediate)))


def refused(ranks, run) -> bool:
    """accelerate <= 1.7 steps the engine inside its no_sync(): DeepSpeed refuses at the first micro-batch, loudly
    (as in test_no_sync_on_two_ranks.py)."""
    return ranks[0][f"{run}-fp32-None"]["error"] == "AssertionError"


def lasts(ranks, case):
    """The samples each rank trained last in its window."""
    return {rank[case]["trained"][-1] for rank in ranks}


@pytest.mark.parametrize("run", RUNS)
def test_the_truth_and_what_stepsync_says_on_every_rank(ranks, run):
    unwatched, warned = ranks[0][f"{run}-fp32-None"], ranks[0][f"{run}-fp32-warn"]
    if refused(ranks, run):
        assert run == "loop" and parse_version(version("accelerate")) < parse_version("1.8.0") and warned["error"] == "AssertionError"
        assert warned["weight_faults"] == ([] if not faulty() else warned["weight_faults"][:1])
        return
    for case in (f"{run}-fp32-None", f"{run}-fp32-warn"):
        assert ranks[0][case]["shares"] == ranks[1][case]["shares"]  # the ranks gathered the same weights
        assert sorted(ranks[0][case]["trained"] + ranks[1][case]["trained"]) == list(range(WORLD * G))
    assert ranks[0][f"{run}-fp32-warn"]["weight_faults"] == ranks[1][f"{run}-fp32-warn"]["weight_faults"]
    assert unwatched["error"] is None and warned["error"] is None
    if not faulty():
        assert all(abs(share - 1) < 2e-2 for share in unwatched["shares"]) and warned["weight_faults"] == []
        return
    last = lasts(ranks, f"{run}-fp32-None")
    for sample, share in enumerate(unwatched["shares"]):
        if sample in last:  # its own rank's part: 1/G; the other rank's: 0
            assert min(abs(share - WORLD), abs(share)) < 2e-2, (sample, share)
        else:
            assert abs(share - 1) < 2e-2, (sample, share)
    assert any(abs(unwatched["shares"][sample] - 1) > 0.5 for sample in last)
    assert len(warned["weight_faults"]) == 1
    said = warned["weight_faults"][0]
    assert "micro-batch(es) [4] of every window of 4" in said and '"immediate_grad_update": true' in said
    assert "0.19.0" in said


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("policy", ["raise", "sync"])
def test_raise_and_sync_stop_every_rank_before_the_first_micro_batch(ranks, run, policy):
    for rank in ranks:
        stopped = rank[f"{run}-fp32-{policy}"]
        if not faulty() and refused(ranks, run):
            assert stopped["error"] == "AssertionError"  # stepsync stops nothing more
            continue
        if not faulty():
            assert stopped["error"] is None and all(abs(share - 1) < 2e-2 for share in stopped["shares"])
            continue
        assert stopped["error"] == "StepSyncConfigError" and stopped["shares"] == [0.0] * WORLD * G
        assert stopped["trained"] == []


@pytest.mark.parametrize("run", RUNS)
def test_immediate_grad_update_trains_right_and_nothing_is_said(ranks, run):
    assert not faulty(immediate=True)
    for rank in ranks:
        avoided = rank[f"{run}-immediate-warn"]
        if refused(ranks, run):
            assert avoided["error"] == "AssertionError" and avoided["weight_faults"] == []
            continue
        assert avoided["error"] is None and avoided["weight_faults"] == []
        assert all(abs(share - 1) < 2e-2 for share in avoided["shares"]), avoided["shares"]


def test_verify_on_two_ranks_measures_what_the_runs_trained(ranks, tmp_path):
    """`stepsync verify --world-size 2` on the runs' DeepSpeed config: each rank's micro-batch shares equal the
    accelerate loop's (rank r trains samples r*G .. r*G+G-1 in both), and the exit code says whether they are right."""
    import json
    import subprocess
    import sys

    config = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "stepsync", "verify", "--deepspeed", str(path), "--gas", str(G),
                           "--world-size", str(WORLD), "--json"], capture_output=True, text=True, timeout=300)
    verdict = json.loads(done.stdout)
    assert verdict["world_size"] == WORLD and done.stderr == ""
    if refused(ranks, "loop"):  # the loop never trained: the truth is the Trainer's, read per sample
        truth = ranks[0]["trainer-fp32-None"]["shares"]
        assert verdict["wrong_micro_batches"] == ([G] if faulty() else [])
        assert sorted(round(w * G, 1) for w in verdict["weights"]) == sorted(round(s, 1) for s in truth)
    else:
        truth = ranks[0]["loop-fp32-None"]["shares"]
        assert [w * G for w in verdict["weights"]] == pytest.approx(truth, abs=2e-2)
    assert verdict["wrong_micro_batches"] == ([G] if faulty() else [])
    assert (done.returncode == 1) == (faulty() or not verdict["right"])
