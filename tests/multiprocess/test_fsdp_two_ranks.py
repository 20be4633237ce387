"""FSDP2 (fully_shard) and DDP loops on two ranks (torchrun, gloo), and accelerate's loop on the DDP it prepares on a
CPU: where the gradient sync is on decides which micro-batches each update holds. The truth is read from the weights by the loop itself (tests/harness/fsdp_loops.py:
one weight per sample, each update's samples and shares), the loop's meaning is its windows of G (every G-th
micro-batch of an epoch and its last); stepsync's report must equal what the weights show, the same on both ranks."""
import pytest

from harness.paths import entry_script

pytestmark = [pytest.mark.torch, pytest.mark.integration, pytest.mark.twoproc]  # the torch stack runs it too

PER_RANK, G, EPOCHS, WORLD = 5, 2, 2, 2
WINDOWS = [[0, 1], [2, 3], [4]] * EPOCHS  # each update's micro-batches, as the loop means them
WRAPS = ["fsdp", "ddp"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def ranks(run_dir):
    from harness.runs import two_ranks

    return two_ranks(entry_script("fsdp_ranks.py"), run_dir, what="two-rank FSDP2 and DDP loops")[:2]


def held_by_the_weights(updates):
    """(the window's micro-batches each update holds, micro-batches of other windows it holds), from its samples
    moved by their share averaged across the ranks (1)."""
    found = []
    for window, update in zip(WINDOWS, updates):
        micro_batches = {sample // WORLD for sample, share in update if share == 1.0}
        found.append((len(micro_batches & set(window)), len(micro_batches - set(window))))
    return found


def applied_alone_by_the_weights(updates, rank):
    """The micro-batches each update applied on this rank alone: its own samples moved by the whole of theirs
    (WORLD times the average), which the other rank's weights never see."""
    alone = [sorted(sample // WORLD for sample, share in update if share == WORLD) for update in updates]
    assert all(sample % WORLD == rank for update in updates for sample, share in update if share == WORLD)
    return alone


def test_both_ranks_see_the_same_and_fsdp_moves_every_sample_whole(ranks):
    first, second = ranks
    assert first.keys() == second.keys() and all(first[run]["world_size"] == 2 for run in first)
    for run in first:
        for key in ("error", "counts", "unsynced", "unsynced_total", "epochs", "forecast", "ranks_apart"):
            assert first[run][key] == second[run][key], (run, key)
        if run.startswith("fsdp") or "-last-" in run or run.endswith("sync"):
            assert first[run]["updates"] == second[run]["updates"], run
            assert all(share == 1.0 for update in first[run]["updates"] for _, share in update)


@pytest.mark.parametrize("wrap", WRAPS)
def test_a_right_loop_is_left_alone_and_said_right(ranks, wrap):
    plain = ranks[0][f"{wrap}-last-none"]["updates"]
    assert held_by_the_weights(plain) == [(len(window), 0) for window in WINDOWS]
    for policy in ("warn", "raise", "sync"):
        run = ranks[0][f"{wrap}-last-{policy}"]
        assert run["updates"] == plain and run["error"] is None and run["ranks_apart"] is None
        assert run["unsynced"] == [] and run["counts"] == [6, 6] and run["epochs"] == run["forecast"] == [[3, 3],
                                                                                                         [6, 6]]


@pytest.mark.parametrize("sync_at", ["never", "first"])
def test_warn_names_every_fsdp_update_that_does_not_hold_its_window_as_the_weights_show(ranks, sync_at):
    plain, warned = ranks[0][f"fsdp-{sync_at}-none"], ranks[0][f"fsdp-{sync_at}-warn"]
    assert warned["updates"] == plain["updates"]  # warn changes nothing
    truth = held_by_the_weights(plain["updates"])
    if sync_at == "never":
        assert truth == [(0, 0)] * 6  # every update applied nothing
    else:
        assert truth == [(1, 0), (1, 1), (1, 1), (1, 0), (1, 1), (1, 1)]
    said = [(update, window, held, earlier) for update, window, held, earlier, alone in warned["unsynced"]]
    assert said == [(k + 1, len(window), held, earlier) for k, (window, (held, earlier)) in
                    enumerate(zip(WINDOWS, truth))]
    assert not any(alone for *_, alone in warned["unsynced"])
    assert warned["unsynced_total"] == 6 and sum("later updates like it are counted" in n for n in warned["notes"]) == 1
    assert "gradient sync: 6 update(s) did not hold their window; first update 1 at epoch 1, micro-batch 2" in \
        warned["summary"]


@pytest.mark.parametrize("sync_at", ["never", "first"])
def test_warn_names_every_ddp_update_that_applies_micro_batches_on_one_rank_alone(ranks, sync_at):
    """DDP applies the micro-batches after a window's last synced backward at once, each on its own rank: nothing
    waits for a later update (unlike FSDP2), and the ranks' weights part, which the ranks' comparison finds."""
    for rank in (0, 1):
        plain, warned = ranks[rank][f"ddp-{sync_at}-none"], ranks[rank][f"ddp-{sync_at}-warn"]
        assert warned["updates"] == plain["updates"]  # warn changes nothing
        truth = held_by_the_weights(plain["updates"])
        alone = applied_alone_by_the_weights(plain["updates"], rank)
        assert [held + len(own) for (held, _), own in zip(truth, alone)] == [len(w) for w in WINDOWS]
        assert all(earlier == 0 for _, earlier in truth)
        expected = [(k + 1, len(window), held, 0, True) for k, (window, (held, _)) in enumerate(zip(WINDOWS, truth))
                    if held != len(window)]
        assert [tuple(u) for u in warned["unsynced"]] == expected
    warned = ranks[0][f"ddp-{sync_at}-warn"]
    assert len(warned["unsynced"]) == (6 if sync_at == "never" else 4)  # "first" syncs the one-micro-batch windows
    assert warned["ranks_apart"] == ("the 2 ranks' copies of the weights differ at update 3 (found at the epoch end, "
                                     "epoch 1, micro-batch 5; they agreed after update 0)")
    assert "each on its own rank alone" in warned["summary"] or "applied its own micro-batches alone" in \
        warned["summary"]


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("sync_at", ["never", "first"])
def test_raise_stops_before_the_first_such_update_applies_anything(ranks, wrap, sync_at):
    stopped = ranks[0][f"{wrap}-{sync_at}-raise"]
    assert stopped["error"].startswith("GradientSyncError: update 1 at epoch 1, micro-batch 2")
    assert stopped["updates"] == [] and stopped["counts"] == [0, 0]  # the optimizer never stepped


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("sync_at", ["never", "first"])
def test_sync_makes_every_update_hold_its_window_exactly(ranks, wrap, sync_at):
    synced = ranks[0][f"{wrap}-{sync_at}-sync"]
    assert synced["updates"] == ranks[0][f"{wrap}-last-none"]["updates"]  # the loop as meant, weight for weight
    assert synced["unsynced"] == [] and synced["error"] is None and synced["counts"] == [6, 6]
    assert synced["ranks_apart"] is None


def test_an_accelerate_loop_without_deepspeed_is_watched_through_the_ddp_it_prepared(ranks):
    """stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=G) with what accelerator.prepare
    returned, on Accelerator(cpu=True, fsdp_plugin=...) under torchrun: accelerate drops the FSDP plugin on a CPU and
    wraps the model in DDP, which the watch says at its start; the loop under accelerator.accumulate(model) holds
    each window whole (as the weights show), and the same loop with every backward under
    accelerator.no_sync(model) is named update by update, its ranks apart."""
    if "accelerate-last-none" not in ranks[0]:
        pytest.skip("accelerate is not installed (the torch stack)")
    plain = ranks[0]["accelerate-last-none"]["updates"]
    assert held_by_the_weights(plain) == [(len(window), 0) for window in WINDOWS]
    dropped = ("accelerate was asked for FSDP and did not shard the model (wrapped in DDP: accelerate shards with "
               "FSDP on GPUs only, as measured on a CPU): every rank holds and trains a whole copy")
    for policy in ("warn", "sync"):
        run = ranks[0][f"accelerate-last-{policy}"]
        assert run["updates"] == plain and run["unsynced"] == [] and run["counts"] == [6, 6]
        assert run["epochs"] == run["forecast"] == [[3, 3], [6, 6]] and run["notes"] == [dropped]
    for rank in (0, 1):
        slipped, warned = ranks[rank]["accelerate-never-none"], ranks[rank]["accelerate-never-warn"]
        assert warned["updates"] == slipped["updates"]
        assert held_by_the_weights(slipped["updates"]) == [(0, 0)] * 6
        assert applied_alone_by_the_weights(slipped["updates"], rank) == WINDOWS
        assert [tuple(u) for u in warned["unsynced"]] == [(k + 1, len(w), 0, 0, True) for k, w in enumerate(WINDOWS)]
    assert ranks[0]["accelerate-never-warn"]["ranks_apart"].startswith("the 2 ranks' copies of the weights differ")
    assert all(dropped not in ranks[0][run]["notes"] for run in ranks[0] if run.startswith("ddp-") and
               ranks[0][run]["notes"] is not None)  # a DDP loop no one asked to shard


def test_a_checkpoint_saved_on_two_ranks_inside_an_epoch_is_said_where_one_rank_resumes_it(ranks, run_dir):
    """The FSDP2 loop saved with torch.distributed.checkpoint on two ranks after 2 of each rank's 5 micro-batches;
    one process loads it (DCP reshards the weights): the report carries on from the record, and the resume on another
    number of ranks inside an epoch is said, since the data position is the loop's own."""
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    import stepsync
    from stepsync.tools.tiny_run import cpu_distributed_env

    if not dist.is_initialized():
        cpu_distributed_env()
        dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.Module()
    model.layer = torch.nn.Linear(PER_RANK * WORLD, 1, bias=False)
    model.forward = lambda rows: model.layer(rows)
    fully_shard(model.layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.eye(PER_RANK * WORLD)), batch_size=1)
    watch = stepsync.watch(model, optimizer=optimizer, gradient_accumulation_steps=G, dataloader=loader,
                           num_epochs=1, console=False)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(str(run_dir), "dcp-inside-epoch-1"))
    model(torch.eye(PER_RANK * WORLD)[:1]).sum().backward()
    report = watch.close()
    assert report.resumed_from is not None and report.resumed_from.world_size == 2
    assert (report.resumed_from.trainer_steps, report.resumed_from.next_skip) == (1, 2)
    # the truth: the two ranks had trained samples i * 2 + r of their first 2 micro-batches; one rank that skips
    # as many micro-batches trains samples 2 .. 9 of the same order
    saved = {i * WORLD + r for i in range(2) for r in range(WORLD)}
    resumed = set(range(2, PER_RANK * WORLD))
    shift = report.resume_shift
    assert shift.repeated == {1: len(saved & resumed)} == {1: 2}
    assert shift.skipped == {} and set(range(PER_RANK * WORLD)) == saved | resumed
    said = [note for note in report.notes if note.startswith("checkpoint saved on 2 rank(s)")]
    assert said == [f"checkpoint saved on {shift.saved.describe()}, resumed on {shift.resumed.describe()}: "
                    "torch.distributed.checkpoint reshards the weights and the optimizer's state, not the data "
                    "position: a loop that skips the 2 micro-batch(es) each rank had done of epoch 1 resumes at "
                    "sample 2 of its order, while the run stood at epoch 1, sample 4; it will train 2 sample(s) "
                    "twice (2 of epoch 1); resume from a checkpoint saved at an epoch's end, or on the 2 rank(s) it "
                    "was saved on"]
