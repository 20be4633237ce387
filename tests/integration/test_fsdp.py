"""stepsync.watch(model, optimizer=...) on an FSDP2 (fully_shard) or DDP loop in one process (gloo, one rank): what
the watch asks, what it refuses, what it gives back, and the loop shapes around it. Two ranks, and the faults as the
weights show them: tests/multiprocess/test_fsdp_two_ranks.py."""
import contextlib

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.integration]  # torch alone: the torch stack runs it too


def sharded():
    """A tiny model sharded with fully_shard (one rank), and its optimizer."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from stepsync.tools.tiny_run import cpu_distributed_env

    if not dist.is_initialized():
        cpu_distributed_env()
        dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_what_the_watch_needs_is_asked_for_by_name():
    import stepsync

    model, optimizer = sharded()
    with pytest.raises(ValueError, match=r"needs the optimizer your loop steps: stepsync.watch\(model, "
                                         r"optimizer=optimizer, gradient_accumulation_steps=G"):
        stepsync.watch(model, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"^gradient_accumulation_steps=None: pass the micro-batches per "
                                         r"optimizer.step\(\) your loop means"):
        stepsync.watch(model, optimizer=optimizer)
    with pytest.raises(ValueError, match=r"^policy 'realign' cannot change your loop's own count: use "
                                         r"policy='sync' or policy='warn'$"):
        stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, policy="realign")
    with pytest.raises(ValueError, match=r"^policy 'drop_last' cannot end your dataloader's epochs early"):
        stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, policy="drop_last")
    with pytest.raises(ValueError, match="optimizer= is for a loop whose model is FSDP2's or DDP's"):
        stepsync.watch(object(), optimizer=optimizer)


def test_close_gives_back_every_method_and_hook_and_a_scheduler_on_the_optimizer_works():
    """The LR scheduler is built after the watch, on the watched optimizer, as a loop builds it: it steps with it."""
    import torch

    import stepsync

    model, optimizer = sharded()
    fsdp_hooks = dict(model._forward_hooks)  # FSDP2's own
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(4),
                           num_epochs=1, console=False, policy="sync")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for i in range(4):
        model(torch.ones(1, 4)).sum().backward()
        if i % 2:
            optimizer.step(), scheduler.step(), optimizer.zero_grad()
    report = watch.close()
    assert scheduler.last_epoch == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 3)
    assert (report.trainer_steps, report.engine_steps, report.unsynced_updates, report.events) == (2, 2, [], [])
    assert "set_requires_gradient_sync" not in vars(model) and "step" not in vars(optimizer)
    assert dict(model._forward_hooks) == fsdp_hooks


def test_a_ddp_model_gets_the_ddp_watch_which_gives_the_sync_back_as_ddp_keeps_it():
    """Under sync the watch turns DDP's require_backward_grad_sync off inside the loop's windows, also inside the
    loop's own no_sync() (as the docstring of torch/nn/parallel/distributed.py's no_sync writes the loop), and gives
    DDP its default back at close."""
    import contextlib

    import torch

    import stepsync
    from stepsync.fsdp.watch import ReplicatedWatch

    sharded()  # the process group
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(3),
                           num_epochs=1, console=False, policy="sync")
    assert isinstance(watch, ReplicatedWatch) and watch.report.framework.key == "ddp"
    seen = []
    for i in range(3):
        with contextlib.nullcontext() if i else model.no_sync():  # the loop's sync: off at 0 only, on at 1 and 2
            model(torch.ones(1, 4)).sum().backward()
            seen.append(model.require_backward_grad_sync)
        if i in (1, 2):
            optimizer.step(), optimizer.zero_grad()
    report = watch.close()
    assert seen == [False, True, True] and model.require_backward_grad_sync is True
    assert (report.trainer_steps, report.engine_steps, report.unsynced_updates) == (2, 2, [])
    assert dict(model._forward_hooks) == {} and dict(model._forward_pre_hooks) == {} and "step" not in vars(optimizer)


def test_an_evaluation_between_epochs_is_no_micro_batch():
    """The loop evaluates after each epoch (model.eval(), forward under no_grad): the watch counts only training."""
    import torch

    import stepsync

    model, optimizer = sharded()
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(3),
                           num_epochs=2, console=False)
    for _ in range(2):
        model.train()
        for i in range(3):
            model.set_requires_gradient_sync(i in (1, 2))
            model(torch.ones(1, 4)).sum().backward()
            if i in (1, 2):
                optimizer.step(), optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            model(torch.ones(1, 4))
    report = watch.close()
    assert [(row.trainer_steps, row.engine_steps, row.micro_batches) for row in report.epochs] == [(2, 2, 3),
                                                                                                   (4, 4, 3)]
    assert report.unsynced_updates == [] and report.forecast_mismatches == []


def test_check_forecasts_the_loops_updates():
    import json

    from harness.cli import stepsync
    from harness.fsdp_loops import run_sharded_loop

    run = run_sharded_loop(5, 2, 2, "last", "warn")
    proc = stepsync("check", "--framework", "fsdp", "--micro-batches-per-epoch", "5", "--gas", "2", "--epochs", "2",
                    "--json")
    forecast = json.loads(proc.stdout)
    assert proc.returncode == 0 and forecast["trainer_steps"] == forecast["engine_steps"] == run.steps == 6
    assert [[row["trainer_steps"], row["engine_steps"]] for row in forecast["epochs"]] == [
        [row.trainer_steps, row.engine_steps] for row in run.watch.report.epochs]


@pytest.mark.parametrize("reduce_dtype", ["float32", None])
def test_the_precision_in_force_is_said_at_the_start_and_bf16_accumulation_loses_what_it_says(reduce_dtype):
    """One weight, two micro-batches in one window (the sync off for the first), gradients 256 and 1, plain SGD at lr
    1: accumulated in float32 the update is 257; with compute in bfloat16 and no reduce_dtype, FSDP2 accumulates in
    bfloat16 and the 1 is rounded away (256): what the start's note warns of."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import stepsync

    sharded()  # the process group
    model = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False))
    torch.nn.init.zeros_(model[0].weight)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype else None))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(2),
                           num_epochs=1, console=False)
    for i, x in enumerate((256.0, 1.0)):
        model.set_requires_gradient_sync(i == 1)
        model(torch.tensor([[x]])).sum().backward()
    optimizer.step()
    report = watch.close()
    moved = -model[0].weight.full_tensor().item()
    said = [note for note in report.notes if note.startswith("FSDP2 mixed precision in force")]
    if reduce_dtype:
        assert moved == 257.0
        assert said == ["FSDP2 mixed precision in force: forward and backward in bfloat16, gradients reduced (and "
                        "accumulated over the micro-batches whose sync is off) in float32; the sharded weights and "
                        "the optimizer in float32"]
    else:
        assert moved == 256.0  # the second micro-batch's 1 was rounded away
        assert len(said) == 1 and "in bfloat16 (sums in bfloat16 round away a micro-batch's gradient much smaller " \
            "than the window's; MixedPrecisionPolicy(reduce_dtype=torch.float32) keeps it)" in said[0]


@pytest.mark.parametrize("grad_dtype", ["float32", None])
def test_bfloat16_weights_say_where_their_gradients_are_summed_grad_dtype_or_not(grad_dtype):
    """bfloat16 weights without a MixedPrecisionPolicy, gradients 256 and 1 in one window (the sync off for the
    first): FSDP2 sums them in bfloat16 and the 1 is rounded away (256), also where the parameter's grad_dtype asked
    for float32 before fully_shard (which is gone after it: probes/fsdp_precision.json, torch 2.11.0 - 2.14.1 alike).
    The start's note says so before the first micro-batch, the same either way."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import stepsync

    sharded()  # the process group
    model = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False)).to(torch.bfloat16)
    torch.nn.init.zeros_(model[0].weight)
    if grad_dtype:
        model[0].weight.grad_dtype = getattr(torch, grad_dtype)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(2),
                           num_epochs=1, console=False)
    said_before = list(watch.report.notes)
    for i, x in enumerate((256.0, 1.0)):
        model.set_requires_gradient_sync(i == 1)
        model(torch.tensor([[x]], dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    report = watch.close()
    assert -model[0].weight.full_tensor().float().item() == 256.0  # the second micro-batch's 1 was rounded away
    assert [note for note in said_before if note.startswith("FSDP2 weights in bfloat16")] == [
        "FSDP2 weights in bfloat16 without a MixedPrecisionPolicy: gradients accumulated over the micro-batches "
        "whose sync is off in bfloat16 (sums in it round away a micro-batch's gradient much smaller than the "
        "window's; a float32 grad_dtype set on them before fully_shard does not change that (torch 2.11.0 - 2.14.1, "
        "as probed)); float32 weights with MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32) keep it"]
    assert report.events == []


def test_verify_measures_fsdp2_s_window_as_the_probes_did_on_this_torch():
    """`stepsync verify --framework fsdp` in a child process, each precision the probes measured
    (probes/fsdp_precision.json) on this torch: the same shares and the same small gradients kept or rounded away,
    exit 0 where every one is kept, 1 where one is not."""
    import json
    import os

    from harness.cli import stepsync_process
    from harness.paths import REPO
    from stepsync.core.versions import installed_version

    with open(os.path.join(REPO, "probes", "fsdp_precision.json")) as handle:
        probed = json.load(handle)["releases"].get(installed_version("torch").split("+")[0])
    if probed is None:
        pytest.skip("this torch was not probed")
    flags = {"none": [], "bf16_reduce_fp32": ["--param-dtype", "bfloat16", "--reduce-dtype", "float32"],
             "bf16_weights_grad_dtype_fp32": ["--weights-dtype", "bfloat16", "--grad-dtype", "float32"]}
    for case, given in flags.items():
        row = next(row for row in probed if row["policy"] == case and row["g"] == 4 and not row["late_parameter"])
        proc = stepsync_process("verify", "--framework", "fsdp", "--gas", "4", *given, "--json")
        verdict = json.loads(proc.stdout)
        assert (verdict["shares"], verdict["small_kept"]) == (row["shares"], row["small_kept"]), case
        right = row["small_kept"] == [1.0] * 3
        assert verdict["right"] is right and proc.returncode == (0 if right else 1), (case, proc.stderr)


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_weights_made_not_finite_are_found_at_the_epoch_end_and_raise_stops_there(policy):
    """A loss that is not finite at epoch 1's micro-batch 3: the optimizer applies its gradient (torch checks none),
    the weights are read at the epoch's end (this rank's shards), and raise stops before epoch 2's first micro-batch
    trains."""
    import math

    import torch

    import stepsync
    from stepsync.core.errors import NonFiniteUpdateError

    model, optimizer = sharded()
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(4),
                           num_epochs=2, console=False, policy=policy)
    trained = []
    with pytest.raises(NonFiniteUpdateError) if policy == "raise" else contextlib.nullcontext():
        for epoch in range(2):
            for i in range(4):
                loss = model(torch.ones(1, 4)).sum() * (math.nan if (epoch, i) == (0, 2) else 1.0)
                trained.append((epoch, i))
                loss.backward()
                if i % 2:
                    optimizer.step(), optimizer.zero_grad()
    report = watch.close()
    found = report.non_finite
    assert (found.epoch, found.micro_batch, found.engine_steps, found.each_update) == (1, 4, 2, False)
    assert str(found) == ("an update at or before update 2 (checked at epoch ends) at epoch 1, micro-batch 4 left "
                          "weights that are not finite: a torch optimizer applies every gradient it is given, finite "
                          "or not (torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=True) before "
                          "optimizer.step() stops at the first that is not)")
    # the epoch's end is known at the next micro-batch's forward: raise stops in it
    assert trained == [(0, 0), (0, 1), (0, 2), (0, 3)] + ([] if policy == "raise" else
                                                          [(1, 0), (1, 1), (1, 2), (1, 3)])
    assert any(note.startswith(f"{found}. Your optimizer counts this") for note in report.notes)


@pytest.mark.parametrize("callback", ["FSDP2's", "none"])
def test_fsdp2s_sync_is_read_at_the_backward_where_the_loop_sets_it_after_the_forward(monkeypatch, callback):
    """A loop that turns the sync on between a micro-batch's forward and its backward (its window's last) is right:
    FSDP2 reads the sync at the backward, and so does the watch (one weight per sample: every micro-batch's sample
    moves in its window's update), at FSDP2's own callback after each backward or, on a torch without it, at a hook
    on each micro-batch's output; closing gives FSDP2's states back."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import stepsync
    from stepsync.fsdp import watch as fsdp_watch

    if callback == "none":
        monkeypatch.setattr(fsdp_watch, "FSDP_BACKWARD_CALLBACK", "a_callback_this_torch_lacks")

    sharded()  # the process group
    model = torch.nn.Sequential(torch.nn.Linear(4, 1, bias=False))
    torch.nn.init.zeros_(model[0].weight)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(4),
                           num_epochs=1, console=False)
    moved = []
    for i in range(4):
        loss = model(torch.eye(4)[i:i + 1]).sum()
        model.set_requires_gradient_sync(i % 2 == 1)
        loss.backward()
        if i % 2:
            before = model[0].weight.full_tensor().detach().clone()
            optimizer.step(), optimizer.zero_grad()
            moved.append((before - model[0].weight.full_tensor().detach()).flatten().tolist())
    assert watch._backwards_seen is (callback != "none")
    report = watch.close()
    assert moved == [[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]
    assert report.unsynced_updates == [] and (report.trainer_steps, report.engine_steps) == (2, 2)
    assert fsdp_watch.FSDP_BACKWARD_CALLBACK not in vars(model._get_fsdp_state())


def test_a_ddp_loop_on_one_rank_has_nothing_left_unreduced():
    """On one rank DDP's average is the rank's own gradient: a loop that never turns the sync on trains every
    micro-batch whole (the weights), and the watch names nothing."""
    from harness.fsdp_loops import run_sharded_loop

    sharded()  # the process group, of one rank
    run = run_sharded_loop(5, 2, 2, "never", "warn", "ddp")
    assert run.world == 1 and all(share == 1.0 for update in run.updates for share in update.values())
    assert [sorted(update) for update in run.updates] == [[0, 1], [2, 3], [4]] * 2
    report = run.watch.report
    assert report.unsynced_updates == [] and (report.trainer_steps, report.engine_steps) == (6, 6)


def test_a_window_gradscaler_skips_is_said_dropped_and_nothing_else_moves():
    """fp16's recipe on a CPU (torch.amp.GradScaler("cpu"), as torch's AMP examples write it): a loss that is not
    finite in the first window makes scaler.step skip optimizer.step(), and the loop's zero_grad() clears the window;
    the watch says it trained nothing (the weights: its samples never move), and counts nothing else."""
    import math

    import torch

    import stepsync

    sharded()  # the process group, of one rank
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1, bias=False))
    torch.nn.init.zeros_(model.module.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(4),
                           num_epochs=1, console=False, policy="raise")  # raise: a skip by design stops nothing
    for i in range(4):
        scaler.scale(model(torch.eye(4)[i:i + 1]).sum() * (math.nan if i == 0 else 1.0)).backward()
        if i % 2:
            scaler.step(optimizer), scaler.update(), optimizer.zero_grad()
    report = watch.close()
    assert model.module.weight.detach().flatten().tolist() == [0.0, 0.0, -1.0, -1.0]
    assert (report.windows_dropped, report.trainer_steps, report.engine_steps) == (1, 1, 1)
    assert str(report.dropped_windows[0]).startswith("the window of 2 micro-batch(es) ending at epoch 1, "
                                                     "micro-batch 2 was cleared by optimizer.zero_grad() with no "
                                                     "optimizer.step() after update 0: it trained nothing")
    assert report.unsynced_updates == []


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_zero_grad_inside_the_window_is_said_where_it_clears_a_gradient(wrap):
    """The slip of a loop that calls optimizer.zero_grad() before every micro-batch, the sync on at each window's
    last (G=2, one weight per sample, plain SGD): DDP clears the window's first micro-batch (its sample never moves)
    and the watch says so at each update; FSDP2 keeps an unreduced gradient in its own buffers, so nothing is lost
    and nothing is said (both as measured here)."""
    import contextlib

    import torch
    from torch.distributed.fsdp import fully_shard

    import stepsync

    sharded()  # the process group, of one rank
    inner = torch.nn.Sequential(torch.nn.Linear(4, 1, bias=False))
    torch.nn.init.zeros_(inner[0].weight)
    model = torch.nn.parallel.DistributedDataParallel(inner) if wrap == "ddp" else fully_shard(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(4),
                           num_epochs=1, console=False)
    for i in range(4):
        last = i % 2 == 1
        optimizer.zero_grad()
        if wrap == "ddp":
            with contextlib.nullcontext() if last else model.no_sync():
                model(torch.eye(4)[i:i + 1]).sum().backward()
        else:
            model.set_requires_gradient_sync(last)
            model(torch.eye(4)[i:i + 1]).sum().backward()
        if last:
            optimizer.step()
    report = watch.close()
    weight = inner[0].weight.full_tensor() if wrap == "fsdp" else inner[0].weight
    moved = (-weight.detach()).flatten().tolist()
    if wrap == "fsdp":
        assert moved == [1.0, 1.0, 1.0, 1.0] and report.unsynced_updates == []
    else:
        assert moved == [0.0, 1.0, 0.0, 1.0]
        assert [(u.update, u.window, u.held, u.cleared) for u in report.unsynced_updates] == [(1, 2, 1, 1),
                                                                                             (2, 2, 1, 1)]
        assert str(report.unsynced_updates[0]).startswith(
            "update 1 at epoch 1, micro-batch 2: optimizer.zero_grad() inside the window cleared 1 of the 2 "
            "micro-batches your loop gave it before the update")
    assert report.windows_dropped == 0


def test_a_dcp_checkpoint_keeps_the_record_and_a_resume_carries_the_report_on(tmp_path):
    """torch.distributed.checkpoint as PyTorch's DCP recipe writes it (dcp.save of the model's and the optimizer's
    state dicts, dcp.load into fresh ones): the folder keeps stepsync's record; a job that resumes from it counts on
    from it (updates, the optimizer's steps, the epoch) as the loop does, and its forecast is the rest of the plan."""
    import json
    import os

    import torch
    import torch.distributed.checkpoint as dcp

    import stepsync
    from stepsync.core.record import RECORD_FILE

    def job(resume: bool, epochs_run: range, save_after: int = -1):
        model, optimizer = sharded()
        watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=2, dataloader=range(4),
                               num_epochs=2, console=False)
        if resume:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            dcp.load(state, checkpoint_id=str(tmp_path / "epoch-1"))
            model.load_state_dict(state["model"]), optimizer.load_state_dict(state["optimizer"])
        for epoch in epochs_run:
            for i in range(4):
                model(torch.ones(1, 4)).sum().backward()
                if i % 2:
                    optimizer.step(), optimizer.zero_grad()
                if i == save_after:
                    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                             checkpoint_id=str(tmp_path / f"epoch-{epoch + 1}" if i == 3 else tmp_path / "inside"))
        return watch.close()

    first = job(False, range(1), save_after=3)
    saved = json.load(open(os.path.join(tmp_path, "epoch-1", RECORD_FILE)))
    assert (saved["trainer_steps"], saved["engine_steps"], saved["next_epoch"], saved["next_skip"]) == (2, 2, 1, 0)
    assert (first.trainer_steps, first.engine_steps) == (2, 2)
    resumed = job(True, range(1, 2))
    assert (resumed.trainer_steps, resumed.engine_steps) == (4, 4) and resumed.resumed_from is not None
    assert [(row.epoch, row.trainer_steps, row.engine_steps) for row in resumed.epochs] == [(2, 4, 4)]
    assert [(row.epoch, row.trainer_steps) for row in resumed.forecast.epochs] == [(2, 4)]
    assert resumed.forecast_mismatches == [] and resumed.events == []
    inside = job(False, range(1), save_after=2)  # after micro-batch 3, inside the second window
    said = [note for note in inside.notes if note.startswith("checkpoint inside:")]
    assert said == ["checkpoint inside: it was saved inside your loop's window (1 micro-batch(es) after its last "
                    "update): a checkpoint keeps no gradient, so a resume from it loses them: save after the "
                    "optimizer.step() that closes a window (later saves like it are counted in the report)"]


def test_a_tracker_handed_to_the_watch_gets_each_finding_each_epoch_end_and_the_texts():
    """The sync on at each window's first micro-batch: every update leaves one unreduced (a finding of every
    window). A callable tracker (tests/integration/test_trackers.py has the real ones) gets the forecast, the metrics
    where the first is found, at each epoch end and at the end, and the summary; watch.metrics() is the last."""
    from harness.fsdp_loops import run_sharded_loop
    from stepsync.core.tracking import forecast_text

    got = []
    run = run_sharded_loop(5, 2, 2, "first", "warn", tracker=lambda values, step: got.append((step, values)))
    report = run.watch.report
    assert run.error is None and run.steps == 6 and report.updates_unsynced == 6
    counts = ("stepsync/loop_steps", "stepsync/optimizer_steps", "stepsync/drift", "stepsync/updates_unsynced")
    assert got[0] == (0, {"stepsync/forecast": forecast_text(report.forecast)})
    assert [(step, tuple(values[key] for key in counts)) for step, values in got[1:-1]] == [
        (0, (0, 0, 0, 1)),  # the first, found before update 1 is made
        (3, (3, 3, 0, 3)), (6, (6, 6, 0, 6)),  # each epoch end
        (6, (6, 6, 0, 6))]  # the end
    assert got[-2][1] == run.watch.metrics()
    assert got[-1] == (6, {"stepsync/summary": str(report)})
