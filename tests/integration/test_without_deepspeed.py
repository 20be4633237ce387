"""The Trainer without DeepSpeed (one process here; DDP in tests/multiprocess/test_resume_on_other_ranks.py): the
callback watches the run, holds the Trainer's count against the optimizer's steps and forecasts what the Trainer
plans. The truth is the model's parameters, read after every micro-batch beside stepsync: an update is a micro-batch
after which they moved. Runs on every Trainer stack: each release's counting and planning, measured.
"""
import pytest
from packaging.version import Version

from harness.runs import forget_deepspeed, run
from harness.stack import INSTALLED, needs_stack

pytestmark = needs_stack


@pytest.fixture(autouse=True)
def no_deepspeed_left_on():
    forget_deepspeed()  # earlier runs in this process left DeepSpeed switched on


def parameter_watcher(moved_at: list, epoch_ends: list):
    """A callback that records the micro-batches (1-based, over the run) after which the parameters moved, and the
    micro-batch count at every epoch end."""
    from transformers import TrainerCallback

    class Watcher(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.model, self.micro_batches = model, 0
            self.before = self.snapshot()

        def snapshot(self):
            return [p.detach().clone() for p in self.model.parameters()]

        def after(self):
            self.micro_batches += 1
            now = self.snapshot()
            if any(not a.equal(b) for a, b in zip(now, self.before)):
                moved_at.append(self.micro_batches)
            self.before = now

        def on_substep_end(self, args, state, control, **kwargs):
            self.after()

        def on_step_end(self, args, state, control, **kwargs):
            self.after()

        def on_epoch_end(self, args, state, control, **kwargs):
            epoch_ends.append(self.micro_batches)

    return Watcher()


@pytest.mark.parametrize("n, g, epochs", [(10, 4, 2), (5, 2, 3), (7, 3, 2), (3, 4, 2)])
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_the_trainer_without_deepspeed_is_watched_against_its_optimizer(tmp_path, n, g, epochs, policy):
    moved_at, epoch_ends = [], []
    result = run(tmp_path, n, g, epochs, policy=policy, deepspeed=False,
                 extra_callbacks=[parameter_watcher(moved_at, epoch_ends)])
    assert result.error is None
    report = result.callback.report
    updates = len(moved_at)
    assert updates == result.trainer.state.global_step > 0
    assert (report.active, report.updater, report.trainer_steps, report.engine_steps, report.events) == \
        (True, "optimizer", updates, updates, [])
    assert f"Trainer {updates} updates, optimizer {updates} (drift +0)" in str(report)
    assert report.notes[0].startswith("no DeepSpeed: the Trainer's count is held against its optimizer's steps")
    # Each epoch as it ran: micro-batches and updates, equal to the forecast made before the first one.
    seen = []
    for epoch, (start, end) in enumerate(zip([0] + epoch_ends, epoch_ends), 1):
        made = sum(1 for at in moved_at if at <= end)
        seen.append((epoch, end - start, made, made))
    assert [(e.epoch, e.micro_batches, e.trainer_steps, e.engine_steps) for e in report.epochs] == seen
    predicted = report.forecast
    assert [(r.epoch, r.micro_batches, r.trainer_steps, r.engine_steps) for r in predicted.epochs] == seen
    assert report.forecast_mismatches == []
    # A run that stops before the epochs asked (transformers 4.47-4.51 plan floor(N/G) updates per epoch and count
    # ceil(N/G)) is named before it starts, here as with DeepSpeed.
    assert (predicted.ends_early() is not None) == (epoch_ends[-1] < n * epochs)


def test_a_run_without_deepspeed_saves_its_record_in_every_checkpoint(tmp_path):
    from stepsync.core.record import load_record

    result = run(tmp_path, 10, 4, 2, deepspeed=False, save_strategy="steps", save_steps=2)
    assert result.error is None
    steps = sorted(int(folder.name.split("-")[1]) for folder in tmp_path.glob("checkpoint-*"))
    assert steps == list(range(2, result.trainer.state.global_step + 1, 2)) and len(steps) >= 2
    for step in steps:
        record = load_record(str(tmp_path / f"checkpoint-{step}"))
        assert (record.trainer_steps, record.engine_steps, record.world_size, record.gradient_accumulation_steps) \
            == (step, step, 1, 4)


@pytest.mark.skipif(INSTALLED.transformers != "newest" and Version(INSTALLED.transformers) < Version("5.24"),
                    reason="measured on transformers 5.24 (accelerate 1.7 and 1.16); 4.46-4.57 refuse fsdp on a CPU "
                           "before training (accelerate's plugin finds no device for sync_module_states)")
def test_fsdp_the_trainer_cannot_give_on_a_cpu_is_said_at_the_start(tmp_path):
    """TrainingArguments(fsdp="full_shard") on a CPU machine: accelerate wraps the model in DDP (MULTI_CPU, measured
    with transformers 5.24 and accelerate 1.7 on one and two torchrun ranks), no word from either; stepsync says it
    once at the start, and the run is watched as any run without DeepSpeed."""
    import os

    try:
        result = run(tmp_path, 5, 2, 1, deepspeed=False, fsdp="full_shard")
    finally:
        os.environ.pop("ACCELERATE_USE_FSDP", None)  # accelerate sets it for the process: the next run asks none
        forget_deepspeed()
    assert result.error is None and not result.trainer.is_fsdp_enabled
    report = result.callback.report
    said = [note for note in report.notes if note.startswith("accelerate was asked for FSDP")]
    assert said == ["accelerate was asked for FSDP and did not shard the model (distributed_type MULTI_CPU: "
                    "accelerate shards with FSDP on GPUs only, as measured on a CPU): every rank holds and trains a "
                    "whole copy"]
    assert (report.trainer_steps, report.engine_steps) == (3, 3)


def test_a_run_no_one_asked_to_shard_says_nothing_of_fsdp(tmp_path):
    result = run(tmp_path, 5, 2, 1, deepspeed=False)
    assert not any("FSDP" in note for note in result.callback.report.notes)
