"""``stepsync verify``: what the installed DeepSpeed does with the user's own config, measured, not looked up.

One real window of G micro-batches through a DeepSpeed engine built from the config (its ZeRO stage, offload,
precision and clipping kept; its optimizer and scheduler replaced by plain SGD at lr 1, which makes the update
exact): a linear model with one weight per micro-batch, each micro-batch a one-hot row, so each weight's move is
that micro-batch's share of the update. A right update gives each 1/G. The window runs twice: the model returning
the loss alone, and returning it with the logits it is computed from (as every transformers model does), with
backward called as the framework calls it (its descriptor's ``backward_call``). Then a window with one non-finite
loss: did the engine skip that update, or apply it? And the clip norm the engine applies. Last, each trained token's
weight: a window of a tiny causal LM whose micro-batches hold 3, 9, 17 and 33 trained tokens (cycled to G), its loss
computed each way the framework's users compute it (its descriptor's ``loss_paths``), read at the logits' gradient as
the run-time check reads it (:mod:`stepsync.engine.tokens`), and the rule it follows named.

One process, or ``world_size`` local processes (torchrun, gloo), on the device DeepSpeed's accelerator finds (CPU
here): on N ranks the model has one weight per sample of every rank, rank r trains samples r*G .. r*G+G-1, and each
sample's share is read times N (1/G when right), so what only several ranks show (a rank's micro-batch left out of the
average) is measured too; the non-finite loss is on the last rank only. DeepSpeed's own output goes to a file, shown
with ``verbose``. Needs torch and deepspeed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

from ..core.choices import unsupported
from ..core.errors import VerifyInputError
from ..core.frameworks import BackwardCall, framework_called, known_frameworks
from .measurement import (
    LOSS_SCALE,
    TOLERANCE,
    DeepSpeedRefusal,
    Verdict,
    in_words,
    measured_verdict,
    measuring_config,
    refused,
    window_shares,
    wrong_micro_batches,
)
from .verify_ranks import as_a_process_of_its_own, on_ranks

__all__ = ["LOSS_SCALE", "Verdict", "explain", "measure_window", "measuring_config", "verify", "verify_command"]


def measure_window(config: Dict[str, Any], g: int, outputs: str = "loss", call: str = BackwardCall.ENGINE,
                   precision: str = "fp32") -> Tuple[List[float], List[int]]:
    """One window of the config on the installed DeepSpeed, for the probes: (each micro-batch's share, the 1-based
    micro-batches whose share is not 1/G)."""
    try:
        _, weights = _quietly(lambda: window_shares(measuring_config(config, g), g, outputs, BackwardCall(call)))
    except VerifyInputError:
        raise
    except Exception as exc:
        raise VerifyInputError(in_words(exc)) from exc
    return weights, wrong_micro_batches(weights, g, precision)


def verify(config: Dict[str, Any], g: int, framework: str = "deepspeed", world_size: int = 1,
           verbose: bool = False) -> Verdict:
    """Measure one window of ``g`` micro-batches (the loss alone, then with its logits), then one with a
    non-finite loss, on the installed DeepSpeed, backward called as ``framework`` calls it, on ``world_size`` local
    ranks; DeepSpeed's own output shown only where ``verbose``."""
    if g < 1:
        raise VerifyInputError(f"--gas {g}: must be >= 1")
    keys = [known.key for known in known_frameworks()]
    if framework not in keys:
        raise VerifyInputError(unsupported("--framework", framework, keys))
    if world_size < 1:
        raise VerifyInputError(f"--world-size {world_size}: must be >= 1")
    measured = measuring_config(config, g, world_size)
    if world_size > 1:
        return on_ranks(measured, g, framework, world_size, verbose)
    try:
        return _quietly(lambda: measured_verdict(measured, g, framework), verbose)
    except DeepSpeedRefusal as exc:
        raise refused(str(exc), 1, verbose) from exc


def _quietly(measure: Callable[[], Any], verbose: bool = False) -> Any:
    """Run ``measure`` as one process of its own, DeepSpeed's output (stdout and stderr, its prints and logs) to a
    file, or to stderr where ``verbose``: the verdict (and --json) is all stdout holds."""
    as_a_process_of_its_own()
    quiet = logging.getLogger("DeepSpeed")
    level = quiet.level
    if not verbose:
        quiet.setLevel(logging.ERROR)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    sink = os.open(os.devnull, os.O_WRONLY) if not verbose else os.dup(2)
    os.dup2(sink, 1)
    if not verbose:
        os.dup2(sink, 2)
    try:
        return measure()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, sink):
            os.close(fd)
        quiet.setLevel(level)


def explain(verdict: Verdict) -> List[str]:
    """The verdict in lines, for the console."""
    g = verdict.g
    world = verdict.world_size
    ranks = f" on {world} ranks" if world > 1 else ""
    caller = framework_called(verdict.framework).name
    lines = [f"DeepSpeed {verdict.deepspeed}, ZeRO-{verdict.stage}, offload {verdict.offload}, {verdict.precision}, "
             f"G={g}, backward called as {caller} calls it: one window measured{ranks}"]
    tolerance = TOLERANCE.get(verdict.precision, 1e-4)
    for title, weights in (("the model returns the loss alone", verdict.weights),
                           ("the model returns the loss with its logits", verdict.weights_with_logits)):
        wrong = verdict.wrong(weights)
        lines.append(f"{title}" + (f" (each share times the {world} ranks)" if world > 1 else "") + ":")
        for i, weight in enumerate(weights):
            mark = "" if abs(weight * g - 1) <= tolerance else "   <- not 1/G"
            rank = f"rank {i // g}, " if world > 1 else ""
            lines.append(f"  {rank}micro-batch {i % g + 1}: {weight * g:.4g} x 1/{g} of the update{mark}")
        if wrong:
            lines.append(f"  micro-batch(es) {wrong} do not weigh 1/{g}: this stack and config do not train what "
                         "the loss says")
    if verdict.right:
        lines.append("every micro-batch weighs 1/G: the update is right")
    lines.append(f"clip norm in force: {verdict.clip:g}" if verdict.clip else "clip norm in force: none")
    lines.append({"skipped": "a non-finite loss: the engine skipped that update (counted in skipped_steps)",
                  "applied": "a non-finite loss: the engine APPLIED it; the weights are no longer finite",
                  "moved on": "a non-finite loss: the engine moved the weights and they stayed finite",
                  "stopped": f"a non-finite loss: DeepSpeed stopped the run ({verdict.non_finite_error})"}[
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


def verify_command(config: Dict[str, Any], g: int, as_json: bool, framework: str = "deepspeed", world_size: int = 1,
                   verbose: bool = False) -> int:
    """``stepsync verify``: the verdict printed; 0 when every micro-batch weighs 1/G, 1 when one does not, 2 for a
    config DeepSpeed cannot run here (with why, never a traceback)."""
    try:
        verdict = verify(config, g, framework, world_size, verbose)
    except VerifyInputError as exc:
        print(f"stepsync: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(verdict.to_dict()) if as_json else "\n".join(explain(verdict)))
    return 0 if verdict.right else 1

