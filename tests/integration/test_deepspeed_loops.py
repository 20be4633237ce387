"""Loops that drive DeepSpeed's engine themselves (tests/harness/raw_loops.py, after DeepSpeed-Chat's step-1 SFT
loop): `stepsync check --framework deepspeed`, before any training, against what the loop and the engine did."""
import pytest

from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]


@pytest.mark.parametrize("samples, gas, epochs", [(7, 3, 2), (5, 2, 3), (6, 3, 2)])
def test_check_forecasts_a_deepspeed_chat_loop(samples, gas, epochs):
    import json

    from harness.cli import stepsync
    from harness.raw_loops import run_chat_loop

    run = run_chat_loop(samples, gas, epochs)
    proc = stepsync("check", "--framework", "deepspeed", "--micro-batches-per-epoch", str(samples), "--gas", str(gas),
                    "--epochs", str(epochs), "--json")
    forecast = json.loads(proc.stdout)
    # The engine's updates at each epoch's end, the loop's plan and the micro-batches never applied, as they were.
    assert [epoch["engine_steps"] for epoch in forecast["epochs"]] == run.epoch_ends
    assert forecast["trainer_steps"] == forecast["planned_steps"] == run.planned
    assert forecast["engine_steps"] == run.scheduler_steps == len(run.updates)
    assert forecast["unapplied_micro_batches"] == run.unapplied
    assert proc.returncode == (0 if samples % gas == 0 else 1)
    # The engine's windows run across the epoch's end: G micro-batches each, whatever epoch they come from.
    assert all(len(update) == gas for update in run.updates)
    if samples % gas:
        assert forecast["drift"] == run.planned - run.epoch_ends[-1] > 0


# ---------------------------------------------------------------- DeepSpeed-Chat's loop, watched

def test_watch_holds_a_deepspeed_chat_loop_to_its_epochs_windows_and_changes_nothing():
    """7 micro-batches per epoch, G=3, 2 epochs: the loop plans windows of 3, 3, 1 per epoch (6 updates); the engine
    makes 4, its windows across the epoch's end. The report says so where it happens, as the loop itself saw it."""
    from harness.raw_loops import run_chat_loop
    from stepsync.core.events import Cause
    from stepsync.core.frameworks import DEEPSPEED_LOOP

    watched, plain = run_chat_loop(7, 3, 2, policy="warn"), run_chat_loop(7, 3, 2)
    report = watched.watch.report
    assert report.framework is DEEPSPEED_LOOP and report.finished and report.active
    assert (watched.engine_steps, watched.updates) == (plain.engine_steps, plain.updates)
    assert plain.updates == [[0, 1, 2], [3, 4, 5], [0, 1, 6], [2, 3, 4]]  # the engine's windows, read from the weights
    assert (report.trainer_steps, report.engine_steps) == (plain.planned, plain.scheduler_steps) == (6, 4)
    # +1 at epoch 1's end, +2 at epoch 2's, one cause: one entry, said where it started, with where it stood last
    assert [(e.epoch, e.micro_batch, e.drift, e.cause, e.changes, e.last) for e in report.events] == [
        (1, 7, 1, Cause.PARTIAL_WINDOW, 2, (2, 7, 6, 4))]
    assert [(row.trainer_steps, row.engine_steps) for row in report.epochs] == [(3, 2), (6, 4)]
    assert [row.engine_steps for row in report.forecast.epochs] == plain.epoch_ends
    assert report.forecast_mismatches == []
    assert report.unapplied_micro_batches == plain.unapplied == 2


def test_sync_makes_a_deepspeed_chat_loop_update_at_its_own_windows():
    """policy 'sync': each epoch's last partial window is closed: 6 updates, the windows the loop planned, the LR
    schedule finished."""
    from harness.raw_loops import run_chat_loop

    run = run_chat_loop(7, 3, 2, stage=2, policy="sync")
    report = run.watch.report
    assert run.updates == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2], [3, 4, 5], [6]]
    assert run.epoch_ends == [3, 6] and run.scheduler_steps == run.planned == 6
    assert (report.trainer_steps, report.engine_steps, report.events) == (6, 6, [])
    assert report.unapplied_micro_batches == 0 and report.forecast.drift == 0


def test_raise_stops_a_deepspeed_chat_loop_before_the_partial_window_it_forecasts():
    from harness.raw_loops import run_chat_loop
    from stepsync.core.errors import StepDriftError

    run = run_chat_loop(7, 3, 2, policy="raise")
    assert isinstance(run.error, StepDriftError)  # the forecast's first drift: epoch 1's partial window
    assert (run.error.event.epoch, run.error.event.micro_batch, run.error.event.drift) == (1, 7, 1)
    assert run.error.event.where == "forecast" and run.engine_steps == [] and run.updates == []


# ---------------------------------------------------------------- open-instruct's learner: K backward() per step()

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_several_backwards_per_step_lose_micro_batches_on_zero_1_and_2_and_the_watch_counts_each(stage):
    """K=4 backward() calls, then step(), the config's G=1, 2 steps: ZeRO 1 and 2 apply only the last micro-batch of
    each window (read from the weights, with and without the watch alike); the report counts the 6 others."""
    from harness.raw_loops import run_learner_loop

    plain, watched = run_learner_loop(4, 2, stage), run_learner_loop(4, 2, stage, policy="warn")
    replaces = stage in (1, 2)
    assert plain.shares == watched.shares == ([0.0, 0.0, 0.0, 1.0] * 2 if replaces else [1.0] * 8)
    assert plain.engine_steps == watched.engine_steps == [1, 2]
    report = watched.watch.report
    assert (report.trainer_steps, report.engine_steps, report.events) == (2, 2, [])
    assert [lost.kept for lost in report.lost_gradients] == ([(1, 4), (1, 4)] if replaces else [])
    assert report.lost_micro_batches == (6 if replaces else 0)
    assert [(lost.epoch, lost.micro_batch, lost.engine_steps) for lost in report.lost_gradients] == (
        [(1, 4, 1), (1, 8, 2)] if replaces else [])
    assert ("trained nothing" in str(report)) is replaces


@pytest.mark.parametrize("stage, bf16", [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True)])
def test_sync_makes_each_step_one_update_of_every_micro_batch(stage, bf16):
    """policy 'sync': the boundary is set at no backward(), then at the step() (on ZeRO 1 and 2 one backward() of a
    zero loss closes the window): every micro-batch applied whole, one update per step()."""
    from harness.raw_loops import run_learner_loop

    run = run_learner_loop(4, 2, stage, bf16=bf16, policy="sync")
    assert run.error is None and run.shares == [1.0] * 8 and run.engine_steps == [1, 2]
    report = run.watch.report
    assert (report.trainer_steps, report.engine_steps, report.lost_gradients, report.events) == (2, 2, [], [])


@pytest.mark.parametrize("stage", [1, 2])
def test_sync_given_the_loops_k_sets_the_boundary_before_its_kth_backward(stage):
    """gradient_accumulation_steps=4 given to the watch, windows of 4, 4 and 3: the boundary set before each window's
    4th backward(), the shorter last window closed at its step(). Every micro-batch applied whole, and the backward
    passes that reach the weight (a tensor hook, apart from stepsync) are the loop's 11 and one closing pass, where
    the watch told nothing closes each window (14), and says how to save it."""
    from harness.raw_loops import run_learner_loop

    told, untold = (run_learner_loop([4, 4, 3], 0, stage, policy="sync", stated=k) for k in (4, None))
    for run in (told, untold):
        assert run.error is None and run.shares == [1.0] * 11 and run.engine_steps == [1, 2, 3]
        report = run.watch.report
        assert (report.trainer_steps, report.engine_steps, report.lost_gradients, report.events) == (3, 3, [], [])
    assert (told.gradient_passes, untold.gradient_passes) == (12, 14)
    # no dataloader given: said once, in the loop's words (not also in the Trainer's)
    assert [note for note in told.watch.report.notes if "length" in note] == [
        "no dataloader length: pass dataloader=... (one with a length) to stepsync.watch() to tell its epochs apart "
        "and for a forecast"]
    assert not [note for note in told.watch.report.notes if "gradient_accumulation_steps" in note]
    assert [note for note in untold.watch.report.notes if "gradient_accumulation_steps" in note] == [
        "policy 'sync' closes each window of your loop at its step() with one more backward() (of a zero loss: it "
        "adds nothing); if your loop calls backward() 4 times before each step(), pass gradient_accumulation_steps=4 "
        "to stepsync.watch() to have the boundary set before the 4th instead"]


@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_a_window_longer_than_the_k_given_is_said_and_its_loss_counted_as_the_weights_show(policy):
    """ZeRO-2, gradient_accumulation_steps=4 given, windows of 4 then 6. Under sync the boundary was set before the
    second window's 4th backward(); at its 5th the watch says so (and, where the release replaces a boundary's
    gradients at the next one, that the window's first micro-batches are lost) and closes later windows at their
    step(). What the report counts lost is what the weights show; warn changes nothing (the weights are the
    unwatched loop's)."""
    from harness.raw_loops import run_learner_loop
    from stepsync.core.versions import installed_version
    from stepsync.core.weights import SeveralBackwards, several_backwards

    release = several_backwards(installed_version("deepspeed"))
    if release is SeveralBackwards.FAILS:
        pytest.skip("ZeRO-2 of this release fails at a second backward(): sync refuses such loops")
    run = run_learner_loop([4, 6], 0, 2, policy=policy, stated=4)
    report = run.watch.report
    if policy == "warn":
        assert run.shares == run_learner_loop([4, 6], 0, 2).shares
    lost = [i for i, share in enumerate(run.shares) if share == 0]
    assert report.lost_micro_batches == len(lost)
    said = [note for note in report.notes if "gradient_accumulation_steps=4 it gave" in note]
    assert len(said) == 1 and said[0].startswith("your loop called backward() 5 times before step(), more than")
    replaced = policy == "sync" and release is SeveralBackwards.REPLACES
    assert ("so that window's first micro-batches are lost" in said[0]) is replaced
    assert ("from here each window is closed at its step()" in said[0]) is (policy == "sync")  # warn closes none
    if policy == "sync":
        assert lost == ([4, 5, 6, 7] if replaced else []) and run.engine_steps == [1, 2]
        assert not any("or use policy='sync'" in note for note in report.notes)


@pytest.mark.parametrize("stage", [1, 2])
def test_raise_stops_before_an_update_that_would_lose_micro_batches(stage):
    from harness.raw_loops import run_learner_loop
    from stepsync.core.errors import GradientsLostError

    run = run_learner_loop(4, 2, stage, policy="raise")
    assert isinstance(run.error, GradientsLostError) and run.error.lost.kept == (1, 4)
    assert run.engine_steps == [] and run.shares == [0.0] * 8  # nothing of that update was applied


def test_the_loops_own_fix_and_deepspeeds_unmanaged_accumulation_lose_nothing_and_are_said_nothing():
    """The loop that sets the boundary itself before each backward(), and a config with
    "managed_gradient_accumulation": false (each step() the boundary): every micro-batch applied, nothing reported;
    'sync' leaves the unmanaged engine alone, saying why."""
    from harness.raw_loops import run_learner_loop

    for run in (run_learner_loop(4, 2, 2, set_boundary=True, policy="warn"),
                run_learner_loop(4, 2, 2, managed=False, policy="warn")):
        report = run.watch.report
        assert run.shares == [1.0] * 8 and run.engine_steps == [1, 2]
        assert (report.trainer_steps, report.engine_steps, report.lost_gradients, report.events) == (2, 2, [], [])
        assert not any("backward()" in note for note in report.notes)
    unmanaged = run_learner_loop(4, 2, 2, managed=False, policy="sync")
    assert unmanaged.shares == [1.0] * 8
    assert any("managed_gradient_accumulation is false" in note for note in unmanaged.watch.report.notes)


def test_several_backwards_per_step_with_the_configs_g_drift_with_their_cause_named():
    """The config's G=2 with K=4 backward() calls per step(): the engine updates at every 2nd step() and on ZeRO-2
    keeps only the last micro-batch of the 8; the drift's cause and the fix are named. 'sync' makes each step() an
    update and says that DeepSpeed still divides each loss by 2."""
    from harness.raw_loops import run_learner_loop
    from stepsync.core.events import Cause

    run = run_learner_loop(4, 2, 2, gas=2, policy="warn")
    report = run.watch.report
    assert run.engine_steps == [0, 1] and run.shares == [0.0] * 7 + [1.0]
    assert [(e.micro_batch, e.drift, e.cause) for e in report.events] == [(4, 1, Cause.BACKWARDS_PER_STEP)]
    assert "set gradient_accumulation_steps to 1" in report.events[0].remedy
    assert [lost.kept for lost in report.lost_gradients] == [(1, 8)]
    synced = run_learner_loop(4, 2, 2, gas=2, policy="sync")
    assert synced.engine_steps == [1, 2] and synced.shares == [1.0] * 8  # each micro-batch weighs 1 / (4 * 2)
    assert any("still divides each micro-batch's loss by 2" in note for note in synced.watch.report.notes)


def test_watch_given_an_engine_refuses_what_it_cannot_do():
    from harness.raw_loops import run_learner_loop
    from stepsync.core.errors import StepSyncConfigError

    for policy, fix in (("realign", "adopt watch.report.engine_steps"), ("drop_last", "partial window in your loop")):
        with pytest.raises(StepSyncConfigError, match=fix):
            run_learner_loop(4, 1, 0, policy=policy)
    with pytest.raises(StepSyncConfigError, match=r"^gradient_accumulation_steps=0: pass the backward\(\) calls your "
                                                  r"loop makes before each step\(\), or leave it out$"):
        run_learner_loop(4, 1, 0, policy="sync", stated=0)


def test_two_ranks_lose_the_same_micro_batches_and_sync_and_raise_act_on_both(tmp_path):
    """2 ranks (torchrun, gloo), ZeRO-2, K=4: each update holds each rank's last micro-batch only (the weights, every
    sample of both ranks); both ranks report the same loss, 'sync' applies all 16 micro-batches, 'raise' stops both
    before the first update."""
    from harness.paths import entry_script
    from harness.runs import two_ranks

    *ranks, _ = two_ranks(entry_script("raw_loop_ranks.py"), tmp_path)
    assert ranks[0] == ranks[1]  # every rank saw the same weights, counts and losses
    seen = ranks[0]
    assert seen["none"]["world_size"] == 2
    kept_last = [0.0] * 6 + [1.0] * 2  # samples 6 and 7 are the two ranks' 4th micro-batch of the first step
    assert seen["none"]["shares"] == seen["warn"]["shares"] == kept_last * 2
    assert seen["warn"]["counts"] == [2, 2] and seen["warn"]["lost"] == [[1, 4], [1, 4]]
    assert seen["sync"]["shares"] == [1.0] * 16 and seen["sync"]["lost"] == [] and seen["sync"]["counts"] == [2, 2]
    assert seen["raise"]["error"] == "GradientsLostError" and seen["raise"]["shares"] == [0.0] * 16
    assert seen["raise"]["engine_steps"] == []


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_a_resume_whose_schedule_starts_over_is_said(tmp_path, policy):
    """6 micro-batches an epoch, G=3 (no drift), resumed from epoch_0 with engine.load_checkpoint(...,
    load_lr_scheduler_states=False): the engine's count comes back, its LR schedule
    does not (the truth: the scheduler's own last_epoch). Said before the first micro-batch, with the file that holds
    it; raise stops there. Loaded whole, nothing is said."""
    from harness.raw_loops import run_chat_loop
    from stepsync.core.errors import UnsafeCheckpointError

    full = run_chat_loop(6, 3, 2, policy="warn", save_to=str(tmp_path))
    saved_at = full.epoch_ends[0]  # the engine's count at epoch_0's save
    whole = run_chat_loop(6, 3, 2, policy=policy, resume_from=str(tmp_path / "epoch_0"))
    assert whole.error is None and not [n for n in whole.watch.report.notes if "LR schedule" in n]
    restarted = run_chat_loop(6, 3, 2, policy=policy, resume_from=str(tmp_path / "epoch_0"), load_schedule=False)
    if policy == "raise":
        assert isinstance(restarted.error, UnsafeCheckpointError) and restarted.engine_steps == []
        return
    # the truth: the scheduler took one step per update after the resume, starting from 0, not from saved_at
    assert restarted.scheduler_steps == restarted.epoch_ends[-1] - saved_at
    said = [note for note in restarted.watch.report.notes if "LR schedule" in note]
    assert said == [f"after the resume, the LR schedule (LambdaLR) stands at step 0 where the engine applied "
                    f"{saved_at} update(s): it restarted, and the learning rate follows it; DeepSpeed restores it "
                    "with the engine's count from global_stepN/mp_rank_00_model_states.pt (its lr_scheduler entry) "
                    "only where the checkpoint is loaded with load_lr_scheduler_states=True"]


@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_checkpoints_keep_the_record_and_a_resume_carries_the_report_on(tmp_path, policy):
    """DeepSpeed-Chat's loop saving with engine.save_checkpoint after each epoch, then resumed with
    engine.load_checkpoint from the first epoch's: the record in the folder holds both counts as the loop saw them;
    the save that leaves a micro-batch in DeepSpeed's open window is said; the resumed run's report continues the
    saved one, its counts those the resumed loop itself saw."""
    import json

    from harness.raw_loops import run_chat_loop

    full = run_chat_loop(7, 3, 2, policy=policy, save_to=str(tmp_path))
    record = json.load(open(tmp_path / "epoch_0" / "stepsync_state.json"))
    assert (record["trainer_steps"], record["engine_steps"]) == (3, full.epoch_ends[0])
    assert (record["next_epoch"], record["next_skip"]) == (1, 0)
    open_window = [note for note in full.watch.report.notes if "open window" in note]
    assert bool(open_window) == (policy == "warn")  # sync closes the epoch's last window before the save

    resumed = run_chat_loop(7, 3, 2, policy=policy, resume_from=str(tmp_path / "epoch_0"))
    report = resumed.watch.report
    assert report.resumed_from is not None and report.resumed_from.trainer_steps == 3
    assert (report.trainer_steps, report.engine_steps) == (6, resumed.epoch_ends[-1])
    assert [row.epoch for row in report.epochs] == [2]
    assert report.unapplied_micro_batches == resumed.unapplied
    if policy == "sync":
        assert resumed.updates == [[0, 1, 2], [3, 4, 5], [6]] and report.events == []
    else:  # the engine's window restarts at the resume: 7 micro-batches make 2 updates, 1 never applied
        assert resumed.epoch_ends == [4] and resumed.unapplied == 1
        # the saved event, then its own change with the same cause: one entry
        assert [(e.epoch, e.drift, e.changes, e.last_drift) for e in report.events] == [(1, 1, 2, 2)]


def test_a_skipped_update_is_seen_and_raise_stops_at_it():
    """A micro-batch whose loss is not finite in the first window (ZeRO-2, fp32: DeepSpeed 0.19.8 skips that
    update): the engine counts it, the report keeps it apart, and 'raise' stops there."""
    from harness.raw_loops import run_chat_loop
    from stepsync.core.errors import UpdateSkippedError

    run = run_chat_loop(6, 3, 1, stage=2, policy="warn", nan_at=2)
    report = run.watch.report
    assert run.engine_steps == [0, 0, 1, 1, 1, 2] and run.updates == [[3, 4, 5]]  # the first update applied nothing
    assert (report.engine_steps, report.engine_skipped, report.applied_steps) == (2, 1, 1)
    assert [(skip.epoch, skip.micro_batch, skip.engine_steps) for skip in report.skipped_updates] == [(1, 3, 1)]
    stopped = run_chat_loop(6, 3, 1, stage=2, policy="raise", nan_at=2)
    assert isinstance(stopped.error, UpdateSkippedError) and stopped.engine_steps == [0, 0]


@pytest.mark.parametrize("policy", ["warn", "sync", "raise"])
def test_a_fault_inside_the_watch_never_ends_the_loop_unless_raise(monkeypatch, caplog, policy):
    """A failure inside stepsync at the 4th micro-batch (injected into its own window arithmetic, never into
    DeepSpeed): the loop trains every micro-batch as it would without stepsync from there (the engine's own
    boundary given back), stepsync switches itself off once, saying so; under 'raise' the failure reaches the loop."""
    import logging

    from harness.raw_loops import run_chat_loop
    from stepsync.deepspeed.watch import EngineWatch

    calls = []
    original = EngineWatch._ends_window

    def failing(self, run, position):
        calls.append(position)
        if len(calls) == 3:  # micro-batch 4: the first step() came at 1
            raise RuntimeError("injected failure in the window arithmetic")
        return original(self, run, position)

    monkeypatch.setattr(EngineWatch, "_ends_window", failing)
    with caplog.at_level(logging.ERROR, logger="stepsync"):
        if policy == "raise":  # 6 micro-batches: a forecast without drift, so that raise reaches the failure
            with pytest.raises(RuntimeError, match="injected failure"):
                run_chat_loop(6, 3, 2, policy=policy)
            return
        run = run_chat_loop(7, 3, 2, policy=policy)
    plain = run_chat_loop(7, 3, 2)
    report = run.watch.report
    assert run.error is None and len(run.engine_steps) == 14
    assert not report.active and "injected failure" in report.inactive_reason
    if policy == "warn":
        assert (run.engine_steps, run.updates) == (plain.engine_steps, plain.updates)
    else:  # sync steered the first window; from the fault the engine counts on its own
        assert run.updates[0] == [0, 1, 2] and len(run.engine_steps) == 14
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "switched itself off" in r.getMessage()]
    assert len(errors) == 1


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_a_loop_whose_backward_the_watch_cannot_see_is_not_reported_on(policy):
    """loss.backward() in place of engine.backward(loss) (DeepSpeed 0.19 accepts it on ZeRO 1-3): the watch sees
    step() calls without micro-batches, so it says it cannot count them and watches no further (never a report of
    updates it did not see); under 'raise' it stops there."""
    from harness.raw_loops import run_learner_loop
    from stepsync.core.errors import StepSyncConfigError

    plain = run_learner_loop(4, 2, 2, torch_backward=True)
    watched = run_learner_loop(4, 2, 2, torch_backward=True, policy=policy)
    report = watched.watch.report
    if policy == "raise":
        assert isinstance(watched.error, StepSyncConfigError) and watched.engine_steps == []
        return
    assert watched.error is None and (watched.engine_steps, watched.shares) == (plain.engine_steps, plain.shares)
    assert not report.active and "cannot count its micro-batches" in report.inactive_reason
    assert report.events == [] and report.lost_gradients == []


def test_check_forecasts_the_watched_loop_under_sync():
    """`stepsync check --framework deepspeed --policy sync` before the run, against the run the watch made under
    sync: the loop's windows and the engine's updates, epoch by epoch."""
    import json

    from harness.cli import stepsync
    from harness.raw_loops import run_chat_loop

    run = run_chat_loop(7, 3, 2, policy="sync")
    proc = stepsync("check", "--framework", "deepspeed", "--micro-batches-per-epoch", "7", "--gas", "3", "--epochs",
                    "2", "--policy", "sync", "--json")
    forecast = json.loads(proc.stdout)
    assert proc.returncode == 0 and forecast["drift"] == 0
    assert [epoch["engine_steps"] for epoch in forecast["epochs"]] == run.epoch_ends == [3, 6]
    assert [(row.trainer_steps, row.engine_steps) for row in run.watch.report.epochs] == [
        (epoch["trainer_steps"], epoch["engine_steps"]) for epoch in forecast["epochs"]]


@pytest.mark.parametrize("framework", [None, "deepspeed"])
def test_inspect_reads_a_loops_engine_checkpoints(tmp_path, framework):
    """engine.save_checkpoint(save_dir, tag=f"epoch_{e}") after every epoch of the chat loop (7 micro-batches, G=3,
    warn: the engine's windows cross the epoch's end): inspect reads each tag folder, told by its files or with
    --framework deepspeed, holds DeepSpeed's step (from its files) against the loop's count (stepsync's record), and
    says what a resume from it inherits; the truth is the loop's own count and the engine's at each save."""
    import json

    from harness.cli import stepsync
    from harness.raw_loops import run_chat_loop

    full = run_chat_loop(7, 3, 2, policy="warn", save_to=str(tmp_path))
    args = ["inspect", str(tmp_path), "--json", "--quick"] + (["--framework", framework] if framework else [])
    proc = stepsync(*args)
    data = json.loads(proc.stdout)
    rows = {c["name"]: (c["trainer_step"], c["deepspeed_step"], c["drift"]) for c in data["checkpoints"]}
    loop_counts = [3, 6]  # the loop's windows: 3 an epoch (3, 3, 1)
    assert rows == {f"epoch_{e}": (loop_counts[e], full.epoch_ends[e], loop_counts[e] - full.epoch_ends[e])
                    for e in (0, 1)}
    assert proc.returncode == (1 if any(drift for *_, drift in rows.values()) else 0)
    flat = " ".join(stepsync(*[a for a in args if a != "--json"]).stdout.split())
    assert "your loop's DeepSpeed" in flat and "trainer_state" not in flat  # the loop's columns
    if any(drift for *_, drift in rows.values()):
        assert "engine.set_gradient_accumulation_boundary(True) before its last backward()" in flat
