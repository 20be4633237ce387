"""The window ``stepsync verify`` measures, on one rank: the engine built from the user's config, the model of one
weight per sample, each micro-batch's share read from the weights, what a non-finite loss does, each trained token's
weight; and DeepSpeed's refusals in words. :mod:`stepsync.tools.verify` runs it in one process,
:mod:`stepsync.tools.verify_ranks` on several.
"""
from __future__ import annotations

import copy
import math
import os
import traceback
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from typing import Any, Callable, Dict, List, Optional

from ..core.errors import VerifyInputError
from ..core.frameworks import ITEMS_IN_BATCH, WINDOW_TOKENS_TIMES_G, BackwardCall, framework_called
from ..core.tokens import Normalisation, weigh_window
from ..engine.tokens import sequence_weights
from .config import disagreement, engine_settings

# The loss is scaled this small so that no clip norm a config sets ever acts on the measured window.
LOSS_SCALE = 1e-3
# How far a measured weight may be from 1/G: bf16 keeps 8 bits of mantissa.
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-3}
# Trained tokens of the token window's micro-batches, cycled to G: counts that tell the rules apart.
TOKEN_COUNTS = (3, 9, 17, 33)
VOCABULARY = 64
KEYS_REPLACED = ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps")


@dataclass
class Verdict:
    """What the engine did in the measured windows.

    Attributes:
        deepspeed: the release measured.
        stage, offload, precision: what the config asks.
        g: micro-batches per update.
        framework: whose backward call was measured (its key: its descriptor's ``backward_call``).
        world_size: the ranks measured.
        weights: each micro-batch's share of the update, rank by rank, in order (1/G each when right: on N ranks
            each sample's share times N), the model returning the loss alone.
        weights_with_logits: the same, the model returning the loss with the logits it is computed from.
        right: every weight of both is 1/G within the precision's tolerance.
        clip: the clip norm the engine applies (0: none).
        non_finite: what the engine did with a window holding a non-finite loss: "skipped" (its
            ``skipped_steps`` rose, the weights did not move), "applied" (the weights are no longer finite),
            "moved on" (neither: the weights moved and stayed finite), or "stopped" (DeepSpeed raised:
            ``non_finite_error`` says what).
        notes: what was changed in the config to measure, and why.
        tokens: each loss path's token window (the framework's ``loss_paths``): its words, and the rule its weights
            follow (:meth:`stepsync.core.tokens.TokenWeighting.to_dict`) with each micro-batch's token weight times the
            window's trained tokens (1 for each under a token mean).
    """

    deepspeed: str
    stage: int
    offload: str
    precision: str
    g: int
    framework: str = "deepspeed"
    world_size: int = 1
    weights: List[float] = field(default_factory=list)
    weights_with_logits: List[float] = field(default_factory=list)
    right: bool = False
    clip: float = 0.0
    non_finite: str = ""
    non_finite_error: str = ""
    notes: List[str] = field(default_factory=list)
    tokens: List[Dict[str, Any]] = field(default_factory=list)

    def wrong(self, weights: Optional[List[float]] = None) -> List[int]:
        """1-based micro-batches whose share is not 1/G (of ``weights``; the loss-alone window by default)."""
        return wrong_micro_batches(self.weights if weights is None else weights, self.g, self.precision)

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "wrong_micro_batches": self.wrong(),
                "wrong_micro_batches_with_logits": self.wrong(self.weights_with_logits)}


def wrong_micro_batches(weights: List[float], g: int, precision: str) -> List[int]:
    """1-based micro-batches of a window whose share is not 1/G within the precision's tolerance on some rank
    (``weights``: each rank's window in turn)."""
    tolerance = TOLERANCE.get(precision, 1e-4)
    return sorted({i % g + 1 for i, w in enumerate(weights) if abs(w * g - 1) > tolerance})


def measuring_config(config: Dict[str, Any], g: int, world_size: int = 1) -> Dict[str, Any]:
    """The user's config with what the measurement needs: G micro-batches of one sample on each of ``world_size``
    ranks, and no optimizer or scheduler of its own (the engine takes the client's plain SGD)."""
    if not isinstance(config, dict):
        raise VerifyInputError("the DeepSpeed config must be a JSON object")
    own = config.get("gradient_accumulation_steps", "auto")
    if own != "auto" and own != g:
        raise VerifyInputError(disagreement("gradient_accumulation_steps", own, g, "--gas says"))
    measured = {k: v for k, v in copy.deepcopy(config).items() if k not in KEYS_REPLACED}
    measured.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=g, train_batch_size=g * world_size,
                    zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
    for precision in ("bf16", "fp16"):
        section = measured.get(precision)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = False  # "auto" follows a framework's flag; here nothing sets it
    if measured.get("gradient_clipping") == "auto":
        measured["gradient_clipping"] = 1.0  # what the Trainer and accelerate fill it with by default
    return measured


def _engine(config: Dict[str, Any], g: int, outputs: str = "loss", world: int = 1):
    import deepspeed
    import torch

    class OneWeightPerMicroBatch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(world * g))

        def forward(self, x):
            logits = self.w * x
            loss = LOSS_SCALE * logits.sum()
            return {"loss": loss, "logits": logits} if outputs == "loss+logits" else loss

    model = OneWeightPerMicroBatch()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _weights(engine) -> List[float]:
    import deepspeed

    with deepspeed.zero.GatheredParameters([engine.module.w]):  # ZeRO-3 keeps a partition per rank
        return [float(v) for v in engine.module.w.detach().float()]


def _window(engine, g: int, call: BackwardCall = BackwardCall.ENGINE, nan_at: Optional[int] = None,
            rank: int = 0, world: int = 1) -> None:
    import torch

    dtype = next(engine.module.parameters()).dtype
    for k in range(g):
        x = torch.zeros(world * g, dtype=dtype, device=engine.device)
        x[rank * g + k] = 1
        output = engine(x)
        loss = output["loss"] if isinstance(output, dict) else output
        if k == nan_at:
            loss = loss * float("nan")
        call.backward(engine, loss, g)
        engine.step()


def window_shares(measured: Dict[str, Any], g: int, outputs: str, call: BackwardCall, rank: int = 0, world: int = 1):
    """One window on a fresh engine: (the engine, each micro-batch's share of the update, times the ranks)."""
    engine = _engine(measured, g, outputs, world)
    before = _weights(engine)
    _window(engine, g, call, rank=rank, world=world)
    return engine, [(b - a) / LOSS_SCALE * world for b, a in zip(before, _weights(engine))]


# DeepSpeed's refusals met on these machines (weight_probes.json's cannot_run rows), and their way round.
KNOWN_REFUSALS = (
    ("unsupported mix of model_dtype", "DeepSpeed takes an fp32 gradient accumulation in bf16 only with ZeRO 1 to 3: "
                                       "drop data_types.grad_accum_dtype, or use ZeRO-1"),
    ("Output 0 of Split is a view", "DeepSpeed 0.18.7 - 0.18.9's ZeRO 1 and 2 fail so on several ranks over gloo "
                                    "(CPU), in fp32 and bf16, as probed (NCCL is not measured here): upgrade "
                                    "DeepSpeed to 0.19.0 or later, or measure on one rank"),
)


def refused(why: str, world: int, verbose: bool) -> VerifyInputError:
    """DeepSpeed's refusal in words, with the way round where it is known."""
    fix = next((f"; {way}" for words, way in KNOWN_REFUSALS if words in why), "")
    why = why.rstrip(".")
    ranks = f"on {world} ranks " if world > 1 else ""
    tail = "" if verbose else "; stepsync verify --verbose shows DeepSpeed's own output"
    return VerifyInputError(f"DeepSpeed {version('deepspeed')} cannot train this config {ranks}on this machine: "
                            f"{why}{fix}{tail}")


class DeepSpeedRefusal(Exception):
    """DeepSpeed raised while the window was measured: its words, or where it raised where it gave none."""


def in_words(exc: BaseException) -> str:
    """An exception as ``Type: message``; where the message is empty (a bare assert), where it was raised and the
    line that raised it."""
    text = str(exc).strip()
    if text:
        return f"{type(exc).__name__}: {text}"[:400]
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    frame = frames[-1]
    where = frame.filename.replace(os.sep, "/")
    where = where[where.rfind("deepspeed/"):] if "deepspeed/" in where else os.path.basename(where)
    return f"{type(exc).__name__} at {where}:{frame.lineno} ({(frame.line or '').strip()})"


def measured_verdict(measured: Dict[str, Any], g: int, framework: str, rank: int = 0, world: int = 1) -> Verdict:
    """The measurement on this rank (every rank runs it; rank 0's is the answer)."""
    stage, offload, precision = engine_settings(measured)
    verdict = Verdict(version("deepspeed"), stage if stage is not None else 0, offload, precision, g, framework,
                      world)
    verdict.notes.append("measured with plain SGD at lr 1 in place of the config's optimizer and scheduler, one "
                         "sample per micro-batch, " + (f"{world} local processes (gloo), the non-finite loss on the "
                                                       "last rank only" if world > 1 else "one process"))
    try:
        _measure(verdict, measured, g, framework_called(framework).backward_call, rank, world)
    except Exception as exc:  # DeepSpeed refuses the config: say why, never a traceback
        raise DeepSpeedRefusal(in_words(exc)) from exc
    return verdict


def _measure(verdict: Verdict, measured: Dict[str, Any], g: int, call: BackwardCall, rank: int = 0,
             world: int = 1) -> None:
    _, verdict.weights_with_logits = window_shares(measured, g, "loss+logits", call, rank, world)
    engine, verdict.weights = window_shares(measured, g, "loss", call, rank, world)
    clip = engine.gradient_clipping()
    verdict.clip = float(clip) if isinstance(clip, (int, float)) else 0.0
    verdict.right = not verdict.wrong() and not verdict.wrong(verdict.weights_with_logits)
    after = _weights(engine)
    skipped = engine.skipped_steps
    try:
        _window(engine, g, call, nan_at=0 if rank == world - 1 else None, rank=rank, world=world)
    except Exception as exc:  # DeepSpeed's own check (its bf16 optimizer asserts a positive norm): loud
        verdict.non_finite, verdict.non_finite_error = "stopped", in_words(exc)
    else:
        last = _weights(engine)
        if engine.skipped_steps > skipped and last == after:
            verdict.non_finite = "skipped"
        elif not all(math.isfinite(v) for v in last):
            verdict.non_finite = "applied"
        else:
            verdict.non_finite = "moved on"
    if world > 1:
        verdict.notes.append("each trained token's weight is measured in one process: stepsync verify without "
                             "--world-size")
        return
    for path, words in framework_called(verdict.framework).loss_paths:
        weighting, per_token = _token_window(measured, g, call, path)
        verdict.tokens.append({"loss": words, **weighting.to_dict(), "per_token_times_n": per_token})


def _reader(records: List[Any], logits: Any, micro_batch: int) -> Callable[[Any], None]:
    """A hook on ``logits`` that adds its micro-batch's token weights to ``records``."""
    return lambda grad: records.extend(sequence_weights(logits, grad, micro_batch))


def _token_window(measured: Dict[str, Any], g: int, call: BackwardCall, path: str):
    """One window of a tiny causal LM (an embedding and a head with ``get_output_embeddings``), micro-batch k one
    sequence of ``TOKEN_COUNTS[k % 4]`` trained tokens, its loss computed by ``path`` and handed to the engine as
    ``call`` does: (the rule named, each micro-batch's token weight times the window's trained tokens)."""
    import deepspeed
    import torch

    torch.manual_seed(0)

    class TinyLM(torch.nn.Module):
        """A causal LM as transformers models are: the loss computed inside from its logits, both returned."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCABULARY, 16)
            self.head = torch.nn.Linear(16, VOCABULARY)

        def get_output_embeddings(self):
            return self.head

        def forward(self, ids, labels, divisor):
            logits = self.head(torch.tanh(self.embed(ids)))
            summed = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCABULARY).float(),
                                                       labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
            return {"loss": summed / divisor, "logits": logits}

    model = TinyLM()
    made: List[Any] = []  # the head's output, hooked once the engine's forward returns, as the run-time check does
    model.head.register_forward_hook(lambda module, inputs, output: made.append(output))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=measured)
    counts = [TOKEN_COUNTS[k % len(TOKEN_COUNTS)] for k in range(g)]
    window_tokens = sum(counts)
    records: List[Any] = []
    generator = torch.Generator().manual_seed(1)
    for k, count in enumerate(counts):
        ids = torch.randint(0, VOCABULARY, (1, max(TOKEN_COUNTS) + 2), generator=generator).to(engine.device)
        labels = ids.clone()
        labels[:, count + 1:] = -100
        # what the loss divides its summed tokens by: the window's tokens (times G where the framework divides by
        # G), or the micro-batch's own
        divisor = {ITEMS_IN_BATCH: window_tokens, WINDOW_TOKENS_TIMES_G: window_tokens / g}.get(path, count)
        out = engine(ids, labels, divisor)
        logits = made.pop()
        logits.register_hook(_reader(records, logits.detach(), k))
        call.backward(engine, out["loss"], g, items_counted=True)
        engine.step()
    weighting = weigh_window(records, Normalisation.TOKEN_MEAN, 1, 1, "", g=g)
    per_micro_batch: Dict[int, float] = {}
    for record in records:
        per_micro_batch[record.micro_batch] = record.heaviest * window_tokens
    return weighting, [per_micro_batch[k] for k in sorted(per_micro_batch)]
