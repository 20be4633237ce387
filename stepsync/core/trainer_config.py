"""What the Trainer does to a DeepSpeed config before it trains: fill its ``"auto"`` values from the
``TrainingArguments``, and refuse to start where a value the user set contradicts them (transformers'
``HfTrainerDeepSpeedConfig.trainer_config_process`` and ``trainer_config_finalize``, by release:
:data:`stepsync.core.versions.TRAINER_CONFIG_FILL`).

Pure: reads the two JSON objects ``stepsync check`` and ``stepsync verify`` are given, never transformers.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .versions import trainer_config_fill

# TrainingArguments' defaults for the fields read here (the same from 4.24 to 5.x), for a JSON that leaves one out.
DEFAULTS: Dict[str, Any] = {
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0, "learning_rate": 5e-5,
    "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "weight_decay": 0.0, "fp16": False,
    "fp16_full_eval": False, "bf16": False, "bf16_full_eval": False, "fp16_opt_level": "O1", "warmup_steps": 0,
    "warmup_ratio": 0.0, "auto_find_batch_size": False,
}


@dataclass(frozen=True)
class Mismatch:
    """One DeepSpeed config value the Trainer refuses, with the TrainingArguments value it contradicts."""

    ds_key: str
    ds_value: Any
    hf_key: str
    hf_value: Any

    def line(self) -> str:
        """As the Trainer lists it in its refusal."""
        return f"ds {self.ds_key}={self.ds_value} vs hf {self.hf_key}={self.hf_value}"


@dataclass(frozen=True)
class TrainerFill:
    """The config as the Trainer would run it (``"auto"`` filled) and what it would refuse in it; ``agreeing`` is
    the config with each refused value replaced by the Trainer's (what the run would be once the user fixes it)."""

    config: Dict[str, Any]
    mismatches: Tuple[Mismatch, ...]
    agreeing: Dict[str, Any]

    def refusal(self, source: str) -> str:
        """The refusal in the Trainer's terms, with the fix; empty where the Trainer starts."""
        if not self.mismatches:
            return ""
        lines = "\n".join(f"- {m.line()}" for m in self.mismatches)
        return (f"the Trainer refuses to start with these DeepSpeed config values, which contradict {source}:\n"
                f"{lines}\nset each to \"auto\" (the Trainer fills it from the TrainingArguments) or make the two "
                "equal")


def _arg(args: Dict[str, Any], name: str) -> Any:
    value = args.get(name)
    return DEFAULTS[name] if value is None else value


def warmup_steps(args: Dict[str, Any], training_steps: int, fill: frozenset) -> int:
    """``TrainingArguments.get_warmup_steps(training_steps)``, as the Trainer fills ``warmup_num_steps``."""
    if "warmup_steps_ratio" in fill:
        ratio = args.get("warmup_ratio")
        steps = ratio if ratio is not None else _arg(args, "warmup_steps")
        found = int(steps) if steps >= 1 else math.ceil(training_steps * steps)
    else:
        steps = _arg(args, "warmup_steps")
        found = steps if steps > 0 else math.ceil(training_steps * _arg(args, "warmup_ratio"))
    return max(1, found) if "warmup_at_least_one" in fill else found


def trainer_fill(config: Dict[str, Any], args: Dict[str, Any], transformers: str,
                 world_size: Optional[int] = None, training_steps: Optional[int] = None) -> TrainerFill:
    """``config`` as the Trainer of ``transformers`` fills it from ``args`` (a TrainingArguments JSON), and the
    values it refuses. ``world_size`` and ``training_steps`` (the planned ``max_steps``) are the Trainer's own
    calculations: a key that needs one is left alone where it is None."""
    fill = trainer_config_fill(transformers)
    batch, g = _arg(args, "per_device_train_batch_size"), _arg(args, "gradient_accumulation_steps")
    batch_matched = not ("auto_find_batch_size" in fill and _arg(args, "auto_find_batch_size"))
    fp16 = bool(_arg(args, "fp16") or _arg(args, "fp16_full_eval"))
    apex = fp16 and (args.get("half_precision_backend") or args.get("fp16_backend")) == "apex"
    # (DeepSpeed key, the TrainingArguments name the Trainer says, its value (None: unknown here), matched?)
    keys: List[Tuple[str, str, Callable[[], Any], bool]] = [
        ("train_micro_batch_size_per_gpu", "per_device_train_batch_size", lambda: batch, batch_matched),
        ("gradient_accumulation_steps", "gradient_accumulation_steps", lambda: g, True),
        ("train_batch_size", "train_batch_size (calculated)",
         lambda: None if world_size is None else world_size * batch * g, batch_matched),
        ("gradient_clipping", "max_grad_norm", lambda: _arg(args, "max_grad_norm"), True),
        ("optimizer.params.lr", "learning_rate", lambda: _arg(args, "learning_rate"), True),
        ("optimizer.params.betas", "adam_beta1+adam_beta2",
         lambda: [_arg(args, "adam_beta1"), _arg(args, "adam_beta2")], True),
        ("optimizer.params.eps", "adam_epsilon", lambda: _arg(args, "adam_epsilon"), True),
        ("optimizer.params.weight_decay", "weight_decay", lambda: _arg(args, "weight_decay"), True),
        ("scheduler.params.warmup_min_lr", "", lambda: 0, False),
        ("scheduler.params.warmup_max_lr", "learning_rate", lambda: _arg(args, "learning_rate"), True),
    ]
    if "apex_amp" in fill:
        keys += [("fp16.enabled", "fp16|fp16_full_eval+fp16_backend(amp)", lambda: fp16 and not apex, True),
                 ("amp.enabled", "fp16+fp16_backend(apex)", lambda: apex, True),
                 ("amp.opt_level", "fp16_opt_level", lambda: _arg(args, "fp16_opt_level"), True)]
    else:
        keys.append(("fp16.enabled", "fp16|fp16_full_eval", lambda: fp16, True))
    keys += [
        ("bf16.enabled", "bf16|bf16_full_eval", lambda: bool(_arg(args, "bf16") or _arg(args, "bf16_full_eval")), True),
        ("scheduler.params.total_num_steps", "num_training_steps (calculated)", lambda: training_steps, True),
        ("scheduler.params.warmup_num_steps", "warmup_steps",
         lambda: None if training_steps is None else warmup_steps(args, training_steps, fill), True),
    ]
    filled, agreeing = copy.deepcopy(config), copy.deepcopy(config)
    mismatches = []
    for ds_key, hf_key, value_of, matched in keys:
        node, leaf = _node(filled, ds_key), ds_key.split(".")[-1]
        value = None if node is None or node.get(leaf) is None else value_of()
        if node is None or value is None:
            continue
        if node[leaf] == "auto":
            node[leaf] = value
        elif matched and node[leaf] != value:
            mismatches.append(Mismatch(ds_key, node[leaf], hf_key, value))
        else:
            continue
        agreeing_node = _node(agreeing, ds_key)
        if agreeing_node is not None:
            agreeing_node[leaf] = value
    return TrainerFill(filled, tuple(mismatches), agreeing)


def _node(config: Dict[str, Any], key: str) -> Optional[Dict[str, Any]]:
    """The section of ``config`` that holds the dotted ``key``'s last part, or None where a section is missing."""
    node: Any = config
    for parent in key.split(".")[:-1]:
        node = node.get(parent) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None
