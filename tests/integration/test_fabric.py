"""stepsync.lightning.watch on real Fabric loops on DeepSpeed (CPU), checked against the loop's own record after
every micro-batch and against each update's micro-batch weights solved from the parameters
(harness/lightning_runs.py: Fabric's documented accumulation loop, with no_backward_sync)."""
import shutil
from importlib.metadata import version

import pytest
from packaging.version import Version

pytest.importorskip("lightning")

from harness.lightning_runs import run_fabric  # noqa: E402
from stepsync.core.lightning_versions import fabric_zero12  # noqa: E402
from stepsync.core.errors import StepDriftError, StepSyncConfigError  # noqa: E402
from stepsync.core.events import Cause  # noqa: E402

DEEPSPEED = version("deepspeed")
ZERO12 = fabric_zero12(DEEPSPEED)  # what ZeRO 1 and 2 do in a Fabric loop on this DeepSpeed, as measured
# DeepSpeed 0.14.5 (the one of the older Lightning stacks) calls numactl for ZeRO-3 on a CPU; 0.19.8 does not.
ZERO3_HERE = shutil.which("numactl") is not None or Version(DEEPSPEED) >= Version("0.19")
STAGES = [0, 2, pytest.param(3, marks=pytest.mark.skipif(not ZERO3_HERE, reason="this DeepSpeed's CPU ZeRO-3 needs "
                                                                                    "numactl, not installed here"))]


@pytest.mark.parametrize("stage", STAGES)
def test_warn_names_the_engine_that_never_steps(stage):
    run = run_fabric(3, 2, 2, stage, "warn")
    assert run.error is None
    assert [batch[3] for batch in run.batches] == [0] * 6  # the loop's own record: the engine never moved
    report = run.watch.report
    assert (report.trainer_steps, report.engine_steps) == (2, 0)
    assert [(e.epoch, e.micro_batch, e.drift, e.cause) for e in report.events] == [
        (1, 2, 1, Cause.ENGINE_NOT_STEPPED), (2, 2, 2, Cause.ENGINE_NOT_STEPPED)]
    assert any("never calls engine.step()" in note for note in report.notes)
    said = any("only the last micro-batch" in note for note in report.notes)
    assert said == (stage == 2 and ZERO12 == "keeps_the_last")
    # What was said is what the parameters show: one micro-batch per update where it is lost, two elsewhere.
    assert [len(update) for update in run.updates] == ([1, 1] if said else [2, 3])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("n, g, epochs", [(3, 2, 2), (5, 2, 3), (7, 3, 2)])
def test_sync_makes_the_engine_update_where_the_loop_steps(n, g, epochs, stage):
    run = run_fabric(n, g, epochs, stage, "sync")
    plain = run_fabric(n, g, epochs, policy=None, deepspeed=False)
    assert run.error is None and plain.error is None
    assert all(loop == engine for _, _, loop, engine in run.batches)
    assert run.updates == plain.updates  # the loop's leftovers join the next window, with or without DeepSpeed
    assert all(abs(w * g - round(w * g)) < 1e-4 for update in run.updates for w in update.values())
    assert (run.weights - plain.weights).abs().max().item() < 1e-6  # the same loop without DeepSpeed
    assert run.watch.report.events == [] and run.engine._is_gradient_accumulation_boundary is None


def test_a_config_that_fails_at_the_first_step_is_named_before_it():
    run = run_fabric(3, 2, 2, 2, "warn", config_gas=2)
    said = any("KeyError: 0" in note for note in run.watch.report.notes)
    if ZERO12 == "accumulates":  # this DeepSpeed accumulates, and divides the loss by G once more
        assert run.error is None and not said
        assert {w for update in run.updates for w in update.values()} == {0.25}
        return
    assert isinstance(run.error, KeyError) and said  # what Fabric and DeepSpeed do, as said at the start
    refused = run_fabric(3, 2, 2, 2, "raise", config_gas=2)
    assert isinstance(refused.error, StepSyncConfigError) and refused.batches == []


def test_raise_stops_at_the_first_divergence():
    run = run_fabric(3, 2, 2, 0, "raise")
    assert isinstance(run.error, StepDriftError) and run.error.event.cause is Cause.ENGINE_NOT_STEPPED


@pytest.mark.parametrize("policy", ["realign", "drop_last"])
def test_policies_a_loop_cannot_have_are_refused(policy):
    run = run_fabric(3, 2, 2, 0, policy)
    assert isinstance(run.error, ValueError) and "use policy='sync'" in str(run.error)
