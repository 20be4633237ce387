"""Real clients nobody here wrote: TRL's SFTTrainer, and a PEFT LoRA model under ZeRO-2, on the real engine.

Each run is checked against the independent recorder (harness.runs.recorder). They run where TRL and
PEFT are installed (the drifting stack, scripts/stack.sh).
"""
import os

import pytest

from harness.stack import DRIFTS, needs_stack
from harness.tokenizer import tiny_tokenizer

pytestmark = [needs_stack, pytest.mark.integration]

N, G, EPOCHS = 5, 2, 3  # the Trainer counts 3 updates per epoch; a drifting engine makes 7 in all


def check(trainer, callback, recording, policy):
    report = callback.report
    final = (trainer.state.global_step, trainer.model_wrapped.global_steps)
    expected_engine = 7 if DRIFTS and policy == "warn" else 9
    assert final == (9, expected_engine)
    assert (report.trainer_steps, report.engine_steps) == final
    assert [(row.trainer_steps, row.engine_steps) for row in report.epochs] == recording.epoch_ends
    assert [(row.trainer_steps, row.engine_steps) for row in report.forecast.epochs] == recording.epoch_ends
    assert report.forecast_mismatches == [] and report.finished
    assert all("stepsync/drift" in record for record in trainer.state.log_history)
    if policy == "sync":
        assert recording.engine_updates_at == recording.trainer_updates_at


@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_trl_sft_trainer(tmp_path, policy):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from stepsync import StepSyncCallback
    from harness.runs import Recording, recorder
    from stepsync.tools.tiny_run import cpu_distributed_env, deepspeed_config, tiny_model

    cpu_distributed_env()
    tokenizer, words = tiny_tokenizer()
    data = Dataset.from_dict({"text": [" ".join(words[i:i + 6]) for i in range(N)]})
    # On CPU, TRL's default bf16=True must be turned off.
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=G,
                         num_train_epochs=EPOCHS, max_length=16, bf16=False, learning_rate=1e-2, report_to=[],
                         logging_steps=1, save_strategy="no", disable_tqdm=True, use_cpu=True,
                         deepspeed=deepspeed_config(0))
    callback, recording, ref = StepSyncCallback(policy, console=False), Recording(), []
    trainer = trl.SFTTrainer(model=tiny_model(), args=args, train_dataset=data, processing_class=tokenizer,
                             callbacks=[recorder(ref, recording), callback])
    ref.append(trainer)
    trainer.train()
    check(trainer, callback, recording, policy)
    assert checks_epochs(trainer, N, policy) == (N, recording.epoch_ends)


def test_check_of_a_dpo_config_forecasts_the_real_run(tmp_path):
    """TRL's DPOTrainer on DeepSpeed, a pair per micro-batch: check, given its DPOConfig, forecasts each epoch."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from stepsync import StepSyncCallback
    from harness.runs import Recording, recorder
    from stepsync.tools.tiny_run import cpu_distributed_env, deepspeed_config, tiny_model

    cpu_distributed_env()
    tokenizer, words = tiny_tokenizer()
    data = Dataset.from_dict({"prompt": [" ".join(words[i:i + 3]) for i in range(N)],
                              "chosen": [" ".join(words[i + 3:i + 5]) for i in range(N)],
                              "rejected": [" ".join(words[i + 5:i + 7]) for i in range(N)]})
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=G,
                         num_train_epochs=EPOCHS, max_length=16, bf16=False, learning_rate=1e-2, report_to=[],
                         logging_steps=1, save_strategy="no", disable_tqdm=True, use_cpu=True,
                         deepspeed=deepspeed_config(0))
    model = tiny_model()
    model.config.pad_token_id = tokenizer.pad_token_id
    callback, recording, ref = StepSyncCallback("warn", console=False), Recording(), []
    reference = tiny_model()
    reference.config.pad_token_id = tokenizer.pad_token_id
    trainer = trl.DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer,
                             callbacks=[recorder(ref, recording), callback])
    ref.append(trainer)
    trainer.train()
    assert checks_epochs(trainer, N) == (N, recording.epoch_ends)
    assert [(row.trainer_steps, row.engine_steps) for row in callback.report.epochs] == recording.epoch_ends


@pytest.mark.parametrize("policy", ["warn", "sync"])
def test_peft_lora_under_zero_2(tmp_path, policy):
    peft = pytest.importorskip("peft")
    from stepsync import StepSyncCallback
    from harness.runs import run_tiny
    from stepsync.tools.tiny_run import tiny_model

    def lora():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                 task_type="CAUSAL_LM")
        return peft.get_peft_model(tiny_model(), config)

    callback = StepSyncCallback(policy, console=False)
    result = run_tiny(str(tmp_path), samples=N, gas=G, epochs=EPOCHS, stage=2, callback=callback, model=lora())
    assert result.error is None, repr(result.error)
    trainable = [name for name, p in result.trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    check(result.trainer, callback, result.recording, policy)


def checks_epochs(trainer, samples, policy="warn"):
    """``stepsync check --samples SAMPLES --training-args`` on the trainer's own arguments under ``policy``, for the
    installed releases: micro-batches per epoch, and each epoch's (the Trainer's count, the engine's count)."""
    import json

    from harness.cli import stepsync
    from harness.stack import INSTALLED

    path = os.path.join(trainer.args.output_dir, "args.json")
    with open(path, "w") as handle:
        handle.write(trainer.args.to_json_string())
    proc = stepsync("check", "--samples", str(samples), "--training-args", path, "--transformers",
                    INSTALLED.transformers, "--accelerate", INSTALLED.accelerate, "--deepspeed", INSTALLED.deepspeed,
                    "--policy", policy, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    return data["inputs"]["micro_batches_per_epoch"], [(e["trainer_steps"], e["engine_steps"]) for e in data["epochs"]]


def grpo_trainer(tmp_path, policy, steps_per_generation, prompts=6, gas=2, **config):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from stepsync import StepSyncCallback
    from harness.runs import Recording, recorder
    from stepsync.tools.tiny_run import cpu_distributed_env, deepspeed_config, tiny_model

    cpu_distributed_env()
    tokenizer, words = tiny_tokenizer()
    data = Dataset.from_dict({"prompt": [" ".join(words[i:i + 3]) for i in range(prompts)]})
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=gas,
                          num_generations=2, steps_per_generation=steps_per_generation, max_completion_length=4,
                          num_train_epochs=2, bf16=False, learning_rate=1e-2, report_to=[], logging_steps=1,
                          save_strategy="no", disable_tqdm=True, use_cpu=True, deepspeed=deepspeed_config(0), **config)
    callback, recording, ref = StepSyncCallback(policy, console=False), Recording(), []
    model = tiny_model()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
                              args=args, train_dataset=data, processing_class=tokenizer,
                              callbacks=[recorder(ref, recording), callback])
    ref.append(trainer)
    trainer.recording = recording  # the independent recorder's, for the tests that compare with it
    return trainer, callback


@pytest.mark.parametrize("prompts, gas, steps_per_generation", [(10, 3, 3), (9, 2, 4)])
def test_check_of_a_grpo_config_forecasts_the_real_run(tmp_path, prompts, gas, steps_per_generation):
    """TRL's generation sampler sizes GRPO's epochs (each chunk of prompts repeated, an incomplete one dropped): 10
    prompts, batch 2, num_generations 2, steps_per_generation 3 make 9 micro-batches an epoch, not 10 / 2 = 5.
    check, given the run's own GRPOConfig, forecasts what the Trainer and the engine did, epoch by epoch."""
    trainer, callback = grpo_trainer(tmp_path, "warn", steps_per_generation=steps_per_generation, prompts=prompts,
                                     gas=gas)
    trainer.train()
    micro_batches, epochs = checks_epochs(trainer, prompts)
    assert micro_batches == len(trainer.get_train_dataloader()) == callback.report.forecast.plan.micro_batches_per_epoch
    assert epochs == trainer.recording.epoch_ends


def test_trl_grpo_refuses_drop_last_with_its_own_fix(tmp_path):
    from stepsync import StepSyncConfigError

    trainer, _ = grpo_trainer(tmp_path, "drop_last", steps_per_generation=3, prompts=3)
    with pytest.raises(StepSyncConfigError, match=r"steps_per_generation=3.*multiple of gradient_accumulation_steps=2"):
        trainer.train()
    assert trainer.model_wrapped.global_steps == 0  # refused before the first micro-batch


def test_trl_grpo_remedy_names_steps_per_generation(tmp_path):
    trainer, callback = grpo_trainer(tmp_path, "warn", steps_per_generation=3, prompts=3)
    trainer.train()
    events = callback.report.events  # 3 micro-batches an epoch, G=2: the Trainer 4, a drifting engine 3
    assert len(events) == (1 if DRIFTS else 0)
    assert all("steps_per_generation to a multiple of gradient_accumulation_steps=2" in e.remedy for e in events)


def test_trl_grpo_dapo_over_a_generation_of_two_windows_is_right_on_this_release(tmp_path):
    """TRL 1.9.1 and later divide a dapo loss by one window's share of the generation batch's tokens
    (probes/trl_grpo.json, measured through this Trainer): nothing to say. Its policy-gradient loss weighs tokens by
    their advantages, so the token check names no rule."""
    trl = pytest.importorskip("trl")
    from packaging.version import Version

    from stepsync.core.tokens import TRL_RESCALES_TO_THE_WINDOW

    assert Version(trl.__version__) >= Version(TRL_RESCALES_TO_THE_WINDOW)
    trainer, callback = grpo_trainer(tmp_path, "raise", steps_per_generation=4, prompts=8, loss_type="dapo",
                                     beta=0.0)
    trainer.train()
    report = callback.report
    assert report.weight_faults == [] and trainer.model_wrapped.global_steps > 0
    assert report.token_weighting is None or not report.token_weighting.cross_entropy


@pytest.mark.parametrize("policy", ["warn", "raise", "sync"])
def test_trl_grpo_before_1_9_1_is_named_before_the_first_micro_batch(tmp_path, monkeypatch, policy):
    """The release read as 1.9.0 (what probes/trl_grpo.json measured there: each update G / steps_per_generation of
    the window's token mean), the rest of the run real: said with the fix, raise stops before any update."""
    pytest.importorskip("trl")
    from stepsync import StepSyncConfigError
    from stepsync.trainer import start

    real = start.installed_version
    monkeypatch.setattr(start, "installed_version", lambda name: "1.9.0" if name == "trl" else real(name))
    trainer, callback = grpo_trainer(tmp_path, policy, steps_per_generation=4, prompts=8, loss_type="dapo")
    if policy == "raise":
        with pytest.raises(StepSyncConfigError, match=r"every update is 0\.5x the token mean over its window"):
            trainer.train()
        assert trainer.model_wrapped.global_steps == 0
        return
    trainer.train()
    fault = callback.report.weight_faults[0]
    assert fault.startswith("TRL 1.9.0's GRPO divides each 'dapo' loss by the completion tokens of its whole "
                            "generation batch (steps_per_generation=4 micro-batches)")
    assert "upgrade TRL to 1.9.1 or later, or set steps_per_generation=2" in fault
    assert any(("cannot repair it from outside" in note) is (policy == "sync") and fault in note
               for note in callback.report.notes)


def test_trl_sft_on_texts_of_different_lengths_trains_the_token_mean_and_says_so(tmp_path):
    """TRL's SFTTrainer trains a token mean over each window: the first update (SGD at lr 1, no clipping) against each
    rule's gradient computed apart from the micro-batches the model was given. Its loss never makes the logits, and
    the callback says it read nothing."""
    trl = pytest.importorskip("trl")
    import copy

    import transformers
    from datasets import Dataset

    from harness.token_runs import projection, rule_gradients, tiny_causal_lm
    from stepsync import StepSyncCallback
    from stepsync.tools.tiny_run import cpu_distributed_env

    cpu_distributed_env()
    tokenizer, words = tiny_tokenizer()
    data = Dataset.from_dict({"text": [" ".join(words[:count]) for count in (3, 24, 6, 30)]})
    model = tiny_causal_lm()
    before = copy.deepcopy(model)
    given = []
    model.register_forward_pre_hook(lambda module, args, kwargs: given.append(
        {k: kwargs[k].detach().clone() for k in ("input_ids", "labels", "attention_mask") if k in kwargs}),
        with_kwargs=True)
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=2,
                         max_steps=2, max_length=40, bf16=False, learning_rate=1.0, optim="sgd", max_grad_norm=0.0,
                         lr_scheduler_type="constant", weight_decay=0.0, report_to=[], save_strategy="no",
                         disable_tqdm=True, use_cpu=True, shuffle_dataset=False, dataloader_drop_last=False,
                         deepspeed={"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                    "gradient_clipping": "auto", "zero_optimization": {"stage": 0},
                                    "zero_allow_untested_optimizer": True})
    first = []

    class FirstUpdate(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            first.extend([] if first else [p.detach().float().clone() for p in model.parameters()])

    callback = StepSyncCallback("warn", console=False)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                             callbacks=[callback, FirstUpdate()])
    trainer.train()
    window = [{k: v for k, v in batch.items()} for batch in given[:2]]
    truths = rule_gradients(before, window)
    update = [after - b.detach().float() for after, b in zip(first, before.parameters())]
    scale, residual = projection(update, truths["token_mean"])
    assert residual < 1e-4 and scale == pytest.approx(1.0, rel=0.05)
    assert projection(update, truths["micro_batch_mean"])[1] > 0.1
    # TRL's SFTTrainer computes its cross-entropy in chunks from the hidden states and lm_head's weight: the logits
    # the check reads are never made, and it says so rather than name anything.
    assert callback.report.token_weighting is None
    assert any(note.startswith("loss normalisation: not read: the model's output embeddings made no logits")
               for note in callback.report.not_checked)
    assert not any(note.startswith("loss normalisation") for note in callback.report.notes)  # nothing to do
