"""stepsync/core/lightning_versions.py equals what the probes measured (probes/lightning.json), and the forecast
reproduces every probed Lightning run: both counts at every epoch end, each update's micro-batch weight, and the
micro-batches Lightning's zero_grad cleared before the engine applied them."""
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.paths import REPO
from stepsync.core.forecast import forecast
from stepsync.core.lightning_versions import MEASURED_LIGHTNING, LightningStack, lightning_behaviour_of
from stepsync.core.plan import RunPlan
from stepsync.core.errors import UnsupportedVersion

with open(os.path.join(REPO, "probes", "lightning.json")) as handle:
    PROBED = json.load(handle)["stacks"]
CASES = [(version, stack["deepspeed"], case) for version, stack in PROBED.items() for case in stack["cases"]]


def test_measured_means_the_probe_ran_there():
    assert MEASURED_LIGHTNING == tuple(PROBED)


@pytest.mark.parametrize("version, deepspeed, case", CASES,
                         ids=[f"{v}-N{c['n']}G{c['g']}E{c['epochs']}z{c['stage']}" for v, _, c in CASES])
def test_the_forecast_reproduces_the_probe(version, deepspeed, case):
    n, g, epochs = case["n"], case["g"], case["epochs"]
    predicted = forecast(RunPlan(n, g, epochs, zero_stage=case["stage"]),
                         lightning_behaviour_of(LightningStack(version, deepspeed)))
    assert (predicted.trainer_steps, predicted.engine_steps) == (case["lightning_steps"], case["engine_steps"])
    ends = [row[2:4] for row in case["batches"] if row[1] == n - 1]  # (Lightning, engine) after each epoch's last batch
    assert [[r.trainer_steps, r.engine_steps] for r in predicted.epochs] == ends
    weights = [w for update in case["updates"] for w in update.values()]
    assert all(abs(w / predicted.micro_batch_weight - round(w / predicted.micro_batch_weight)) < 1e-4 for w in weights)
    applied = round(sum(weights) / predicted.micro_batch_weight)
    assert n * epochs - predicted.unapplied_micro_batches - applied == predicted.wiped_micro_batches
    scheduler = case["batches"][-1][4]
    assert scheduler == case["lightning_steps"]  # Lightning steps the scheduler on its own count


with open(os.path.join(REPO, "probes", "lightning_alone.json")) as handle:
    ALONE = [(version, case) for version, stack in json.load(handle)["stacks"].items() for case in stack["cases"]]


@pytest.mark.parametrize("version, case", ALONE, ids=[f"{v}-N{c['n']}G{c['g']}E{c['epochs']}" for v, c in ALONE])
def test_without_deepspeed_the_forecast_reproduces_the_probe(version, case):
    """Lightning's own accumulation: its count, the optimizer's steps at every epoch's end, and each micro-batch's
    weight (1/G, a partial window's too), as the probe measured them."""
    from stepsync.core.lightning_versions import lightning_alone

    n, g, epochs = case["n"], case["g"], case["epochs"]
    predicted = forecast(RunPlan(n, g, epochs), lightning_alone(lightning_behaviour_of(LightningStack(version))))
    assert (predicted.trainer_steps, predicted.engine_steps) == (case["lightning_steps"], case["engine_steps"])
    ends = [row[2:4] for row in case["batches"] if row[1] == n - 1]
    assert [[r.trainer_steps, r.engine_steps] for r in predicted.epochs] == ends
    assert {round(w, 6) for update in case["updates"] for w in update.values()} == {round(1 / g, 6)}
    assert predicted.micro_batch_weight == 1 / g and predicted.unapplied_micro_batches == 0
    assert sum(len(update) for update in case["updates"]) == n * epochs  # every micro-batch in an update
    assert case["batches"][-1][4] == case["lightning_steps"]


def test_below_the_first_covered_release_is_refused_with_the_fix():
    with pytest.raises(UnsupportedVersion, match="upgrade lightning"):
        lightning_behaviour_of(LightningStack("1.9.5"))


def test_a_release_not_probed_says_its_counting_is_inferred():
    assert "inferred" in lightning_behaviour_of(LightningStack("2.5.6")).caveats[0]


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 23), g=st.integers(1, 7), epochs=st.integers(1, 4), stage=st.sampled_from([0, 1, 2, 3]),
       policy=st.sampled_from(["warn", "raise", "sync", "drop_last"]), max_steps=st.sampled_from([-1, 1, 3, 7]))
def test_the_forecast_equals_a_brute_force_lightning_loop(n, g, epochs, stage, policy, max_steps):
    from harness.lightning_simulation import simulate_lightning

    if policy in ("drop_last", "sync") and n < g:
        return  # refused at the start: every micro-batch would be dropped
    predicted = forecast(RunPlan(n, g, epochs, max_steps=max_steps, zero_stage=stage),
                         lightning_behaviour_of(LightningStack("2.6.6", "0.19.8")), policy)
    truth = simulate_lightning(n, g, epochs, stage, policy, max_steps)
    assert [(r.trainer_steps, r.engine_steps) for r in predicted.epochs] == truth.epoch_ends
    assert (predicted.wiped_micro_batches, predicted.unapplied_micro_batches) == (truth.wiped, truth.unapplied)
    assert predicted.dropped_micro_batches == truth.dropped


def test_the_fabric_rows_are_what_each_deepspeed_did():
    from stepsync.core.lightning_versions import fabric_zero12

    with open(os.path.join(REPO, "probes", "fabric.json")) as handle:
        measured = json.load(handle)["zero2"]
    for deepspeed, seen in measured.items():
        expected = "fails" if seen["config_gas_1"].startswith("fails") else seen["config_gas_1"]
        assert fabric_zero12(deepspeed) == expected, deepspeed
