"""stepsync.lightning.StepSyncCallback on real Lightning + DeepSpeed runs on CPU, checked against an independent
recorder (both counts and the scheduler's steps after every batch) and against each update's micro-batch weights
solved from the parameters (harness/lightning_runs.py). Lightning's one device check is lifted; nothing else."""
import os
import shutil
from importlib.metadata import version

import pytest
from packaging.version import Version

pytest.importorskip("lightning")

from harness.lightning_runs import parameters, run_lightning  # noqa: E402
from harness.paths import REPO  # noqa: E402
from harness.readme import examples, filled, launch  # noqa: E402
from stepsync.core.errors import StepDriftError, StepSyncConfigError  # noqa: E402
from stepsync.lightning import StepSyncCallback  # noqa: E402

CASES = [(3, 2, 2), (5, 2, 3), (7, 3, 2)]
# DeepSpeed 0.14.5 (the one of the older Lightning stacks) calls numactl for ZeRO-3 on a CPU; 0.19.8 does not.
ZERO3_HERE = shutil.which("numactl") is not None or Version(version("deepspeed")) >= Version("0.19")
STAGES = [0, 2, pytest.param(3, marks=pytest.mark.skipif(not ZERO3_HERE, reason="this DeepSpeed's CPU ZeRO-3 needs "
                                                                                    "numactl, not installed here"))]


def fit(n, g, epochs, stage=0, policy="warn", **options):
    callback = StepSyncCallback(policy, console=False)
    result = run_lightning(n, g, epochs, stage, callback, **options)
    return result, callback.report


def applied(result):
    """Micro-batches whose gradients reached an update, from the parameters: each weighs 1/G**k of it."""
    return [sample for update in result.recording.updates for sample in update]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("n, g, epochs", CASES)
def test_warn_reports_what_the_run_did(n, g, epochs, stage):
    result, report = fit(n, g, epochs, stage)
    assert result.error is None
    recorded = result.recording
    lightning, engine = recorded.batches[-1][3:5]
    assert (report.trainer_steps, report.engine_steps) == (lightning, engine) == (epochs * (n // g), epochs * n // g)
    # The forecast, made before the first batch, equals the counts the recorder saw at every epoch end.
    assert [(r.trainer_steps, r.engine_steps) for r in report.forecast.epochs] == recorded.epoch_ends
    assert [(e.trainer_steps, e.engine_steps) for e in report.epochs] == recorded.epoch_ends
    assert report.forecast_mismatches == []
    # Each micro-batch weighs 1/G**2, as the forecast says; what zero_grad cleared is what never reached an update.
    weights = {w for update in recorded.updates for w in update.values()}
    assert report.forecast.micro_batch_weight == pytest.approx(1 / g ** 2)
    assert all(abs(w * g ** 2 - round(w * g ** 2)) < 1e-4 for w in weights)
    reached = round(sum(w for update in recorded.updates for w in update.values()) * g ** 2)
    assert n * epochs - reached - report.unapplied_micro_batches == report.forecast.wiped_micro_batches
    assert (report.forecast.wiped_micro_batches > 0) == (stage != 2 and n % g != 0)
    # What the parameters show is in the final report, not only in the forecast.
    assert report.update_flaws[0].startswith(f"each micro-batch weighs 1/{g ** 2} of its update, not 1/{g}")
    assert any(f"clears {report.forecast.wiped_micro_batches} micro-batch(es)" in flaw for flaw in report.update_flaws) \
        == (report.forecast.wiped_micro_batches > 0)
    assert f"updates: each micro-batch weighs 1/{g ** 2}" in str(report)
    # Lightning steps the scheduler on its own count.
    assert all(batch[5] == batch[3] for batch in recorded.batches)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("n, g, epochs", CASES)
def test_sync_updates_where_lightning_counts_at_one_over_g(n, g, epochs, stage):
    result, report = fit(n, g, epochs, stage, "sync")
    assert result.error is None
    recorded = result.recording
    whole = n - n % g
    assert all(len(recorded.samples(e)) == whole for e in range(epochs))  # the leftovers are not trained
    assert all(batch[3] == batch[4] == batch[5] for batch in recorded.batches)  # equal after every batch
    assert [w for update in recorded.updates for w in update.values()] == [pytest.approx(1 / g)] * (whole * epochs)
    assert sorted(applied(result)) == sorted(list(range(whole)) * epochs)  # nothing cleared, nothing straddles
    assert report.drift == 0 and report.events == [] and report.dropped_micro_batches == (
        {e: n % g for e in range(1, epochs + 1)} if n % g else {})
    assert result.engine.gradient_accumulation_steps() == g  # the engine's own G given back at the end
    assert report.update_flaws == []  # each update trained what Lightning means by one


@pytest.mark.parametrize("stage", STAGES)
def test_sync_trains_the_parameters_of_the_same_run_without_deepspeed(stage):
    """The gold standard: Lightning without DeepSpeed over the micro-batches sync trains (whole windows)."""
    n, g, epochs = 7, 3, 2
    synced, _ = fit(n, g, epochs, stage, "sync")
    plain = run_lightning(n, g, epochs, deepspeed=False, limit_train_batches=n - n % g)
    assert synced.error is None and plain.error is None
    assert (parameters(synced.module) - plain.module.w.detach()).abs().max().item() < 1e-6
    unsynced, _ = fit(n, g, epochs, stage, "warn")
    assert (parameters(unsynced.module) - plain.module.w.detach()).abs().max().item() > 1e-2


@pytest.mark.parametrize("policy", ["warn", "raise", "sync", "drop_last"])
def test_without_deepspeed_the_counts_are_held_against_the_optimizers_steps(policy):
    """Lightning's own accumulation (probes/lightning_alone.json): 7 micro-batches an epoch, G=3, 2 epochs. The
    optimizer steps after micro-batches 3, 6 and 7 of each epoch (the partial window's micro-batch at 1/G, as the
    weights show) and Lightning counts each step: the report's counts and its forecast's epoch ends are the
    recorder's. sync has nothing to steer (said) and trains what warn trains; drop_last ends each epoch after 6."""
    n, g, epochs = 7, 3, 2
    result = run_lightning(n, g, epochs, callback=StepSyncCallback(policy, console=False), deepspeed=False)
    report, recorded = result.callback.report, result.recording
    assert result.error is None and report.active and report.updater == "optimizer"
    drops = policy == "drop_last"
    assert recorded.epoch_ends == ([(2, 2), (4, 4)] if drops else [(3, 3), (6, 6)])
    assert [(row.trainer_steps, row.engine_steps) for row in report.forecast.epochs] == recorded.epoch_ends
    assert [(row.trainer_steps, row.engine_steps) for row in report.epochs] == recorded.epoch_ends
    assert (report.trainer_steps, report.engine_steps, report.events) == (*recorded.epoch_ends[-1], [])
    assert report.forecast_mismatches == [] and report.forecast.micro_batch_weight == 1 / g
    third = round(1 / g, 6)
    windows = [{0: third, 1: third, 2: third}, {3: third, 4: third, 5: third}] + ([] if drops else [{6: third}])
    assert recorded.updates == windows * epochs
    assert report.dropped_micro_batches == ({1: 1, 2: 1} if drops else {})
    assert any(note.startswith("no DeepSpeed: Lightning's count is held against its optimizer's steps")
               for note in report.notes)
    assert any("policy 'sync' does nothing here" in note for note in report.notes) is (policy == "sync")


@pytest.mark.parametrize("stage", [0, 2])
def test_drop_last_trains_whole_windows_only(stage):
    n, g, epochs = 5, 2, 3
    result, report = fit(n, g, epochs, stage, "drop_last")
    recorded = result.recording
    assert result.error is None and all(len(recorded.samples(e)) == 4 for e in range(epochs))
    assert all(batch[3] == batch[4] for batch in recorded.batches)
    assert report.dropped_micro_batches == {1: 1, 2: 1, 3: 1} and report.forecast.wiped_micro_batches == 0
    assert "weighs 1/4" in report.forecast.verdict()  # what drop_last leaves as it is, said


def test_raise_stops_before_the_first_batch_where_the_forecast_drifts():
    result, report = fit(3, 2, 2, 0, "raise")
    assert isinstance(result.error, StepDriftError)
    event = result.error.event  # the forecast's first drift: the engine ahead at epoch 2's end
    assert (event.epoch, event.micro_batch, event.where, event.trainer_steps, event.engine_steps) == (2, 3, "forecast", 2, 3)
    assert result.recording.batches == [] and str(result.error).startswith("the forecast: affected")


@pytest.mark.parametrize("policy", ["sync", "drop_last"])
def test_a_tiny_epoch_is_refused_before_any_batch(policy):
    result, _ = fit(2, 4, 2, 0, policy)
    assert isinstance(result.error, StepSyncConfigError) and "lower accumulate_grad_batches" in str(result.error)
    assert result.recording.batches == []


def test_a_tiny_epoch_under_warn_is_reported():
    result, report = fit(2, 4, 2, 0)
    assert result.error is None and (report.trainer_steps, report.engine_steps) == (0, 1)


def test_realign_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="Lightning's count cannot be set|which a callback cannot set"):
        StepSyncCallback("realign")


def test_max_steps_ends_where_the_forecast_says():
    result, report = fit(5, 2, 3, 0, "warn", max_steps=3)
    assert result.error is None and result.trainer.global_step == 3
    assert [(r.trainer_steps, r.engine_steps) for r in report.forecast.epochs] == result.recording.epoch_ends


def test_a_resume_from_a_lightning_checkpoint_carries_the_report_on(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, every_n_epochs=1)
    first, _ = fit(5, 2, 1, 0, "sync", enable_checkpointing=True, callbacks=[saver], default_root_dir=str(tmp_path))
    assert first.error is None
    checkpoint = sorted(tmp_path.glob("*.ckpt"))[-1]
    resumed, report = fit(5, 2, 3, 0, "sync", ckpt_path=str(checkpoint))
    assert resumed.error is None
    assert report.resumed_from is not None and (report.resumed_from.trainer_steps, report.resumed_from.engine_steps) \
        == (2, 2)
    assert (report.trainer_steps, report.engine_steps) == (6, 6) and report.drift == 0
    assert [(r.trainer_steps, r.engine_steps) for r in report.forecast.epochs] == resumed.recording.epoch_ends


def test_the_demo_shows_the_drift_then_the_fix_through_the_entry_point():
    from harness.cli import stepsync_process
    from harness.runs import child_env

    proc = stepsync_process("demo", "--framework", "lightning", timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = " ".join(proc.stdout.split())
    assert ("policy 'warn': Lightning 2, engine 3; policy 'sync': Lightning 2, engine 2 (2 micro-batch(es) left "
            "untrained: whole windows only)") in said  # sync trains whole windows: the result line says what it drops
    said = " ".join(proc.stdout.split())  # the console wraps at its width
    assert "weighs 1/4 of its update" in said and "1: 0.5, 2: 0.5" in said


@pytest.mark.parametrize("stage", [0, 2])
def test_warn_trains_what_the_run_trains_without_stepsync(stage):
    watched, _ = fit(7, 3, 2, stage, "warn")
    alone = run_lightning(7, 3, 2, stage)
    assert watched.recording.batches == alone.recording.batches
    assert watched.recording.updates == alone.recording.updates
    assert torch_equal(parameters(watched.module), parameters(alone.module))


def test_the_metrics_go_through_lightnings_own_log():
    result, report = fit(3, 2, 2, 0, "warn")
    logged = result.trainer.callback_metrics
    assert (float(logged["stepsync/lightning_steps"]), float(logged["stepsync/engine_steps"]),
            float(logged["stepsync/drift"])) == (2.0, 2.0, 0.0)  # at Lightning's last update (epoch 2, batch 2)


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


@pytest.mark.skipif(Version(version("deepspeed")) < Version("0.19.3"), reason="this DeepSpeed applies a non-finite "
                                                                              "bf16 update on ZeRO-2 instead of skipping it")
def test_a_skipped_update_and_the_lr_lightning_moved_for_it(monkeypatch):
    import torch

    import stepsync.tools.tiny_lightning as tiny

    def loader(samples):  # the third micro-batch's row is not finite: its gradient neither
        rows = torch.eye(samples)
        rows[2] *= float("nan")
        return torch.utils.data.DataLoader(rows, batch_size=1)

    monkeypatch.setattr(tiny, "one_hot_loader", loader)
    result, report = fit(4, 2, 1, 2, precision="bf16-mixed")
    assert result.error is None
    engine = result.engine
    assert (engine.global_steps, engine.skipped_steps) == (2, 1)  # DeepSpeed's own counters: the truth
    assert [(s.epoch, s.micro_batch, s.engine_steps) for s in report.skipped_updates] == [(1, 4, 2)]
    # Lightning stepped its scheduler at the skipped update all the same (the recorder's last column), as said.
    assert [batch[5] for batch in result.recording.batches] == [0, 1, 1, 2]
    assert any("Lightning steps the LR scheduler on its own count" in note for note in report.notes)
    assert any("stepped the LR scheduler 2 times for its 2 updates, of which the engine applied 1" in note
               for note in report.notes)


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_the_clip_norm_in_force_against_gradient_clip_val(policy):
    import torch
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from stepsync.tools.tiny_lightning import lift_the_cuda_check

    def strategy(**clip):
        lift_the_cuda_check()
        config = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 1,
                  "zero_allow_untested_optimizer": True, **clip}
        return DeepSpeedStrategy(config=config, parallel_devices=[torch.device("cpu", 0)], process_group_backend="gloo")

    # The config's gradient_clipping wins over gradient_clip_val; Lightning passes the latter only where it has none.
    result, report = fit(4, 2, 1, policy=policy, strategy=strategy(gradient_clipping=1.0), gradient_clip_val=0.5)
    said = [note for note in report.notes if "asks to clip gradients at 0.5" in note]
    if policy == "raise":
        assert isinstance(result.error, StepSyncConfigError) and "before the first micro-batch" in str(result.error)
        assert result.recording.batches == []
        return
    assert result.error is None and result.engine.gradient_clipping() == 1.0  # the truth: the engine's own
    assert len(said) == 1 and "clips at 1" in said[0] and 'remove "gradient_clipping"' in said[0]
    result, report = fit(4, 2, 1, policy=policy, strategy=strategy(), gradient_clip_val=0.5)  # the fix
    assert result.engine.gradient_clipping() == 0.5 and not any("clip" in note for note in report.notes)


LIGHTNING_PREAMBLE = """\
import lightning.pytorch as pl
from stepsync.tools.tiny_lightning import cpu_deepspeed_strategy, one_hot_loader, one_hot_module
from stepsync.tools.tiny_run import skip_shared_memory_op
skip_shared_memory_op()  # the README's Install section: the CPU collective op is optional
model, train_dataloader = one_hot_module(3), one_hot_loader(3)
"""
# What the README says differs on a CPU: the strategy, its one CUDA check lifted and its devices named by index
ON_A_CPU = {'strategy="deepspeed_stage_2"': "strategy=cpu_deepspeed_strategy(2)"}
LIGHTNING_AFTER = """
report = next(c for c in trainer.callbacks if isinstance(c, StepSyncCallback)).report
print("stepsync counts:", report.trainer_steps, report.engine_steps, report.drift)
"""


def test_the_readmes_lightning_example_runs_as_written_with_the_cuda_check_lifted(tmp_path):
    """README.md's Lightning example, with a module and a dataloader, started with its CPU launch line (on the newest
    Lightning stack; the older ones run the same callback through harness/lightning_runs.py)."""
    if Version(version("lightning")) < Version("2.6"):
        pytest.skip("the README's example runs on the newest Lightning stack")
    # The example sets no max_epochs (Lightning's default is 1000): Lightning's own environment default caps it at 2
    readme = " ".join(open(os.path.join(REPO, "README.md")).read().split())
    assert "replace `\"deepspeed_stage_2\"` with `stepsync.tools.tiny_lightning.cpu_deepspeed_strategy(2)`" in readme
    done = launch(tmp_path, LIGHTNING_PREAMBLE + filled(examples()[2], ON_A_CPU) + LIGHTNING_AFTER,
                  PL_TRAINER_MAX_EPOCHS="2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # 3 micro-batches per epoch, accumulate_grad_batches=2, 2 epochs: sync ends each epoch after its whole window
    # (docs/lightning.md), one update per epoch on both counts
    assert "stepsync counts: 2 2 0" in done.stdout and "built successfully" not in done.stdout, done.stdout[-2000:]


def test_every_hook_keeps_lightnings_signature():
    """A reader who knows Lightning's Callback finds each hook as it declares it (on_train_batch_end(self, trainer,
    pl_module, outputs, batch, batch_idx)): stepsync's guard never adds a parameter."""
    from lightning.pytorch.callbacks import Callback

    from harness.runs import hooks_as_declared
    from stepsync.lightning import StepSyncCallback

    assert "on_train_batch_end" in hooks_as_declared(StepSyncCallback, Callback)
