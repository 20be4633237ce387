"""``stepsync verify``: what the installed DeepSpeed does with the user's own config, measured, not looked up.

One real window of G micro-batches through a DeepSpeed engine built from the config (its ZeRO stage, offload,
precision and clipping kept; its optimizer and scheduler replaced by plain SGD at lr 1, which makes the update
exact): a linear model with one weight per micro-batch, each micro-batch a one-hot row, so each weight's move is
that micro-batch's share of the update. A right update gives each 1/G. The window runs twice: the model returning
the loss alone, and returning it with the logits it is computed from (as every transformers model does), with
backward called as the framework calls it (:data:`FRAMEWORK_CALLS`). Then a window with one non-finite loss: did
the engine skip that update, or apply it? And the clip norm the engine applies. Last, each trained token's weight:
a window of a tiny causal LM whose micro-batches hold 3, 9, 17 and 33 trained tokens (cycled to G), its loss computed
each way the framework's users compute it (:data:`LOSS_PATHS`), read at the logits' gradient as the run-time check
reads it (:mod:`stepsync.engine.tokens`), and the rule it follows named.

Single process, on the device DeepSpeed's accelerator finds (CPU here). Needs torch and deepspeed.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core.choices import unsupported
from ..core.errors import VerifyInputError
from ..core.frameworks import FRAMEWORKS, BackwardCall
from ..core.tokens import Normalisation, weigh_window
from ..engine.tokens import sequence_weights
from .config import disagreement, engine_settings
from .tiny_run import cpu_distributed_env

# The loss is scaled this small so that no clip norm a config sets ever acts on the measured window.
LOSS_SCALE = 1e-3
# How far a measured weight may be from 1/G: bf16 keeps 8 bits of mantissa.
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-3}
# How each framework calls backward on the engine (its descriptor's BackwardCall), and its name in words.
FRAMEWORK_CALLS = {framework.key: (framework.backward_call, framework.name) for framework in FRAMEWORKS}
# Trained tokens of the token window's micro-batches, cycled to G: counts that tell the rules apart.
TOKEN_COUNTS = (3, 9, 17, 33)
VOCABULARY = 64
# How each framework's users compute a window's loss, in words: (the loss path, what it is).
LOSS_PATHS = {
    "trainer": (("divided by num_items_in_batch", "a transformers model's loss (the Trainer passes num_items_in_batch "
                 "and does not divide by G, as transformers 4.47 and later do)"),
                ("own mean, not divided by G", "a model whose forward takes **kwargs and ignores num_items_in_batch")),
    "lightning": (("own mean", "each micro-batch's own mean, as F.cross_entropy gives it"),),
    "default": (("own mean", "each micro-batch's own mean, as F.cross_entropy gives it (the examples)"),
                ("window tokens, times G", "summed and divided by the window's trained tokens, times G "
                 "(accelerate's gradient_accumulation_for_autoregressive_models example)")),
}
KEYS_REPLACED = ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps")


@dataclass
class Verdict:
    """What the engine did in the measured windows.

    Attributes:
        deepspeed: the release measured.
        stage, offload, precision: what the config asks.
        g: micro-batches per update.
        framework: whose backward call was measured (:data:`FRAMEWORK_CALLS`).
        weights: each micro-batch's share of the update, in order (1/G each when right), the model returning the
            loss alone.
        weights_with_logits: the same, the model returning the loss with the logits it is computed from.
        right: every weight of both is 1/G within the precision's tolerance.
        clip: the clip norm the engine applies (0: none).
        non_finite: what the engine did with a window holding a non-finite loss: "skipped" (its
            ``skipped_steps`` rose, the weights did not move), "applied" (the weights are no longer finite), or
            "moved on" (neither: the weights moved and stayed finite).
        notes: what was changed in the config to measure, and why.
        tokens: each loss path's token window (:data:`LOSS_PATHS`): its words, and the rule its weights follow
            (:meth:`stepsync.core.tokens.TokenWeighting.to_dict`) with each micro-batch's token weight times the
            window's trained tokens (1 for each under a token mean).
    """

    deepspeed: str
    stage: int
    offload: str
    precision: str
    g: int
    framework: str = "deepspeed"
    weights: List[float] = field(default_factory=list)
    weights_with_logits: List[float] = field(default_factory=list)
    right: bool = False
    clip: float = 0.0
    non_finite: str = ""
    notes: List[str] = field(default_factory=list)
    tokens: List[Dict[str, Any]] = field(default_factory=list)

    def wrong(self, weights: Optional[List[float]] = None) -> List[int]:
        """1-based micro-batches whose share is not 1/G (of ``weights``; the loss-alone window by default)."""
        return wrong_micro_batches(self.weights if weights is None else weights, self.g, self.precision)

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "wrong_micro_batches": self.wrong(),
                "wrong_micro_batches_with_logits": self.wrong(self.weights_with_logits)}


def wrong_micro_batches(weights: List[float], g: int, precision: str) -> List[int]:
    """1-based micro-batches whose share is not 1/G within the precision's tolerance."""
    tolerance = TOLERANCE.get(precision, 1e-4)
    return [k for k, w in enumerate(weights, 1) if abs(w * g - 1) > tolerance]


def measuring_config(config: Dict[str, Any], g: int) -> Dict[str, Any]:
    """The user's config with what the measurement needs: G micro-batches of one sample, and no optimizer or
    scheduler of its own (the engine takes the client's plain SGD)."""
    if not isinstance(config, dict):
        raise VerifyInputError("the DeepSpeed config must be a JSON object")
    own = config.get("gradient_accumulation_steps", "auto")
    if own != "auto" and own != g:
        raise VerifyInputError(disagreement("gradient_accumulation_steps", own, g, "--gas says"))
    measured = {k: v for k, v in copy.deepcopy(config).items() if k not in KEYS_REPLACED}
    measured.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=g, train_batch_size=g,
                    zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
    for precision in ("bf16", "fp16"):
        section = measured.get(precision)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = False  # "auto" follows a framework's flag; here nothing sets it
    if measured.get("gradient_clipping") == "auto":
        measured["gradient_clipping"] = 1.0  # what the Trainer and accelerate fill it with by default
    return measured


def _engine(config: Dict[str, Any], g: int, outputs: str = "loss"):
    import deepspeed
    import torch

    class OneWeightPerMicroBatch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(g))

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


def _window(engine, g: int, call: BackwardCall = BackwardCall.ENGINE, nan_at: Optional[int] = None) -> None:
    import torch

    dtype = next(engine.module.parameters()).dtype
    for k in range(g):
        x = torch.zeros(g, dtype=dtype, device=engine.device)
        x[k] = 1
        output = engine(x)
        loss = output["loss"] if isinstance(output, dict) else output
        if k == nan_at:
            loss = loss * float("nan")
        if call is BackwardCall.TRAINER:
            engine.backward(loss / g, scale_wrt_gas=False)
        elif call is BackwardCall.LIGHTNING:
            engine.backward(loss / g)
        else:
            engine.backward(loss)
        engine.step()


def _shares(measured: Dict[str, Any], g: int, outputs: str, call: BackwardCall):
    """One window on a fresh engine: (the engine, each micro-batch's share of the update)."""
    engine = _engine(measured, g, outputs)
    before = _weights(engine)
    _window(engine, g, call)
    return engine, [(b - a) / LOSS_SCALE for b, a in zip(before, _weights(engine))]


def measure_window(config: Dict[str, Any], g: int, outputs: str = "loss", call: str = BackwardCall.ENGINE,
                   precision: str = "fp32") -> Tuple[List[float], List[int]]:
    """One window of the config on the installed DeepSpeed, for the probes: (each micro-batch's share, the 1-based
    micro-batches whose share is not 1/G)."""
    try:
        _, weights = _quietly(lambda: _shares(measuring_config(config, g), g, outputs, BackwardCall(call)))
    except VerifyInputError:
        raise
    except Exception as exc:
        raise VerifyInputError(f"{type(exc).__name__}: {exc}") from exc
    return weights, wrong_micro_batches(weights, g, precision)


def verify(config: Dict[str, Any], g: int, framework: str = "deepspeed") -> Verdict:
    """Measure one window of ``g`` micro-batches (the loss alone, then with its logits), then one with a
    non-finite loss, on the installed DeepSpeed, backward called as ``framework`` calls it."""
    if g < 1:
        raise VerifyInputError(f"--gas {g}: must be >= 1")
    if framework not in FRAMEWORK_CALLS:
        raise VerifyInputError(unsupported("--framework", framework, FRAMEWORK_CALLS))
    measured = measuring_config(config, g)
    stage, offload, precision = engine_settings(measured)
    verdict = Verdict(version("deepspeed"), stage if stage is not None else 0, offload, precision, g, framework)
    verdict.notes.append("measured with plain SGD at lr 1 in place of the config's optimizer and scheduler, one "
                         "sample per micro-batch, one process")
    try:
        _quietly(lambda: _measure(verdict, measured, g, FRAMEWORK_CALLS[framework][0]))
    except VerifyInputError:
        raise
    except Exception as exc:  # DeepSpeed refuses the config: say why, never a traceback
        raise VerifyInputError(f"DeepSpeed {verdict.deepspeed} cannot train this config on this machine: "
                               f"{type(exc).__name__}: {exc}") from exc
    return verdict


def _quietly(measure: Callable[[], Any]) -> Any:
    """Run ``measure`` as one process of its own, DeepSpeed's stdout sent to stderr."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # one process of its own: never a launcher's rank or an inherited port
    cpu_distributed_env()
    quiet = logging.getLogger("DeepSpeed")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    # DeepSpeed writes to stdout (logs and prints): to stderr while it runs, so that the verdict (and --json) is
    # all stdout holds.
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        return measure()
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
        quiet.setLevel(level)


def _measure(verdict: Verdict, measured: Dict[str, Any], g: int, call: BackwardCall) -> None:
    _, verdict.weights_with_logits = _shares(measured, g, "loss+logits", call)
    engine, verdict.weights = _shares(measured, g, "loss", call)
    clip = engine.gradient_clipping()
    verdict.clip = float(clip) if isinstance(clip, (int, float)) else 0.0
    verdict.right = not verdict.wrong() and not verdict.wrong(verdict.weights_with_logits)
    after = _weights(engine)
    skipped = engine.skipped_steps
    _window(engine, g, call, nan_at=0)
    last = _weights(engine)
    if engine.skipped_steps > skipped and last == after:
        verdict.non_finite = "skipped"
    elif not all(math.isfinite(v) for v in last):
        verdict.non_finite = "applied"
    else:
        verdict.non_finite = "moved on"
    for path, words in LOSS_PATHS.get(verdict.framework, LOSS_PATHS["default"]):
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
        divisor = {"divided by num_items_in_batch": window_tokens,
                   "window tokens, times G": window_tokens / g}.get(path, count)
        out = engine(ids, labels, divisor)
        logits = made.pop()
        logits.register_hook(_reader(records, logits.detach(), k))
        if call is BackwardCall.TRAINER:  # no division by G; the loss times the ranks (one), as the Trainer does
            engine.backward(out["loss"] * 1, scale_wrt_gas=False)
        elif call is BackwardCall.LIGHTNING:
            engine.backward(out["loss"] / g)
        else:
            engine.backward(out["loss"])
        engine.step()
    weighting = weigh_window(records, Normalisation.TOKEN_MEAN, 1, 1, "", g=g)
    per_micro_batch: Dict[int, float] = {}
    for record in records:
        per_micro_batch[record.micro_batch] = record.heaviest * window_tokens
    return weighting, [per_micro_batch[k] for k in sorted(per_micro_batch)]


def explain(verdict: Verdict) -> List[str]:
    """The verdict in lines, for the console."""
    g = verdict.g
    lines = [f"DeepSpeed {verdict.deepspeed}, ZeRO-{verdict.stage}, offload {verdict.offload}, {verdict.precision}, "
             f"G={g}, backward called as {FRAMEWORK_CALLS[verdict.framework][1]} calls it: one window measured"]
    for title, weights in (("the model returns the loss alone", verdict.weights),
                           ("the model returns the loss with its logits", verdict.weights_with_logits)):
        wrong = verdict.wrong(weights)
        lines.append(f"{title}:")
        for k, weight in enumerate(weights, 1):
            mark = "" if k not in wrong else "   <- not 1/G"
            lines.append(f"  micro-batch {k}: {weight * g:.4g} x 1/{g} of the update{mark}")
        if wrong:
            lines.append(f"  micro-batch(es) {wrong} do not weigh 1/{g}: this stack and config do not train what "
                         "the loss says")
    if verdict.right:
        lines.append("every micro-batch weighs 1/G: the update is right")
    lines.append(f"clip norm in force: {verdict.clip:g}" if verdict.clip else "clip norm in force: none")
    lines.append({"skipped": "a non-finite loss: the engine skipped that update (counted in skipped_steps)",
                  "applied": "a non-finite loss: the engine APPLIED it; the weights are no longer finite",
                  "moved on": "a non-finite loss: the engine moved the weights and they stayed finite"}[
        verdict.non_finite])
    for window in verdict.tokens:
        counts = ", ".join(str(count) for count in window["tokens"])
        lines.append(f"each trained token's weight, micro-batches of {counts} tokens, the loss {window['loss']}: "
                     f"{window['found']}")
        lines.append("  per token, times the window's trained tokens (1 each under a token mean): "
                     + ", ".join(f"{weight:.3g}" for weight in window["per_token_times_n"])
                     + (f"; {window['total']:.3g} in all" if window["total"] is not None else ""))
    lines += [f"note: {note}" for note in verdict.notes]
    return lines


def verify_command(config: Dict[str, Any], g: int, as_json: bool, framework: str = "deepspeed") -> int:
    """``stepsync verify``: the verdict printed; 0 when every micro-batch weighs 1/G, 1 when one does not, 2 for a
    config DeepSpeed cannot run here (with why, never a traceback)."""
    try:
        verdict = verify(config, g, framework)
    except VerifyInputError as exc:
        print(f"stepsync: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(verdict.to_dict()) if as_json else "\n".join(explain(verdict)))
    return 0 if verdict.right else 1
