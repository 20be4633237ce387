"""A Trainer run written as transformers' own ``examples/pytorch/language-modeling/run_clm.py`` writes it, saved and
resumed from its checkpoints under every policy, with stepsync added as docs/trainer.md says (one callback).

What it follows of run_clm.py: a text file read with ``datasets.load_dataset("text", ...)``, tokenized, then
concatenated and cut into blocks by its ``group_texts``; the Trainer with ``default_data_collator`` and
``processing_class``; ``trainer.train(resume_from_checkpoint=...)``, then ``save_model``, ``log_metrics``,
``save_metrics`` and ``save_state`` (which writes ``trainer_state.json`` at the output folder's root). What it changes
to run offline: a tiny GPT-2 built from a config and a word-level tokenizer built in the test, in place of a hub
model and the Hub's data sets. The script itself is not copied here.

The truth is the independent recorder (harness.runs.recorder): both counters after every micro-batch, and what each
micro-batch's ``training_step`` returned, which the Trainer sums into ``train_loss``.
"""
import os
from itertools import chain

import pytest

from harness.stack import DRIFTS, STACK, needs_stack

pytestmark = [needs_stack, pytest.mark.integration,
              pytest.mark.skipif(STACK not in ("", "drifting"), reason="run on the drifting stack (datasets, TRL)")]

BLOCK, BLOCKS, G, EPOCHS = 8, 10, 3, 3  # 10 blocks a epoch: windows of 3, 3, 3 and 1


def clm_datasets(tmp_path):
    """run_clm.py's preprocessing of a local text file: tokenize, then group_texts into blocks of BLOCK tokens."""
    datasets = pytest.importorskip("datasets")
    from harness.tokenizer import tiny_tokenizer

    tokenizer, words = tiny_tokenizer()
    text = tmp_path / "train.txt"
    text.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(BLOCK)) for i in range(BLOCKS)))
    raw = datasets.load_dataset("text", data_files={"train": str(text)})
    tokenized = raw.map(lambda examples: tokenizer(examples["text"]), batched=True, remove_columns=["text"])

    def group_texts(examples):  # as run_clm.py's
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = (len(concatenated["input_ids"]) // BLOCK) * BLOCK
        result = {k: [t[i:i + BLOCK] for i in range(0, total, BLOCK)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    return tokenizer, tokenized.map(group_texts, batched=True)["train"]


def train_as_run_clm(out, policy, resume=None):
    """One run_clm.py run (its training part) with StepSyncCallback, a checkpoint at every update; returns the
    Trainer, the callback, the recorder's record and the loss of every micro-batch."""
    from transformers import Trainer, default_data_collator

    from harness.runs import Recording, recorder
    from stepsync import StepSyncCallback
    from stepsync.tools.tiny_run import cpu_distributed_env, tiny_model, training_args

    cpu_distributed_env()
    tokenizer, train_dataset = clm_datasets(out.parent)
    assert len(train_dataset) == BLOCKS
    losses, recording, trainer_ref = [], Recording(), []

    class LossRecording(Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    callback = StepSyncCallback(policy, console=False)
    args = training_args(str(out), G, EPOCHS, stage=2, save_strategy="steps", save_steps=1)
    trainer = LossRecording(model=tiny_model(), args=args, train_dataset=train_dataset, processing_class=tokenizer,
                            data_collator=default_data_collator,
                            callbacks=[recorder(trainer_ref, recording), callback])
    trainer_ref.append(trainer)
    train_result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    return trainer, callback.report, recording, losses


def check_against_the_recorder(trainer, report, recording, losses):
    state, engine = trainer.state, trainer.model_wrapped
    assert (report.trainer_steps, report.engine_steps) == (state.global_step, engine.global_steps)
    assert [(row.trainer_steps, row.engine_steps) for row in report.epochs] == recording.epoch_ends
    assert report.forecast_mismatches == [] and report.finished
    assert all(event.cause.name != "UNEXPLAINED" for event in report.events)
    assert all(event.drift != event.previous_drift for event in report.events)  # never a "+0" change
    # train_loss: the losses summed over the updates counted; under realign (the count follows the engine's) those of
    # the micro-batches the engine applied, over its updates (none applied: the Trainer's 0.0 for a run of no update)
    if report.policy.follows_the_engine:
        updates = recording.engine_updates_at
        expected = sum(losses[:updates[-1]]) / len(updates) if updates else 0.0
    else:
        expected = sum(losses) / len(recording.trainer_updates_at)
    assert state.log_history[-1]["train_loss"] == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    runs = {}
    for policy in ("warn", "sync", "realign", "drop_last"):
        out = tmp_path_factory.mktemp(policy) / "out"
        runs[policy] = (out, train_as_run_clm(out, policy))
    return runs


@pytest.mark.parametrize("policy", ["warn", "sync", "realign", "drop_last"])
def test_the_fresh_run_and_its_output_folder(saved, policy):
    from stepsync.tools.audit import audit_output_dir

    out, (trainer, report, recording, losses) = saved[policy]
    check_against_the_recorder(trainer, report, recording, losses)
    assert (out / "trainer_state.json").is_file()  # save_state's, at the root
    audit = audit_output_dir(str(out))
    folders = sorted(name for name in os.listdir(out) if name.startswith("checkpoint-"))
    assert sorted(item.name for item in audit.checkpoints) == folders
    # Every checkpoint's drift is the one the recorder saw at its save.
    assert [item.drift for item in audit.checkpoints] == [t - e for t, e in recording.saves]
    # And what each save left in the engine's open window (lost on resume): the micro-batches since its last update.
    lost = [at - max([e for e in recording.engine_updates_at if e <= at] or [0]) for at in recording.saved_after]
    assert [item.unapplied_at_save for item in audit.checkpoints] == lost
    assert audit.ok == (not any(item.drift for item in audit.checkpoints) and not any(lost))
    assert audit.ok == (not DRIFTS or policy in ("sync", "drop_last"))


@pytest.mark.parametrize("policy", ["warn", "sync", "realign", "drop_last"])
@pytest.mark.parametrize("at", ["inside the first epoch", "at the first epoch's end", "inside the last epoch"])
def test_a_resume_from_its_checkpoints_is_reported_as_it_happened(saved, tmp_path, policy, at):
    out, (full, full_report, full_recording, _) = saved[policy]
    save = {"inside the first epoch": 1, "at the first epoch's end": 3, "inside the last epoch": -2}[at]
    trainer_steps, _ = full_recording.saves[save]
    folder = out / f"checkpoint-{trainer_steps}"
    trainer, report, recording, losses = train_as_run_clm(tmp_path / "out", policy, resume=str(folder))
    check_against_the_recorder(trainer, report, recording, losses)
    assert report.resumed_from is not None
    final = (full.state.global_step, full.model_wrapped.global_steps)
    if policy in ("sync", "drop_last"):  # the same end as the uninterrupted run
        assert (trainer.state.global_step, trainer.model_wrapped.global_steps) == final
    if policy == "realign" and DRIFTS:  # the end is said: every micro-batch that never reached an update
        record = report.resumed_from
        done_before = record.next_epoch * BLOCKS + record.next_skip
        never_trained = EPOCHS * BLOCKS - done_before - len(recording.engine_steps)
        unapplied = len(recording.engine_steps) - (recording.engine_updates_at or [0])[-1]
        said = [flaw for flaw in report.update_flaws if "never reach an update" in flaw]
        assert bool(said) == bool(never_trained)
        assert not said or (f"the {never_trained + unapplied} micro-batch(es) after it never reach an update "
                            f"({unapplied} trained but never applied, {never_trained} never trained") in said[0]
        assert report.unapplied_micro_batches == unapplied
