"""stepsync/core/versions.py equals the probed releases (probes/*.json), and the forecast reproduces every probe.

The probe data is committed; scripts/probe.py refreshes it. When a new release changes a behaviour, these
tests say which row of versions.py no longer matches what was measured.
"""
import json
import os

import pytest

from harness.paths import REPO
from harness.simulate import simulate
from probes import classify
from stepsync.core.choices import Policy
from stepsync.core.forecast import RunPlan, forecast
from stepsync.core.versions import (
    DEEPSPEED_FEATURES, ENGINE_STEPPERS, MEASURED_TRANSFORMERS, PLANNED_STEPS, REMAINDER_CUT, TRAINER_RULES,
    EngineBoundary, Stack, UnsupportedVersion, behaviour_of,
)


with open(os.path.join(REPO, "probes", "results.json")) as handle:
    PROBED = json.load(handle)["transformers"]
with open(os.path.join(REPO, "probes", "engine.json")) as handle:
    ENGINE_PROBED = json.load(handle)["stacks"]
RAN = {version: entry for version, entry in PROBED.items() if classify.behaviour(entry) is not None}


def rows(table):
    return [(row.behaviour, row.since, row.until) for row in table]


def test_measured_means_the_probe_ran_there():
    assert MEASURED_TRANSFORMERS == tuple(RAN)
    assert len([v for v in RAN if v.count(".") == 2]) >= 60  # every minor from 4.24, plus the patches around changes


@pytest.mark.parametrize("field, table", [
    ("trainer_rule", TRAINER_RULES), ("planned_steps", PLANNED_STEPS)])
def test_trainer_rows_equal_the_probed_ranges(field, table):
    derived = classify.ranges(PROBED, field)
    first = MEASURED_TRANSFORMERS[0]
    assert [(value, None if since == first else since, until) for value, since, until in derived] == rows(table)


def test_the_remainder_cut_rows_equal_the_probed_range():
    derived = [(since, until) for value, since, until in classify.ranges(PROBED, "remainder_cut") if value]
    assert derived == [(REMAINDER_CUT.since, REMAINDER_CUT.until)]


def test_every_probed_release_forces_an_update_at_a_tiny_epochs_end():
    assert classify.ranges(PROBED, "tiny_epoch_update") == [(True, MEASURED_TRANSFORMERS[0], None)]


def probe_cases():
    for version, entry in RAN.items():
        for name, (samples, batch, gas, epochs, max_steps) in entry["cases"].items():
            yield pytest.param(version, name, samples, batch, gas, epochs, max_steps, id=f"{version}-{name}")


@pytest.mark.parametrize("version, name, samples, batch, gas, epochs, max_steps", list(probe_cases()))
def test_the_forecast_reproduces_every_probed_trainer(version, name, samples, batch, gas, epochs, max_steps):
    """Planned max_steps, micro-batches per epoch, where the Trainer counted, the final count: as measured."""
    measured = RAN[version]["results"][name]
    behaviour = behaviour_of(Stack(version, "1.16.0", "0.19.8"))  # the Trainer side does not depend on these
    n = -(-samples // batch)
    plan = RunPlan(n, gas, epochs, max_steps, examples_per_epoch=samples)
    result = forecast(plan, behaviour, Policy.WARN)
    assert result.planned_steps == measured["max_steps"]
    assert [row.micro_batches for row in result.epochs] == [e["micro_batches"] for e in measured["epochs"]]
    assert [row.trainer_updates for row in result.epochs] == [len(e["updates_at"]) for e in measured["epochs"]]
    assert result.trainer_steps == measured["global_step"]
    # Where: the brute-force simulation of the same loop, position by position.
    _, trainer_at, _, _ = simulate(n, gas, epochs, max_steps, behaviour, Policy.WARN, examples=samples)
    seen, offset = [], 0
    for epoch in measured["epochs"]:
        seen += [offset + position for position in epoch["updates_at"]]
        offset += epoch["micro_batches"]
    assert trainer_at == seen


def test_the_run_that_ends_early_is_said_before_it_starts():
    """transformers 4.51.3, N=5, G=2, 3 epochs: it plans 6 updates but counts 3 per epoch (measured: 2 epochs)."""
    result = forecast(RunPlan(5, 2, 3), behaviour_of(Stack("4.51.3", "1.6.0", "0.16.9")))
    assert [e["micro_batches"] for e in RAN["4.51.3"]["results"]["n5_g2_e3"]["epochs"]] == [5, 5]
    assert result.ends_early().startswith("the Trainer will stop after 2 of 3 epochs: it plans 2 update(s) per "
                                          "epoch (6 in all) but counts 3 and 3")
    assert "the Trainer will stop after 2 of 3 epochs" in result.verdict()
    assert forecast(RunPlan(5, 2, 3), behaviour_of(Stack("4.52.0", "1.6.0", "0.16.9"))).ends_early() is None


def engine_cases():
    for name, entry in ENGINE_PROBED.items():
        if entry.get("managed", {}).get("error") is None and "managed" in entry:
            yield pytest.param(name, id=name)


@pytest.mark.parametrize("name", list(engine_cases()))
def test_the_engine_rows_equal_the_probed_engines(name):
    entry = ENGINE_PROBED[name]
    versions, run = entry["versions"], entry["managed"]
    behaviour = behaviour_of(Stack(versions["transformers"], versions["accelerate"], versions["deepspeed"]))
    own_counter = list(range(entry["case"]["gas"], run["micro_batches"] + 1, entry["case"]["gas"]))
    if behaviour.engine_boundary is EngineBoundary.FOLLOWS_TRAINER:
        assert run["engine_updates_at"] == run["trainer_updates_at"] != own_counter
    else:  # the engine's own counter: every G-th micro-batch since it was built, engine.step() on each one
        assert run["engine_updates_at"] == own_counter
        assert run["step_calls"] == run["micro_batches"]
    stepper = next(r for r in ENGINE_STEPPERS if r.covers(versions[r.package]))
    caller = {"transformers": "transformers.trainer", "accelerate": "accelerate.utils.deepspeed"}[stepper.package]
    assert run["step_callers"] == [caller]
    features = {row.behaviour for row in DEEPSPEED_FEATURES if row.covers(versions["deepspeed"])}
    assert run["has_set_boundary"] == ("set_gradient_accumulation_boundary" in features)
    assert run["has_managed_flag"] == ("managed_gradient_accumulation" in features)
    if run["has_managed_flag"]:  # false: every step() is a boundary, so the engine updates on every micro-batch
        unmanaged = entry["unmanaged"]
        assert unmanaged["error"] is None
        assert len(unmanaged["engine_updates_at"]) == unmanaged["step_calls"]


@pytest.mark.parametrize("accelerate, boundary, caveat", [
    ("1.8.0", EngineBoundary.FOLLOWS_TRAINER, False),
    ("1.8.0.post1", EngineBoundary.FOLLOWS_TRAINER, False),
    ("1.8.0rc1", EngineBoundary.MICRO_COUNTER, True),
    ("1.8.0.dev0", EngineBoundary.MICRO_COUNTER, True),
    ("1.7.9", EngineBoundary.MICRO_COUNTER, False),
])
def test_a_pre_release_on_a_boundary_counts_as_the_release_before(accelerate, boundary, caveat):
    behaviour = behaviour_of(Stack("5.24.0", accelerate, "0.19.8"))
    assert behaviour.engine_boundary is boundary
    assert any("pre-release of 1.8.0" in note for note in behaviour.caveats) == caveat


def test_measured_and_inferred_releases_are_told_apart():
    assert behaviour_of(Stack("4.51.3", "1.6.0", "0.16.9")).measured
    inferred = behaviour_of(Stack("4.51.0", "1.6.0", "0.16.9"))
    assert not inferred.measured and "was not probed" in inferred.caveats[0]
    newer = behaviour_of(Stack("9.0.0", "1.16.0", "0.19.8"))
    assert not newer.measured and "newer than every probed release (5.25.0)" in newer.caveats[0]


@pytest.mark.parametrize("version", ["4.23.1", "4.10.0", "3.5.0"])
def test_below_the_oldest_measured_release_is_refused(version):
    with pytest.raises(UnsupportedVersion, match=r"older than 4\.24\.0.*supported: 4\.24\.0 to 5\.25\.0"):
        behaviour_of(Stack(version, "0.15.0", "0.14.5"))


def test_installed_versions_are_read_once_per_process(monkeypatch):
    """Every run's start asks for them: reading a package's metadata costs about half a millisecond each time."""
    from importlib import metadata

    from stepsync.core import versions

    reads = []
    monkeypatch.setattr(metadata, "version", lambda package: reads.append(package) or "1.0.0")
    versions.installed_version.cache_clear()
    try:
        assert [versions.installed_version("a-package") for _ in range(3)] == ["1.0.0"] * 3
        assert reads == ["a-package"]
    finally:
        versions.installed_version.cache_clear()
