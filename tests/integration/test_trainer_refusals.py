"""``stepsync check`` refuses what the Trainer refuses: each DeepSpeed config value that contradicts the
TrainingArguments, held against the real Trainer's own refusal (``HfTrainerDeepSpeedConfig``) on the stack this runs
on (transformers 5.24 on aligned and drifting, 4.57 on t457: stepsync/core/versions.py's TRAINER_CONFIG_FILL)."""
import copy
import json

import pytest

from harness.cli import stepsync
from harness.runs import forget_deepspeed, run_tiny
from harness.stack import INSTALLED, needs_stack
from stepsync.tools.tiny_run import deepspeed_config

pytestmark = needs_stack
SAMPLES, G = 6, 2
REFUSAL = "Please correct the following DeepSpeed config values that mismatch TrainingArguments values"


def everything_auto():
    """The tiny run's config with every value the Trainer fills left to it, and fp16, bf16 and apex's amp too."""
    config = deepspeed_config(0)
    config["optimizer"]["params"]["weight_decay"] = "auto"
    config["scheduler"]["params"]["warmup_min_lr"] = "auto"
    config.update(bf16={"enabled": "auto"}, fp16={"enabled": "auto"})
    return config


# One value the user set against the TrainingArguments (batch 1, G=2, clip 1.0, lr 1e-2, AdamW's defaults, 6 samples
# for 2 epochs: 6 updates, no warmup), as the DeepSpeed key's path and the value.
CONTRADICTIONS = [
    ("train_micro_batch_size_per_gpu", 2),
    ("gradient_accumulation_steps", 3),
    ("train_batch_size", 4),
    ("gradient_clipping", 0.5),
    ("optimizer.params.lr", 0.001),
    ("optimizer.params.betas", [0.8, 0.99]),
    ("optimizer.params.eps", 1e-06),
    ("optimizer.params.weight_decay", 0.1),
    ("scheduler.params.warmup_max_lr", 0.5),
    ("fp16.enabled", True),
    ("bf16.enabled", True),
    ("scheduler.params.total_num_steps", 100),
    ("scheduler.params.warmup_num_steps", 7),
    ("amp.opt_level", "O2"),
]


def with_value(config, key, value):
    changed = copy.deepcopy(config)
    *parents, leaf = key.split(".")
    node = changed
    for parent in parents:
        node = node.setdefault(parent, {})
    node[leaf] = value
    return changed


def trainers_refusal(tmp_path, config):
    """The lines of the real Trainer's refusal of ``config`` (empty where its check lets the run start: DeepSpeed
    0.19.8 then still refuses an ``amp`` section of its own accord), and the run."""
    forget_deepspeed()
    run = run_tiny(str(tmp_path / "run"), samples=SAMPLES, gas=G, epochs=2, deepspeed=config, max_steps=-1)
    forget_deepspeed()
    if run.error is not None and REFUSAL in str(run.error):
        return sorted(line[2:] for line in str(run.error).splitlines() if line.startswith("- ds ")), run
    return [], run


def checks_verdict(tmp_path, run, config):
    arguments, deepspeed = tmp_path / "args.json", tmp_path / "ds.json"
    arguments.write_text(run.trainer.args.to_json_string())
    deepspeed.write_text(json.dumps(config))
    return stepsync("check", "--samples", str(SAMPLES), "--world-size", "1", "--training-args", str(arguments),
                    "--deepspeed-config", str(deepspeed), "--transformers", INSTALLED.transformers,
                    "--accelerate", INSTALLED.accelerate, "--deepspeed", INSTALLED.deepspeed)


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("key, value", CONTRADICTIONS, ids=[key for key, _ in CONTRADICTIONS])
def test_check_refuses_each_value_the_trainer_refuses_in_its_words(tmp_path, key, value):
    config = with_value(everything_auto(), key, value)
    refused, run = trainers_refusal(tmp_path, config)
    proc = checks_verdict(tmp_path, run, config)
    said = sorted(line[2:] for line in proc.stderr.splitlines() if line.startswith("- ds "))
    assert said == refused, proc.stdout + proc.stderr
    if refused:
        assert proc.returncode == 2 and "the Trainer refuses to start" in proc.stderr
        assert f"ds {key}=" in proc.stderr and "set each to \"auto\"" in proc.stderr
    else:  # this release does not match the key (apex's amp from transformers 5.0): check forecasts as usual
        assert proc.returncode in (0, 1) and "refuses" not in proc.stderr


def test_check_names_every_contradiction_at_once_as_the_trainer_does(tmp_path):
    config = everything_auto()
    for key, value in CONTRADICTIONS:
        config = with_value(config, key, value)
    refused, run = trainers_refusal(tmp_path, config)
    assert len(refused) >= 12
    proc = checks_verdict(tmp_path, run, config)
    assert proc.returncode == 2
    assert sorted(line[2:] for line in proc.stderr.splitlines() if line.startswith("- ds ")) == refused


def test_values_equal_to_the_training_arguments_are_accepted_by_both(tmp_path):
    """Set by hand but equal (the TrainingArguments' lr, clip, betas, G): the Trainer trains, check forecasts."""
    config = everything_auto()
    for key, value in [("optimizer.params.lr", 1e-2), ("gradient_clipping", 1.0), ("gradient_accumulation_steps", G),
                       ("optimizer.params.betas", [0.9, 0.999]), ("bf16.enabled", False)]:
        config = with_value(config, key, value)
    refused, run = trainers_refusal(tmp_path, config)
    assert refused == [] and run.error is None and run.trainer.state.global_step == 6
    proc = checks_verdict(tmp_path, run, config)
    assert proc.returncode in (0, 1) and "refuses" not in proc.stderr, proc.stderr
