"""What ``stepsync check`` needs, from flags, a ``TrainingArguments`` JSON and a DeepSpeed JSON.

Pure: reads JSON files and resolves DeepSpeed's ``"auto"`` values as the Trainer does. Every bad
input raises :class:`ConfigInputError` with a message naming the fix.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..core.errors import ConfigInputError
from ..core.frameworks import BackwardCall
from ..core.record import read_json
from ..core.releases import installed_versions
from ..core.trainer_config import trainer_fill
from ..core.versions import NEWEST, assumed_release
from ..core.weights import Accumulation, weight_faults


@dataclass(frozen=True)
class CheckInputs:
    """The resolved configuration of one run, per rank.

    ``samples`` is the dataset's length when it was given (None with ``--micro-batches-per-epoch``);
    ``notes`` say what was inferred rather than given.
    """

    micro_batches_per_epoch: int
    gradient_accumulation_steps: int
    num_train_epochs: float
    max_steps: int
    batch_size: int
    world_size: int
    drop_last: bool
    samples: Optional[int] = None
    world_size_inferred: bool = False
    notes: Tuple[str, ...] = ()


# TrainingArguments field -> the name stepsync uses
_TRAINING_ARGS = {
    "per_device_train_batch_size": "batch_size",
    "gradient_accumulation_steps": "gas",
    "num_train_epochs": "epochs",
    "max_steps": "max_steps",
    "dataloader_drop_last": "drop_last",
}
# DeepSpeed key -> the TrainingArguments value the Trainer fills "auto" with
_DEEPSPEED = {"train_micro_batch_size_per_gpu": "batch_size", "gradient_accumulation_steps": "gas"}


def _number(value: Any, name: str, source: str, minimum: float, integer: bool = True):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and value != int(value)):
        kind = "a whole number" if integer else "a number"
        raise ConfigInputError(f"{name}={value!r} in {source} must be {kind}")
    if value < minimum:
        raise ConfigInputError(f"{name}={value!r} in {source} must be >= {minimum:g}")
    return int(value) if integer else float(value)


# Keys of a DeepSpeed config that TrainingArguments never has.
DEEPSPEED_ONLY_KEYS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping")


# Keys only a Trainer's state (trainer_state.json, in every checkpoint-N) has, and keys only TrainingArguments has.
TRAINER_STATE_KEYS = ("log_history", "best_model_checkpoint", "is_world_process_zero")
TRAINING_ARGS_KEYS = ("output_dir", "per_device_train_batch_size", "learning_rate", "logging_steps")


def kind_of(data: Dict[str, Any]) -> str:
    """What a JSON object is, by the keys only it has: "trainer state", "TrainingArguments", "DeepSpeed config", or
    "" where none shows."""
    if any(key in data for key in TRAINER_STATE_KEYS):
        return "trainer state"
    if any(key in data for key in TRAINING_ARGS_KEYS):
        return "TrainingArguments"
    if any(key in data for key in DEEPSPEED_ONLY_KEYS):
        return "DeepSpeed config"
    return ""


WHERE = {
    "trainer state": "a Trainer's state (trainer_state.json, saved in every checkpoint-N), which holds no settings: "
                     "give the checkpoint folder to `stepsync inspect`, or `stepsync check --resume-from` it",
    "TrainingArguments": "TrainingArguments: pass it as --training-args",
    "DeepSpeed config": "a DeepSpeed config: pass it as --deepspeed-config",
}


def must_be(data: Dict[str, Any], wanted: str, source: str) -> None:
    """Refuse ``data`` where its keys show another kind of file than ``wanted``, naming the flag it belongs to."""
    found = kind_of(data)
    if found and found != wanted:
        raise ConfigInputError(f"{source} is {WHERE[found]}")


def misspelt(data: Dict[str, Any], read: Tuple[str, ...], source: str) -> None:
    """Refuse a key that is not one stepsync reads but nearly is (``gradient_accumulation_step``), naming it."""
    for key in data:
        if key in read:
            continue
        near = difflib.get_close_matches(key, read, n=1, cutoff=0.9)
        if near and near[0] not in data:
            raise ConfigInputError(f"{key} in {source} is not a setting: did you mean {near[0]}?")


def disagreement(key: str, configured: Any, asked: Any, where: str) -> str:
    """A DeepSpeed config whose own value contradicts the one asked elsewhere, as ``check`` and ``verify`` say it."""
    return (f"the DeepSpeed config sets {key}={configured} but {where} {asked}: the Trainer refuses that mismatch; "
            f"set {key} to \"auto\" or make them equal")


def deepspeed_config_from(data: Dict[str, Any], source: str) -> Dict[str, Any]:
    """``data`` as a DeepSpeed config: another kind of file, or a misspelt key, is refused naming the fix."""
    must_be(data, "DeepSpeed config", source)
    misspelt(data, (*DEEPSPEED_ONLY_KEYS, *_DEEPSPEED), source)
    return data


def from_training_args(data: Dict[str, Any], source: str) -> Dict[str, Any]:
    """The values stepsync needs from a ``TrainingArguments`` JSON (``args.to_json_string()``)."""
    must_be(data, "TrainingArguments", source)
    misspelt(data, tuple(_TRAINING_ARGS), source)
    found: Dict[str, Any] = {}
    if data.get("num_generations") is not None:  # TRL's GRPO and RLOO: a generation sampler sizes the epochs
        found["generations"] = tuple(_number(data.get(key) or default, key, source, default)
                                     for key, default in (("num_generations", 1), ("steps_per_generation", 0),
                                                          ("generation_batch_size", 0), ("num_iterations", 1)))
    for field, name in _TRAINING_ARGS.items():
        if field not in data or data[field] is None:
            continue
        value = data[field]
        if name == "drop_last":
            if not isinstance(value, bool):
                raise ConfigInputError(f"{field}={value!r} in {source} must be true or false")
            found[name] = value
        elif name == "epochs":
            found[name] = _number(value, field, source, 0, integer=False)
        elif name == "max_steps":
            found[name] = _number(value, field, source, -1)
        else:
            found[name] = _number(value, field, source, 1)
    return found


def deepspeed_config_of(data: Dict[str, Any], base: str) -> Optional[Dict[str, Any]]:
    """The DeepSpeed config a ``TrainingArguments`` JSON names (a dict, or a path relative to it)."""
    value = data.get("deepspeed")
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        named = "the DeepSpeed config named by 'deepspeed'"
        return deepspeed_config_from(read_json(os.path.join(os.path.dirname(base), value), named), named)
    return None


@dataclass(frozen=True)
class ConfigFiles:
    """What ``check`` and ``verify`` read from ``--training-args`` and ``--deepspeed-config``.

    ``training``: the values the forecast needs; ``arguments``: the TrainingArguments JSON with the flags that
    override it; ``deepspeed``: the DeepSpeed config as the Trainer runs it (``"auto"`` filled from the
    TrainingArguments where they are given); ``agreeing``: the same with every value the Trainer refuses replaced by
    its own (the run once the user fixes them); ``given``: the DeepSpeed config as written.
    """

    source: str
    transformers: str
    training: Optional[Dict[str, Any]] = None
    arguments: Optional[Dict[str, Any]] = None
    given: Optional[Dict[str, Any]] = None
    deepspeed: Optional[Dict[str, Any]] = None
    agreeing: Optional[Dict[str, Any]] = None

    def refuse_what_the_trainer_refuses(self, world_size: Optional[int] = None,
                                        training_steps: Optional[int] = None) -> None:
        """Raise naming every DeepSpeed value the Trainer of ``transformers`` refuses at its start (it starts with the
        steps planned, ``training_steps``, on ``world_size`` ranks: where one is None, what needs it is left alone)."""
        if self.arguments is None or self.given is None:
            return
        fill = trainer_fill(self.given, self.arguments, self.transformers, world_size, training_steps)
        if fill.mismatches:
            raise ConfigInputError(fill.refusal(f"the TrainingArguments in {self.source}"))


def read_files(training_args: Optional[str], deepspeed: Optional[str], flags: Dict[str, Any],
               transformers: str) -> ConfigFiles:
    """Read the ``--training-args`` and ``--deepspeed-config`` files (either may be None); ``flags`` override the
    TrainingArguments' batch size and G as they override them in the forecast."""
    if training_args is None:
        given = None if deepspeed is None else deepspeed_config_from(read_json(deepspeed, "--deepspeed-config"),
                                                                     deepspeed)
        return ConfigFiles(deepspeed or "", transformers, given=given, deepspeed=given, agreeing=given)
    data = read_json(training_args, "--training-args")
    training = from_training_args(data, training_args)
    given = (deepspeed_config_from(read_json(deepspeed, "--deepspeed-config"), deepspeed) if deepspeed else
             deepspeed_config_of(data, training_args))
    arguments = dict(data)
    for flag, field in (("batch_size", "per_device_train_batch_size"), ("gas", "gradient_accumulation_steps")):
        if flags.get(flag) is not None:
            arguments[field] = flags[flag]
    if given is None:
        return ConfigFiles(training_args, transformers, training, arguments)
    fill = trainer_fill(given, arguments, transformers, flags.get("world_size"))
    return ConfigFiles(training_args, transformers, training, arguments, given, fill.config, fill.agreeing)


def resolve(flags: Dict[str, Any], training_args: Optional[Dict[str, Any]] = None,
            deepspeed: Optional[Dict[str, Any]] = None, source: str = "the training arguments") -> CheckInputs:
    """Flags override the ``TrainingArguments`` values; the DeepSpeed config's numbers must agree with
    them, as the Trainer demands, and fill what neither gives."""
    values = dict(training_args or {})
    values.update({k: v for k, v in flags.items() if v is not None and k not in ("samples", "micro_batches")})
    for key, name in _DEEPSPEED.items():
        given = (deepspeed or {}).get(key, "auto")
        if given == "auto":
            continue
        given = _number(given, key, "the DeepSpeed config", 1)
        if name in values and values[name] != given:
            raise ConfigInputError(disagreement(key, given, values[name], "the training arguments say"))
        values[name] = given
    batch, gas = values.get("batch_size", 1), values.get("gas")
    if gas is None:
        raise ConfigInputError("gradient_accumulation_steps is not given: pass --gas, or --training-args / "
                               "--deepspeed-config files that set it")
    world = values.get("world_size")
    notes = []
    total = (deepspeed or {}).get("train_batch_size", "auto")
    if total != "auto":
        total = _number(total, "train_batch_size", "the DeepSpeed config", 1)
        if total % (batch * gas):
            raise ConfigInputError(f"train_batch_size={total} in the DeepSpeed config is not a multiple of "
                                   f"batch size {batch} x gradient_accumulation_steps {gas}: set it to \"auto\"")
        if world is not None and total != batch * gas * world:
            raise ConfigInputError(f"train_batch_size={total} in the DeepSpeed config != {batch} x {gas} x "
                                   f"world size {world}: set it to \"auto\" or fix --world-size")
        if world is None:
            notes.append(f"world size {total // (batch * gas)} inferred from train_batch_size={total} in the "
                         f"DeepSpeed config ({batch} per device x {gas} accumulation steps x "
                         f"{total // (batch * gas)} ranks); pass --world-size to state it")
        world = total // (batch * gas)
    inferred = bool(notes)
    world = world or 1
    max_steps = values.get("max_steps", -1)
    epochs = values.get("epochs", 1.0)
    if max_steps <= 0 and not epochs > 0:
        raise ConfigInputError(f"num_train_epochs must be > 0 when max_steps is not set, got {epochs}")
    drop_last = bool(values.get("drop_last", False))
    generations = values.get("generations")
    micro = (_generation_micro_batches(flags, batch, world, gas, *generations) if generations else
             _micro_batches(flags, batch, world, drop_last))
    return CheckInputs(micro, gas, epochs, max_steps, batch, world, drop_last, flags.get("samples"), inferred,
                       tuple(notes))


def _micro_batches(flags: Dict[str, Any], batch: int, world: int, drop_last: bool) -> int:
    if flags.get("micro_batches"):
        return flags["micro_batches"]
    samples = flags.get("samples")
    if not samples:
        raise ConfigInputError("the dataset size is not given: pass --samples or --micro-batches-per-epoch")
    per_rank = -(-samples // world)  # the distributed sampler pads every rank to the same length
    micro = per_rank // batch if drop_last else -(-per_rank // batch)
    if micro < 1:
        raise ConfigInputError(f"{samples} samples on {world} rank(s) give no full batch of {batch} with "
                               "drop_last: lower the batch size or drop --drop-last")
    return micro


def _generation_micro_batches(flags: Dict[str, Any], batch: int, world: int, gas: int, generations: int,
                              steps_per_generation: int, generation_batch: int, iterations: int) -> int:
    """Micro-batches per epoch on one rank under TRL's generation sampler (trl/trainer/utils.py's RepeatSampler, as
    GRPOTrainer builds it): the prompts in chunks of ``generation_batch_size // num_generations``, an incomplete chunk
    dropped, each chunk one dataloader batch per rank repeated ``num_iterations * steps_per_generation`` times."""
    if flags.get("micro_batches"):
        return flags["micro_batches"]
    samples = flags.get("samples")
    if not samples:
        raise ConfigInputError("the dataset size is not given: pass --samples (the prompts) or "
                               "--micro-batches-per-epoch")
    steps = steps_per_generation or (generation_batch // (batch * world) if generation_batch else gas)
    prompts_per_chunk = max(batch * world * steps // generations, 1)
    micro = samples // prompts_per_chunk * iterations * steps
    if micro < 1:
        raise ConfigInputError(f"{samples} prompts make no generation batch of {prompts_per_chunk} prompts (TRL drops "
                               "an incomplete one): pass more prompts, or lower per_device_train_batch_size")
    return micro


def versions_for(given: Dict[str, Optional[str]], notes: List[str], said: Tuple[str, ...] = ()) -> Dict[str, str]:
    """The release of each package the forecast is made for: given, else installed, else the one assumed (said in
    ``notes`` for the packages in ``said``, those that decide the forecast; all of them by default)."""
    versions: Dict[str, str] = {}
    for package, version in given.items():
        found = version or installed_versions([package])[package]
        versions[package] = found or assumed_release(package)
        if found is None and (not said or package in said):
            shown = "its newest release" if versions[package] == NEWEST else versions[package]
            notes.append(f"{package} is not installed here and --{package} was not given: the forecast assumes "
                         f"{shown}; pass --{package} VERSION for the run's machine")
    return versions


def engine_settings(config: Dict[str, Any]) -> Tuple[Optional[int], str, str]:
    """(ZeRO stage, the optimizer's offload device or "none", "bf16" / "fp16" / "fp32") as a DeepSpeed config asks
    them; the stage is None where the config's is not a number."""
    zero = config.get("zero_optimization") or {}
    zero = zero if isinstance(zero, dict) else {}
    stage = zero.get("stage", 0)
    offload = str((zero.get("offload_optimizer") or {}).get("device") or "none")
    precision = next((name for name, keys in (("bf16", ("bf16", "bfloat16")), ("fp16", ("fp16",)))
                      if any((config.get(key) or {}).get("enabled") is True for key in keys)), "fp32")
    return (stage if isinstance(stage, int) else None), offload, precision


OUTPUT_CONDITION = ("where the model's loss is computed from another tensor of its output (as in every transformers "
                    "model): ")
RANKS_CONDITION = "on several data-parallel ranks: "


def weight_faults_of(config: Optional[Dict[str, Any]], deepspeed: str, g: int,
                     call: BackwardCall = BackwardCall.TRAINER,
                     world_size: Optional[int] = None) -> Tuple[List[str], bool]:
    """What the DeepSpeed release does to each micro-batch's weight under ``config`` (its ZeRO stage, offload,
    precision and bf16 accumulation) with backward called as ``call`` on ``world_size`` ranks, as probed, and whether
    one of them is certain; nothing without a config. A fault that needs the model's output, or several ranks where
    ``world_size`` is not known (None), is named with that condition (no model is run here) and is not certain."""
    if not isinstance(config, dict):
        return [], False
    stage, offload, precision = engine_settings(config)
    if stage is None:
        return [], False
    faults = weight_faults(deepspeed, stage, offload == "cpu", precision, g, call, through_outputs=None,
                           world_size=world_size or 2, accumulation=Accumulation.from_config(config))
    ranks_unknown = [world_size is None and fault.smallest_world > 1 for fault in faults]
    said = [(OUTPUT_CONDITION if fault.through_outputs else "") + (RANKS_CONDITION if unknown else "")
            + fault.message(deepspeed, g) for fault, unknown in zip(faults, ranks_unknown)]
    return said, any(not fault.through_outputs and not unknown for fault, unknown in zip(faults, ranks_unknown))
