"""Runs whose micro-batches hold chosen numbers of trained tokens, and the truth about what each token weighed.

A tiny causal LM built from a config; each micro-batch is one padded sequence whose first ``count + 1`` labels are
real (the model's shift leaves ``count`` trained tokens). Plain SGD at lr 1 without clipping makes the first
update exactly minus the gradient the window's loss gave; the truth is that update held against the gradient of
each rule computed apart, with plain torch, from the same weights (:func:`rule_gradients`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence

from stepsync.tools.tiny_run import cpu_distributed_env

VOCABULARY = 64
LENGTH = 40  # positions per sequence: the longest count + 1 fits


def tiny_causal_lm(seed: int = 0):
    """A one-layer Llama: its forward takes the loss's keyword arguments (``num_items_in_batch``) from transformers
    4.46 on, where GPT-2's did not yet."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCABULARY, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LENGTH,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config)


def tiny_plain_lm(seed: int = 0):
    """A causal LM without transformers (an embedding, a tanh, a head) whose ``get_output_embeddings()`` is its
    head, as a transformers model's is; ``forward`` returns the logits."""
    import torch

    torch.manual_seed(seed)

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCABULARY, 16)
            self.head = torch.nn.Linear(16, VOCABULARY)

        def get_output_embeddings(self):
            return self.head

        def forward(self, input_ids, attention_mask=None, **kwargs):
            return self.head(torch.tanh(self.embed(input_ids)))

    return TinyLM()


def summed_token_loss(logits, labels):
    """The trained tokens' cross-entropies summed (the model's shift: position t predicts label t + 1)."""
    import torch

    return torch.nn.functional.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1]).float(),
                                           labels[..., 1:].reshape(-1), ignore_index=-100, reduction="sum")


def sequence(count: int, seed: int, length: int = LENGTH) -> Dict[str, Any]:
    """One sequence of ``length`` tokens whose first ``count + 1`` labels are real: ``count`` trained tokens."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCABULARY, (length,), generator=generator)
    labels = ids.clone()
    labels[count + 1:] = -100
    mask = torch.zeros(length, dtype=torch.long)
    mask[:count + 1] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class CountedDataset:
    """Sequences with the given trained-token counts, in order (one per micro-batch at batch size 1)."""

    def __init__(self, counts: Sequence[int], seed: int = 1) -> None:
        self.rows = [sequence(count, seed + i) for i, count in enumerate(counts)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def trained_tokens(batch) -> int:
    return int((batch["labels"][..., 1:] != -100).sum())


def token_losses(model, batch):
    """Each trained token's cross-entropy, summed; and their number."""
    import torch

    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return summed_token_loss(logits, batch["labels"]), trained_tokens(batch)


def rule_gradients(model, batches: List[dict]) -> Dict[str, List[Any]]:
    """The gradient each rule gives the window ``batches`` (each [sequences, positions], or one sequence), computed
    apart: ``token_mean`` (every trained token 1/N), ``micro_batch_mean`` (each micro-batch's own mean, averaged
    over the window), ``micro_batch_sum`` (those means summed) and ``sequence_mean`` (each sequence's own mean,
    averaged over the window's sequences)."""
    import copy

    import torch

    batches = [{k: v[None] if v.dim() == 1 else v for k, v in batch.items() if k != "window_tokens"}
               for batch in batches]
    found = {}
    total_tokens = sum(trained_tokens(batch) for batch in batches)
    sequences = sum(batch["input_ids"].shape[0] for batch in batches)
    for rule in ("token_mean", "micro_batch_mean", "micro_batch_sum", "sequence_mean"):
        twin = copy.deepcopy(model).float()
        twin.zero_grad()
        for batch in batches:
            if rule == "sequence_mean":
                for row in range(batch["input_ids"].shape[0]):
                    one = {k: v[row:row + 1] for k, v in batch.items()}
                    summed, tokens = token_losses(twin, one)
                    (summed / tokens / sequences).backward()
                continue
            summed, tokens = token_losses(twin, batch)
            if rule == "token_mean":
                loss = summed / total_tokens
            else:
                loss = summed / tokens / (len(batches) if rule == "micro_batch_mean" else 1)
            loss.backward()
        found[rule] = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                       for p in twin.parameters()]
    return found


def projection(update: List[Any], gradient: List[Any]) -> tuple:
    """(scale, residual) of ``-update`` against ``gradient``: ``-update = scale * gradient + r``, ``residual`` =
    |r| / |update|. A run that trained by a rule has scale 1 and residual near 0 against it."""
    import torch

    u = -torch.cat([t.reshape(-1).float() for t in update])
    g = torch.cat([t.reshape(-1).float() for t in gradient])
    scale = float(u @ g / (g @ g))
    residual = float((u - scale * g).norm() / u.norm())
    return scale, residual


@dataclass
class TokenRun:
    """A run's first update and what stepsync said of it."""

    report: Any = None
    error: Optional[BaseException] = None
    before: List[Any] = field(default_factory=list)
    after: List[Any] = field(default_factory=list)
    truths: Dict[str, List[Any]] = field(default_factory=dict)
    engine_steps: int = 0

    @property
    def update(self) -> List[Any]:
        return [a - b for a, b in zip(self.after, self.before)]

    def against(self, rule: str) -> tuple:
        return projection(self.update, self.truths[rule])


def sgd_config(gas: int, stage: int = 0, bf16: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
            **({"bf16": {"enabled": True}} if bf16 else {})}


def _trained(result: TokenRun, watch: Any, loop: Callable[[], None], parameters: Callable[[], List[Any]],
             engine: Any = None) -> TokenRun:
    """Run ``loop``; keep the exception that ended it, the watch's report, the weights after the first update (or at
    the end), and the engine's count."""
    try:
        loop()
    except Exception as exc:  # the caller asserts on it
        result.error = exc
    finally:
        if watch is not None:
            watch.close()
            result.report = watch.report
    if not result.after:
        result.after = parameters()
    result.engine_steps = getattr(engine, "global_steps", 0)
    return result


def _parameters(engine) -> List[Any]:
    import deepspeed

    params = list(engine.module.parameters())
    # ZeRO-3 keeps a shard per rank; DeepSpeed 0.15 refuses to gather one already whole
    partitioned = [p for p in params if getattr(getattr(p, "ds_status", None), "name", "") == "NOT_AVAILABLE"]
    with deepspeed.zero.GatheredParameters(partitioned):
        return [p.detach().float().clone() for p in params]


def run_accelerate_tokens(counts: Sequence[int], gas: int, loss: str = "examples", policy: Optional[str] = "warn",
                          stage: int = 0, declared: str = "token_mean", bf16: bool = False) -> TokenRun:
    """One window of an accelerate loop with accumulate(). ``loss="examples"``: ``model(**batch).loss`` (the
    run_clm_no_trainer.py way); ``"recipe"``: accelerate's
    ``examples/by_feature/gradient_accumulation_for_autoregressive_models.py``: ``num_items_in_batch`` counted over
    the window before it starts, the loss times G."""
    cpu_distributed_env()
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    import stepsync

    AcceleratorState._reset_state(True)
    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=gas, mixed_precision="bf16" if bf16 else None,
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=sgd_config(gas, stage, bf16)))
    model = tiny_causal_lm()
    dataset = CountedDataset(counts)
    result = TokenRun(truths=rule_gradients(model, [dataset[i] for i in range(gas)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=1)
    # Each rank trains the counts it is given: the dataloader is not sharded across ranks.
    model, optimizer = accelerator.prepare(model, optimizer)
    engine = accelerator.deepspeed_engine_wrapped.engine
    result.before = _parameters(engine)
    watch = stepsync.watch(accelerator, policy, dataloader=dataloader, num_epochs=1, console=False,
                           loss_normalisation=declared) if policy else None
    batches = list(dataloader)

    def loop():
        for start in range(0, len(batches), gas):
            window = batches[start:start + gas]
            items = sum(trained_tokens(batch) for batch in window)
            for batch in window:
                with accelerator.accumulate(model):
                    if loss == "recipe":
                        out = model(**batch, use_cache=False, num_items_in_batch=items).loss * gas
                    else:
                        out = model(**batch).loss
                    accelerator.backward(out)
                    optimizer.step(), optimizer.zero_grad()
                if engine.global_steps == 1 and not result.after:
                    result.after = _parameters(engine)

    return _trained(result, watch, loop, lambda: _parameters(engine), engine)


class IgnoresItems:
    """A model whose ``forward(**kwargs)`` ignores ``num_items_in_batch``: the Trainer then leaves its loss
    undivided (``model_accepts_loss_kwargs``), and each micro-batch's own mean is summed over the window."""

    @staticmethod
    def wrap(model):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = model

            def forward(self, input_ids=None, labels=None, attention_mask=None, **kwargs):
                return self.inner(input_ids=input_ids, labels=labels, attention_mask=attention_mask)

        return Wrapped()


def run_trainer_tokens(output_dir: str, counts: Sequence[int], gas: int, model: str = "transformers",
                       policy: Optional[str] = "warn", stage: int = 0, declared: str = "token_mean",
                       bf16: bool = False, accepts_loss_kwargs: Optional[bool] = None,
                       compute_loss_func=None, deepspeed: bool = True) -> TokenRun:
    """The Trainer on one window (its first ``gas`` micro-batches, in order), SGD at lr 1, no clipping.
    ``model="transformers"``: the model itself (its loss divides by ``num_items_in_batch``); ``"ignores"``: a
    model whose forward takes ``**kwargs`` and ignores it (:class:`IgnoresItems`). ``accepts_loss_kwargs`` is set on
    the model where given; ``compute_loss_func`` is handed to the Trainer (the user's own loss); ``deepspeed=False``:
    the Trainer alone (one process, its own optimizer)."""
    cpu_distributed_env()
    import torch
    from transformers import Trainer, TrainerCallback

    import stepsync
    from stepsync.tools.tiny_run import training_args

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    if not deepspeed:  # accelerate keeps one state per process: an earlier run's DeepSpeed plugin must not carry over
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        for name in [name for name in os.environ if name.startswith(("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED"))]:
            os.environ.pop(name)  # TrainingArguments(deepspeed=...) sets them for the process

    net = tiny_causal_lm()
    dataset = CountedDataset(counts)
    result = TokenRun(truths=rule_gradients(net, [dataset[i] for i in range(gas)]))
    if model == "ignores":
        net = IgnoresItems.wrap(net)
    if accepts_loss_kwargs is not None:
        net.accepts_loss_kwargs = accepts_loss_kwargs
    result.before = [p.detach().float().clone() for p in net.parameters()]

    class FirstUpdate(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if not result.after:
                result.after = [p.detach().float().clone() for p in model.parameters()]

    args = training_args(output_dir, gas, epochs=1, stage=stage, optim="sgd", learning_rate=1.0,
                         lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, bf16=bf16,
                         deepspeed={"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                    "gradient_clipping": "auto", "zero_optimization": {"stage": stage},
                                    "zero_allow_untested_optimizer": True,
                                    **({"bf16": {"enabled": "auto"}} if bf16 else {})} if deepspeed else False)
    callbacks = [FirstUpdate()]
    watching = stepsync.StepSyncCallback(policy, console=False, loss_normalisation=declared) if policy else None
    if watching is not None:
        callbacks.insert(0, watching)
    trainer = InOrder(model=net, args=args, train_dataset=dataset, callbacks=callbacks,
                      **({"compute_loss_func": compute_loss_func} if compute_loss_func is not None else {}))
    try:
        trainer.train()
    except Exception as exc:  # the caller asserts on it
        result.error = exc
    engine = getattr(trainer, "model_wrapped", None)
    if not result.after:
        result.after = [p.detach().float().clone() for p in trainer.model.parameters()]
    result.engine_steps = getattr(engine, "global_steps", 0)
    result.report = watching.report if watching is not None else None
    return result


def windowed(counts: Sequence[Any], gas: int) -> List[dict]:
    """One micro-batch per item of ``counts`` (an int: one sequence with that many trained tokens; a tuple: one
    sequence per count), each carrying ``window_tokens``: the trained tokens of its window of ``gas`` (what a loop
    counts before the window starts)."""
    import torch

    rows, seed = [], 1
    for item in counts:
        group = (item,) if isinstance(item, int) else tuple(item)
        made = [sequence(count, seed + i) for i, count in enumerate(group)]
        seed += len(group)
        rows.append({key: torch.stack([m[key] for m in made]) for key in made[0]})
    for start in range(0, len(rows), gas):
        window = rows[start:start + gas]
        total = sum(trained_tokens(row) for row in window)
        for row in window:
            row["window_tokens"] = torch.tensor(total)
    return rows


def loop_loss(logits, batch, loss: str, gas: int):
    """A loop's loss: ``"micro_batch_mean"`` (each micro-batch's own mean, the usual ``F.cross_entropy``),
    ``"token_mean"`` (summed, divided by the window's trained tokens, times G where the framework divides by G),
    ``"sequence_mean"`` (each sequence's own mean, averaged over the micro-batch's sequences, as a per-sequence loss
    is) or ``"advantage"`` (each sequence's summed token losses times +1 or -1 alternately, as a policy-gradient
    loss weighs them by their advantages)."""
    if loss == "sequence_mean":
        rows = logits.shape[0]
        return sum(summed_token_loss(logits[r:r + 1], batch["labels"][r:r + 1])
                   / trained_tokens({"labels": batch["labels"][r:r + 1]}) for r in range(rows)) / rows
    if loss == "advantage":
        return sum(summed_token_loss(logits[r:r + 1], batch["labels"][r:r + 1]) * (1 - 2 * (r % 2))
                   for r in range(logits.shape[0]))
    summed = summed_token_loss(logits, batch["labels"])
    if loss == "token_mean":
        return summed / batch["window_tokens"].sum() * gas
    return summed / trained_tokens(batch)


def run_engine_tokens(counts: Sequence[int], gas: int, loss: str = "micro_batch_mean",
                      policy: Optional[str] = "warn", stage: int = 0, declared: str = "token_mean",
                      bf16: bool = False) -> TokenRun:
    """DeepSpeed-Chat's loop (``engine.backward(loss)``, ``engine.step()`` after every micro-batch) on the plain
    tiny LM: one window, SGD at lr 1."""
    cpu_distributed_env()
    import deepspeed
    import torch

    import stepsync

    model = tiny_plain_lm()
    rows = windowed(counts, gas)
    result = TokenRun(truths=rule_gradients(model, rows[:gas]))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                           config=sgd_config(gas, stage, bf16))
    result.before = _parameters(engine)
    watch = stepsync.watch(engine, policy, dataloader=rows, num_epochs=1, console=False,
                           loss_normalisation=declared) if policy else None
    def loop():
        for batch in rows:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            engine.backward(loop_loss(engine(batch["input_ids"]), batch, loss, gas))
            engine.step()
            if engine.global_steps == 1 and not result.after:
                result.after = _parameters(engine)

    return _trained(result, watch, loop, lambda: _parameters(engine), engine)


def run_lightning_tokens(counts: Sequence[int], gas: int, loss: str = "micro_batch_mean",
                         policy: Optional[str] = "warn", stage: int = 0, declared: str = "token_mean",
                         deepspeed: bool = True) -> TokenRun:
    """Lightning's Trainer with DeepSpeed (``deepspeed=False``: its own accumulation, one CPU device) on the plain
    tiny LM, one window (the module's loss as :func:`loop_loss` computes it), SGD at lr 1."""
    cpu_distributed_env()
    import lightning.pytorch as pl
    import torch

    from stepsync.lightning import StepSyncCallback
    from stepsync.tools.tiny_lightning import cpu_deepspeed_strategy

    net = tiny_plain_lm()
    rows = windowed(counts, gas)
    result = TokenRun(truths=rule_gradients(net, rows[:gas]))
    result.before = [p.detach().float().clone() for p in net.parameters()]

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = net

        def training_step(self, batch, batch_idx):
            return loop_loss(self.model(batch["input_ids"]), batch, loss, gas)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    class FirstUpdate(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 1 and not result.after:  # Lightning's count: one per optimizer step here
                result.after = [p.detach().float().clone() for p in net.parameters()]

    callback = StepSyncCallback(policy, console=False, loss_normalisation=declared) if policy else None
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, accumulate_grad_batches=gas, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, devices=1,
                         **({"strategy": cpu_deepspeed_strategy(stage)} if deepspeed else {}),
                         callbacks=[FirstUpdate()] + ([callback] if callback else []))
    try:
        trainer.fit(Module(), torch.utils.data.DataLoader(rows, batch_size=1, collate_fn=lambda items: items[0]))
    except Exception as exc:  # the caller asserts on it
        result.error = exc
    if not result.after:
        result.after = [p.detach().float().clone() for p in net.parameters()]
    result.engine_steps = getattr(trainer.strategy.model, "global_steps", trainer.global_step)
    result.report = callback.report if callback else None
    return result


def run_fabric_tokens(counts: Sequence[int], gas: int, loss: str = "micro_batch_mean",
                      policy: Optional[str] = "warn", stage: int = 0, declared: str = "token_mean",
                      deepspeed: bool = True) -> TokenRun:
    """Fabric's documented accumulation loop (no_backward_sync, the loss divided by G, optimizer.step() every G)
    on the plain tiny LM, the DeepSpeed config's G 1 (``deepspeed=False``: Fabric's own, one CPU device), one
    window."""
    cpu_distributed_env()
    import lightning as L
    import torch
    from lightning.fabric.strategies import DeepSpeedStrategy

    import stepsync.lightning
    from stepsync.tools.tiny_lightning import lift_the_cuda_check

    lift_the_cuda_check()
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 1,
              "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(
        config=config, parallel_devices=[torch.device("cpu", 0)], process_group_backend="gloo") if deepspeed else "auto")
    fabric.launch()
    net = tiny_plain_lm()
    rows = windowed(counts, gas)
    result = TokenRun(truths=rule_gradients(net, rows[:gas]))
    result.before = [p.detach().float().clone() for p in net.parameters()]
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1.0))
    watch = stepsync.lightning.watch(fabric, model, optimizer, policy, dataloader=rows, console=False,
                                     loss_normalisation=declared) if policy else None
    def loop():
        for index, batch in enumerate(rows):
            ends_window = (index + 1) % gas == 0
            with fabric.no_backward_sync(model, enabled=not ends_window):
                fabric.backward(loop_loss(model(batch["input_ids"]), batch, loss, gas) / gas)
            if ends_window:
                optimizer.step()
                optimizer.zero_grad()
                if not result.after:
                    result.after = [p.detach().float().clone() for p in net.parameters()]

    return _trained(result, watch, loop, lambda: [p.detach().float().clone() for p in net.parameters()])


def run_sharded_tokens(counts: Sequence[int], gas: int, loss: str = "micro_batch_mean",
                       policy: Optional[str] = "warn", declared: str = "token_mean") -> TokenRun:
    """A torch-native loop whose plain tiny LM is sharded with FSDP2 (one rank, gloo): the sync on at each window's
    last micro-batch, ``optimizer.step()`` there, one window, SGD at lr 1. ``loss="micro_batch_mean"``: each
    micro-batch's own mean divided by G (the usual ``F.cross_entropy(...) / G``); ``"token_mean"``: the summed token
    losses divided by the window's trained tokens, counted before it starts."""
    cpu_distributed_env()
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import stepsync

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    model = tiny_plain_lm()
    rows = windowed(counts, gas)
    result = TokenRun(truths=rule_gradients(model, rows[:gas]))
    result.before = [p.detach().float().clone() for p in model.parameters()]
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    watch = stepsync.watch(model, optimizer=optimizer, policy=policy, dataloader=rows, num_epochs=1,
                           gradient_accumulation_steps=gas, console=False,
                           loss_normalisation=declared) if policy else None

    steps = SimpleNamespace(global_steps=0)  # the optimizer's steps, as an engine's count is read

    def whole():
        return [p.full_tensor().detach().float().clone() for p in model.parameters()]

    def loop():
        for i, batch in enumerate(rows):
            last = (i + 1) % gas == 0 or i + 1 == len(rows)
            model.set_requires_gradient_sync(last)
            summed = summed_token_loss(model(batch["input_ids"]), batch["labels"])
            per_token = batch["window_tokens"] if loss == "token_mean" else trained_tokens(batch) * gas
            (summed / per_token).backward()
            if last:
                optimizer.step(), optimizer.zero_grad()
                steps.global_steps += 1
                if not result.after:
                    result.after = whole()

    return _trained(result, watch, loop, whole, steps)
