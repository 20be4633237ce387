"""stepsync.watch on custom accelerate + DeepSpeed loops: real accelerate, real DeepSpeed, CPU.

The loops are shaped like transformers' run_clm_no_trainer.py; each records its own count and the engine's
after every micro-batch (harness.loops.run_loop), and stepsync's report must equal that record.
"""
import os
import subprocess
import sys

import pytest

from harness.stack import DRIFTS, needs_stack
from harness.paths import entry_script

pytestmark = [needs_stack, pytest.mark.integration]

N, G, EPOCHS = 5, 2, 2  # accelerate's accumulate(): windows at 2, 4 and the epoch's end (5)


def loop(policy="warn", **kwargs):
    from harness.loops import run_loop

    return run_loop(N, G, EPOCHS, policy, **kwargs)


def check_against_the_loops_record(result):
    report = result.watch.report
    assert result.error is None, repr(result.error)
    assert report.active and report.finished
    assert [(r.trainer_steps, r.engine_steps) for r in report.epochs] == result.epoch_ends
    assert (report.trainer_steps, report.engine_steps) == (result.loop_steps[-1], result.engine_steps[-1])
    assert [(r.trainer_steps, r.engine_steps) for r in report.forecast.epochs] == result.epoch_ends
    assert report.forecast_mismatches == [] and report.micro_batches == N * EPOCHS


def test_warn_reports_the_loops_real_drift_and_changes_nothing():
    watched, plain = loop("warn"), loop(None)
    check_against_the_loops_record(watched)
    # The same run as without stepsync, micro-batch by micro-batch.
    assert (watched.loop_steps, watched.engine_steps) == (plain.loop_steps, plain.engine_steps)
    assert watched.loop_updates_at == [2, 4, 5, 7, 9, 10]
    report = watched.watch.report
    if DRIFTS:  # accelerate < 1.8: the engine's own counter, across epochs
        assert watched.epoch_ends == [(3, 2), (6, 5)] and watched.engine_updates_at == [2, 4, 6, 8, 10]
        first = report.events[0]
        assert (first.epoch, first.micro_batch, first.cause.name, first.counter) == (1, 5, "PARTIAL_WINDOW",
                                                                                  "loop updates")
        assert "stepsync.watch" in first.remedy and "loop updates=3" in first.message()
    else:
        assert watched.epoch_ends == [(3, 3), (6, 6)] and report.events == []
    assert str(report).startswith("stepsync report (policy 'warn'): your loop 6 updates")
    # The LR scheduler the loop prepared, read apart from stepsync: it steps on the loop's count.
    scheduler = watched.accelerator._schedulers[0].scheduler
    followed = [note for note in report.notes if note.startswith("the LR scheduler your loop prepared")]
    assert scheduler.last_epoch == 6
    if DRIFTS:
        assert followed and followed[0].endswith("its schedule followed your loop's 6 updates while the engine made 5")
    else:
        assert followed == []


@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_an_evaluation_between_epochs_changes_no_count(policy):
    """run_clm_no_trainer.py evaluates after each epoch on a prepared eval dataloader (3 batches: accelerate's
    gradient state follows that loader while it runs): the report equals the loop's record, and the run the same
    without evaluation, count by count."""
    evaluated, plain = loop(policy, evaluate_each_epoch=3), loop(policy)
    check_against_the_loops_record(evaluated)
    assert (evaluated.loop_steps, evaluated.engine_steps) == (plain.loop_steps, plain.engine_steps)
    report, alone = evaluated.watch.report, plain.watch.report
    assert [(e.epoch, e.micro_batch, e.drift) for e in report.events] == [
        (e.epoch, e.micro_batch, e.drift) for e in alone.events]
    assert report.notes == alone.notes


def test_warn_leaves_the_parameters_as_they_were():
    import torch

    from harness.runs import final_parameters

    watched, plain = loop("warn"), loop(None)
    assert torch.equal(final_parameters(watched), final_parameters(plain))


def test_raise_stops_the_loop_before_its_first_micro_batch_where_the_forecast_drifts():
    from stepsync import StepDriftError

    result = loop("raise")
    if DRIFTS:
        assert isinstance(result.error, StepDriftError)
        assert (result.error.event.trainer_steps, result.error.event.engine_steps) == (3, 2)  # as forecast
        assert result.error.event.where == "forecast" and str(result.error).startswith("the forecast: affected")
        assert result.engine_steps == [] and result.engine.micro_steps == 0  # stopped before the first micro-batch
    else:
        assert result.error is None and result.watch.report.events == []


@pytest.mark.parametrize("stage", [0, 2])
def test_sync_makes_the_engine_update_where_the_loop_counts(stage):
    result = loop("sync", stage=stage)
    check_against_the_loops_record(result)
    assert result.engine_updates_at == result.loop_updates_at == [2, 4, 5, 7, 9, 10]
    assert result.epoch_ends == [(3, 3), (6, 6)] and result.watch.report.drift == 0
    if DRIFTS:  # given back: the engine decides its boundaries again
        assert result.engine._is_gradient_accumulation_boundary is None
    else:
        assert any("does nothing here" in note for note in result.watch.report.notes)
    assert "backward" not in vars(result.accelerator)  # the accelerator's own method is back


def test_backward_outside_accumulate_is_named_with_the_fix():
    result = loop("warn", outside_accumulate=True)
    notes = [n for n in result.watch.report.notes if "outside `with accelerator.accumulate(model):`" in n]
    assert result.error is None and len(notes) == 1
    if DRIFTS:
        assert result.epoch_ends == [(5, 2), (10, 5)]  # the loop counts every micro-batch, the engine every G-th
    else:  # accelerate >= 1.8: sync_gradients stays True, so the engine updates on every micro-batch
        assert result.epoch_ends == [(5, 5), (10, 10)] and "the engine updates on every micro-batch" in notes[0]
    assert notes[0].count(" while ") <= 1 and "; put the forward, backward" in notes[0]  # one sentence, read once
    events = result.watch.report.events
    # The drift grows at every second micro-batch, +1 .. +5, with one cause: one entry, said once where it started.
    truth = [loop - engine for loop, engine in zip(result.loop_steps, result.engine_steps)]
    changes = sum(1 for before, after in zip([0] + truth, truth) if after != before)
    assert [(e.drift, e.last_drift, e.changes) for e in events] == ([(1, truth[-1], changes)] if DRIFTS else [])
    assert changes == (5 if DRIFTS else 0)
    assert all(e.cause.name == "OUTSIDE_ACCUMULATE" and "inside `with accelerator.accumulate" in e.remedy
               for e in events)
    assert not any("please report" in m for m in result.watch.report.forecast_mismatches)


def test_metrics_go_through_accelerator_log():
    class Tracker:
        name = "memory"
        main_process_only = True

        def __init__(self):
            self.records = []

        def log(self, values, step=None, **kwargs):
            self.records.append((step, dict(values)))

    tracker = Tracker()
    result = loop("warn", trackers=[tracker])
    assert result.error is None
    assert [step for step, _ in tracker.records] == list(range(1, 7))  # one record per update the loop counts
    last = tracker.records[-1][1]
    assert (last["stepsync/loop_steps"], last["stepsync/engine_steps"]) == (6, 5 if DRIFTS else 6)
    assert last["stepsync/drift"] == last["stepsync/loop_steps"] - last["stepsync/engine_steps"]


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("policy, fix", [("realign", "adopt watch.report.engine_steps"),
                                         ("drop_last", "use policy='sync'"), ("fix-it", "Possible choices")])
def test_a_policy_that_cannot_serve_a_loop_is_refused(policy, fix):
    import stepsync

    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        stepsync.watch(object(), policy)


@pytest.mark.reliability("bad_input")
def test_watch_before_prepare_names_the_fix():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    import stepsync
    from stepsync import StepSyncConfigError
    from stepsync.tools.tiny_run import cpu_distributed_env
    from harness.loops import loop_deepspeed_config

    cpu_distributed_env()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=G,
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=loop_deepspeed_config(G)))
    with pytest.raises(StepSyncConfigError, match=r"call it after accelerator\.prepare"):
        stepsync.watch(accelerator, "sync")


SCRIPT = entry_script("loop_param_run.py")


def parameters_on(python, out, policy):
    import torch

    from harness.runs import child_env

    env = child_env()
    if python != sys.executable:
        env.pop("TORCH_EXTENSIONS_DIR", None)
    proc = subprocess.run([python, SCRIPT, policy, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def test_sync_on_a_drifting_stack_trains_what_the_aligned_stack_trains(tmp_path):
    """As tests/integration/test_numerics.py does for the Trainer: same loop, same seed, only the windows can differ."""
    aligned = os.environ.get("STEPSYNC_ALIGNED_PYTHON")
    if not DRIFTS or not aligned:
        pytest.skip("runs on the drifting stack, against STEPSYNC_ALIGNED_PYTHON (scripts/test.sh sets it)")
    reference = parameters_on(aligned, tmp_path / "aligned.pt", "none")
    synced = parameters_on(sys.executable, tmp_path / "sync.pt", "sync")
    plain = parameters_on(sys.executable, tmp_path / "plain.pt", "none")
    assert (synced - reference).abs().max().item() <= 1e-6  # see test_numerics.TOLERANCE
    assert (plain - reference).abs().max().item() > 1e-3  # without the fix the windows, and so the weights, differ


@pytest.mark.parametrize("samples, gas, epochs", [(5, 2, 2), (7, 3, 2), (3, 4, 2)])
@pytest.mark.parametrize("policy", [None, "sync"])
def test_check_forecasts_what_a_real_loop_counts(samples, gas, epochs, policy):
    """`stepsync check --framework accelerate`, before any training, against the loop's own record of both counts
    at each epoch's end (without stepsync, and under sync)."""
    from harness.cli import forecast_epochs
    from harness.loops import run_loop

    run = run_loop(samples, gas, epochs, policy)
    assert run.error is None, repr(run.error)
    assert forecast_epochs("accelerate", samples, gas, epochs, policy or "warn") == run.epoch_ends


def test_a_loop_with_its_own_windows_is_held_to_its_optimizer_steps():
    """accelerate's gradient_accumulation_for_autoregressive_models.py (tests/harness/loops.py, run_window_loop): 13
    micro-batches per epoch, G=3, 2 epochs, backward() outside accumulate() and one optimizer.step() per window of
    its own: 10 windows. The report counts those 10 against the engine's updates, read from the loop itself: 8
    (accelerate 1.7: the engine's counter, 2 micro-batches never applied) or 26 (accelerate >= 1.8: one per
    micro-batch), every event's cause named, and no forecast made for windows it cannot see."""
    from harness.loops import run_window_loop

    plain, watched = run_window_loop(13, 3, 2), run_window_loop(13, 3, 2, policy="warn")
    assert (watched.engine_steps, watched.shares) == (plain.engine_steps, plain.shares)  # warn changes nothing
    report = watched.watch.report
    assert report.trainer_steps == plain.optimizer_steps == 10
    assert report.engine_steps == plain.engine_steps[-1] == (8 if DRIFTS else 26)
    assert report.unapplied_micro_batches == (2 if DRIFTS else 0)
    assert [(row.trainer_steps, row.engine_steps) for row in report.epochs] == (
        [(5, 4), (10, 8)] if DRIFTS else [(5, 13), (10, 26)])
    assert report.events and all(event.cause.name == "OUTSIDE_ACCUMULATE" for event in report.events)
    assert report.forecast is None and report.forecast_mismatches == []
    assert any("not where your loop calls optimizer.step()" in note for note in report.notes)


@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_a_loop_that_gathers_its_window_first_is_counted_one_epoch_per_epoch(policy):
    """17 micro-batches, G=5, 3 epochs: the example gathers each window's batches before its first backward, so the
    dataloader says its end while the last window (2 micro-batches) still has backward() calls to run. Each epoch
    is counted once, where its last micro-batch ran: the truth is the loop's own windows (4 an epoch) and the engine's
    count after each epoch's last window."""
    from harness.loops import run_window_loop

    run = run_window_loop(17, 5, 3, policy=policy)
    report = run.watch.report
    assert run.error is None and run.optimizer_steps == 12
    truth = [(4 * epoch, run.engine_steps[4 * epoch - 1]) for epoch in (1, 2, 3)]
    assert [(row.epoch, row.micro_batches) for row in report.epochs] == [(1, 17), (2, 17), (3, 17)]
    assert [(row.trainer_steps, row.engine_steps) for row in report.epochs] == truth
    assert all(event.epoch <= 3 and (event.last is None or event.last[0] <= 3) for event in report.events)
    assert "trained: 3 epoch(s), 51 micro-batch(es)" in str(report)


def test_sync_makes_a_loops_own_windows_its_updates_or_says_why_it_cannot():
    """policy 'sync' on that loop: accelerate 1.7 leaves the boundary to stepsync, which closes each window at the
    loop's optimizer.step() (one update per window, every micro-batch applied whole, read from the weights);
    accelerate >= 1.8 updates at every micro-batch outside accumulate() itself, and sync says it cannot change that,
    never making per-micro-batch updates of its own."""
    from harness.loops import run_window_loop

    run = run_window_loop(13, 3, 2, policy="sync")
    report = run.watch.report
    assert run.error is None and run.optimizer_steps == report.trainer_steps == 10
    if DRIFTS:
        assert run.engine_steps == list(range(1, 11)) and run.shares == [1.0] * 13
        assert report.events == [] and report.unapplied_micro_batches == 0
    else:
        assert run.engine_steps == run_window_loop(13, 3, 2).engine_steps and run.engine_steps[-1] == 26
        assert any("stay where accelerate puts them" in note for note in report.notes)


def test_a_watch_that_cannot_watch_says_so_when_it_starts():
    """Accelerator(cpu=True) drops the DeepSpeed plugin it is given (accelerate's own choice): the watch says at once,
    as a warning, that it watches nothing, and why. In a process of its own: accelerate keeps one state per process."""
    from harness.runs import child_env

    code = (
        "from stepsync.tools.tiny_run import cpu_distributed_env\n"
        "cpu_distributed_env()\n"
        "from accelerate import Accelerator\n"
        "from accelerate.utils import DeepSpeedPlugin\n"
        "import stepsync\n"
        "config = {'train_micro_batch_size_per_gpu': 1, 'gradient_accumulation_steps': 1,\n"
        "          'zero_optimization': {'stage': 0}}\n"
        "accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))\n"
        "watch = stepsync.watch(accelerator, 'warn', console=False)\n"
        "print('active', watch.report.active)\n")
    # accelerate leaves ACCELERATE_* variables behind after a DeepSpeed loop (ACCELERATE_USE_DEEPSPEED): a user's
    # fresh process has none
    env = {key: value for key, value in child_env().items() if not key.startswith("ACCELERATE_")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("stepsync: ")]
    assert len(said) == 1 and said[0].startswith("stepsync: nothing to watch: the accelerator does not use DeepSpeed "
                                                 "(distributed_type "), said
    assert "Accelerator(cpu=True)" in said[0] and proc.stdout.strip() == "active False"


@pytest.mark.skipif(not DRIFTS, reason="needs a drift that grows at every update")
def test_a_drift_that_grows_at_every_update_is_said_once_and_kept_in_bounds(tmp_path, caplog):
    """backward outside accumulate(): the drift grows at every second micro-batch. Said once where it starts (with
    its cause and remedy), then summed once per epoch end; what the report keeps, prints and saves does not grow with
    the updates: 10 times the micro-batches, the same report."""
    import json
    import logging

    from harness.loops import run_loop

    sizes = {}
    for samples in (5, 50):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stepsync"):
            result = run_loop(samples, G, EPOCHS, "warn", outside_accumulate=True, save_to=str(tmp_path / str(samples)))
        report = result.watch.report
        said = [r.getMessage() for r in caplog.records if "step drift" in r.getMessage()]
        assert len([line for line in said if line.startswith("stepsync: step drift")]) == 1, said
        assert len([line for line in said if " ends with step drift " in line]) == EPOCHS, said
        (event,) = report.events
        truth = result.loop_steps[-1] - result.engine_steps[-1]
        assert (event.drift, event.last_drift) == (1, truth)
        record = os.path.join(tmp_path, str(samples), f"epoch_{EPOCHS - 1}", "stepsync_state.json")
        sizes[samples] = (len(str(report).splitlines()), len(json.load(open(record))["events"]),
                          os.path.getsize(record))
    lines, events, size = sizes[5]
    assert sizes[50][:2] == (lines, events) == (sizes[50][0], 1)
    assert abs(sizes[50][2] - size) < 64  # the same entry, larger numbers in it


def test_an_lr_scheduler_built_on_a_watched_optimizer_works():
    """torch's LR schedulers wrap their optimizer's step through its ``__func__``: the watch's own step (set on the
    prepared optimizer) is a method of it, so a scheduler built after stepsync.watch() works and the step is still
    seen (a plain function there raised AttributeError in the scheduler's constructor)."""
    import torch

    from stepsync.engine.loop_objects import InstancePatches

    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    original, seen = optimizer.step, []
    patches = InstancePatches()
    patches.set(optimizer, "step", lambda *args, **kwargs: seen.append(1) or original(*args, **kwargs), as_method=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    weight.grad = torch.ones(1)
    optimizer.step()
    scheduler.step()
    assert seen == [1] and float(weight) == -1.0 and scheduler.last_epoch == 1
    patches.restore()
    assert "step" not in vars(optimizer)
