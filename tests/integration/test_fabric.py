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
    # +1 in epoch 1, +2 in epoch 2, one cause: one entry, said where it started, with where it stood last
    assert [(e.epoch, e.micro_batch, e.drift, e.cause, e.changes, e.last) for e in report.events] == [
        (1, 2, 1, Cause.ENGINE_NOT_STEPPED, 2, (2, 2, 2, 0))]
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


def faulty_fabric(monkeypatch, caplog, policy, fail, breaks_at=4):
    """The Fabric loop with stepsync seeing a FaultyEngine that breaks before micro-batch ``breaks_at``."""
    import logging

    import stepsync.lightning.lightning as facts
    from harness.faults import breaking_at

    before_micro_batch = breaking_at(monkeypatch, facts, "fabric_engine", fail, breaks_at)
    with caplog.at_level(logging.INFO, logger="stepsync"):
        return run_fabric(3, 2, 2, 0, policy, before_micro_batch=before_micro_batch)


@pytest.mark.reliability("fault")
@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_counters_that_fail_mid_loop_switch_stepsync_off_and_the_fabric_loop_trains_on(monkeypatch, caplog, policy):
    from harness.faults import stepsync_errors

    run = faulty_fabric(monkeypatch, caplog, policy, {"global_steps": "raise"})
    assert run.error is None and len(run.batches) == 6  # every micro-batch trained
    # What each update trained, from the parameters: the same as the loop without stepsync (sync's first update,
    # made by the engine, trained the same two micro-batches Fabric's own would have).
    assert run.updates == run_fabric(3, 2, 2, 0, None).updates and [len(u) for u in run.updates] == [2, 3]
    # sync made the engine step at the loop's first update; from the fault on Fabric's own optimizer.step() is back
    assert [engine for *_, engine in run.batches] == ([0, 1, 1, 1, 1, 1] if policy == "sync" else [0] * 6)
    errors = stepsync_errors(caplog)
    assert len(errors) == 1 and "injected failure reading global_steps" in errors[0].getMessage()
    report = run.watch.report
    assert report.finished and not report.active and "internal error" in report.inactive_reason
    assert run.engine._is_gradient_accumulation_boundary is None  # DeepSpeed's own boundary is back
    assert "step" not in vars(run.watch.optimizer)  # and the optimizer's own step, once closed


@pytest.mark.reliability("fault")
def test_a_failing_boundary_call_under_sync_never_ends_the_fabric_loop(monkeypatch, caplog):
    from harness.faults import stepsync_errors

    run = faulty_fabric(monkeypatch, caplog, "sync", {"set_gradient_accumulation_boundary": "raise"}, breaks_at=3)
    assert run.error is None and len(run.batches) == 6
    errors = stepsync_errors(caplog)
    assert len(errors) == 1 and "could not be given back" in errors[0].getMessage()
    assert not run.watch.report.active and run.watch.report.finished


@pytest.mark.reliability("fault")
def test_under_raise_an_internal_failure_stops_the_fabric_loop(monkeypatch, caplog):
    run = faulty_fabric(monkeypatch, caplog, "raise", {"global_steps": "raise"}, breaks_at=2)  # before the drift
    assert isinstance(run.error, RuntimeError) and "injected failure" in str(run.error) and len(run.batches) == 1
    assert run.watch.report.finished  # close() in the loop's finally raised nothing more


@pytest.mark.skipif(Version(DEEPSPEED) < Version("0.19.3"), reason="this DeepSpeed applies a non-finite bf16 update")
def test_sync_reports_the_update_the_engine_skipped():
    import torch

    rows = torch.eye(4)
    rows[2] *= float("nan")  # the third micro-batch: its gradient is not finite
    run = run_fabric(4, 2, 1, 2, "sync", precision="bf16-mixed", data=torch.utils.data.DataLoader(rows, batch_size=1))
    assert run.error is None
    assert (run.engine.global_steps, run.engine.skipped_steps) == (2, 1)  # DeepSpeed's own counters: the truth
    report = run.watch.report
    assert [(s.epoch, s.micro_batch, s.engine_steps) for s in report.skipped_updates] == [(1, 4, 2)]
    assert len(run.updates) == 1  # the weights moved at the first update only


@pytest.mark.parametrize("n, g, epochs", [(3, 2, 2), (5, 2, 3), (7, 3, 2)])
@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_check_forecasts_what_a_real_fabric_loop_counts(n, g, epochs, policy):
    """`stepsync check --framework fabric`, before any training, against the loop's own record of its
    optimizer.step() count and the engine's at each epoch's end (warn changes nothing: tested above)."""
    from harness.cli import forecast_epochs

    run = run_fabric(n, g, epochs, 0, policy)
    assert run.error is None, repr(run.error)
    ends = [(loop, engine) for epoch, index, loop, engine in run.batches if index == n - 1]
    assert forecast_epochs("fabric", n, g, epochs, policy) == ends


@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_a_fabric_loop_without_deepspeed_is_held_against_its_optimizers_steps(caplog, policy):
    """Fabric's own accumulation, 5 samples, G=2, 3 epochs: the loop's optimizer.step() count is held against the
    optimizer's own steps (a step post-hook): equal, nothing warned; the start says which checks ran. sync has
    nothing to steer (said); both train what the unwatched loop trains (the weights)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="stepsync"):
        record = run_fabric(5, 2, 3, policy=policy, deepspeed=False)
    plain = run_fabric(5, 2, 3, policy=None, deepspeed=False)
    report = record.watch.report
    assert record.error is None and report.active and report.updater == "optimizer"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert record.updates == plain.updates and (record.weights - plain.weights).abs().max().item() == 0
    assert (report.trainer_steps, report.engine_steps, report.events) == (6, 6, [])
    assert [loop for _, _, loop, _ in record.batches] == [0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 5, 5, 6, 6]
    assert any(note.startswith("no DeepSpeed: your Fabric loop's count is held against its optimizer's steps")
               for note in report.notes)
    assert any("policy 'sync' does nothing here" in note for note in report.notes) is (policy == "sync")
