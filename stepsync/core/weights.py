"""What each DeepSpeed release trains: each micro-batch's weight in its update, as probed.

The probes (``weight_probes.json`` beside this module) are ``stepsync verify``'s own measurement run on every
release listed, on this project's CPU machines with torch 2.13: ZeRO 0-3, the optimizer offloaded to the CPU or
not, fp32 and bf16, G = 2, 3 and 4, one window through the engine itself, each micro-batch's weight solved from
the parameters; and, for the releases around DeepSpeed's backward hooks (0.18.2-0.19.8), the model's output as
the loss alone or as the loss with the logits it is computed from, backward called as a plain loop calls it
(``engine.backward(loss)``: accelerate, Lightning, Fabric) or as the Trainer does
(``engine.backward(loss / G, scale_wrt_gas=False)``), by ``scripts/probe_outputs.py``. A right update gives
each micro-batch 1/G. The rows below name each fault found, the first and last release measured with it and the
first measured without it; ``tests/unit/test_weights.py`` fails when the rows and the data disagree. Pure: no
torch, no DeepSpeed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, List, Optional, Tuple

from .frameworks import BackwardCall
from .versions import parse_version

PROBES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weight_probes.json")
# The backward calls the probes measured (BackwardCall says each in words; Lightning's weighs as the engine's).
CALLS = (BackwardCall.ENGINE, BackwardCall.ACCELERATE, BackwardCall.TRAINER)
FP32_NAMES = ("fp32", "float32", "float", "torch.float32")  # what DeepSpeed's DtypeEnum reads as fp32


@dataclass(frozen=True)
class WeightFault:
    """A configuration in which some micro-batches do not weigh 1/G of their update.

    Attributes:
        name: a short handle.
        stages: the ZeRO stages it shows on.
        offload: True where the optimizer is offloaded to the CPU, False where it is not, None for both.
        precision: "bf16" or "fp32" where it shows on one only, None for both.
        smallest_g: the smallest G it shows at.
        first_measured, last_measured: the first and last release measured with it.
        fixed_in: the first release measured without it after it.
        right_before: the last release measured without it before it (None: none before could run it here).
        effect: what happens, in words.
        avoid: how to avoid it.
        first_wrong, last_kept: the window's micro-batches from ``first_wrong`` (1-based) on do not weigh 1/G,
            up to the last one, which keeps its weight where ``last_kept``; only the last where ``last_only``.
        calls: the backward calls it shows with (:data:`CALLS`).
        through_outputs: it shows only where the loss is computed from another tensor of the model's output (a
            transformers model's logits): known at the first forward, not before.
        repairable: ``sync`` makes the update right from outside DeepSpeed (it undoes a division by G).
        accelerate: (the first accelerate release measured with it, the first measured without it after it) where
            it needs accelerate too; None where it does not.
        smallest_world: the fewest data-parallel ranks it shows on.
        grad_accum_fp32: True where it shows only with the config's ``data_types.grad_accum_dtype: fp32``, None
            with or without it.
        immediate_update_avoids: ``bf16.immediate_grad_update: true`` avoids it (read at the engine's init only).
    """

    name: str
    stages: Tuple[int, ...]
    offload: Optional[bool]
    precision: Optional[str]
    smallest_g: int
    first_measured: str
    last_measured: str
    fixed_in: str
    right_before: Optional[str]
    effect: str
    avoid: str
    first_wrong: int = 1
    last_kept: bool = False
    last_only: bool = False
    calls: Tuple[BackwardCall, ...] = CALLS
    through_outputs: bool = False
    repairable: bool = False
    accelerate: Optional[Tuple[str, str]] = None
    smallest_world: int = 1
    grad_accum_fp32: Optional[bool] = None
    immediate_update_avoids: bool = False

    def shows(self, deepspeed: str, stage: int, offload: bool, precision: str, g: int,
              call: BackwardCall = BackwardCall.ENGINE,
              through_outputs: Optional[bool] = False, accelerate: Optional[str] = None, world_size: int = 1,
              accumulation: Optional[Accumulation] = None) -> bool:
        """Whether this fault shows on this release and configuration: measured from ``first_measured`` on, and
        taken to last until ``fixed_in`` (the releases between the last measured and the fix included).
        ``through_outputs`` None: not known yet (before the first forward), so a fault that needs it may show."""
        accumulation = accumulation or Accumulation()
        return (stage in self.stages and self.offload in (None, offload) and self.precision in (None, precision)
                and g >= self.smallest_g and BackwardCall(call).as_probed in self.calls
                and world_size >= self.smallest_world
                and self.grad_accum_fp32 in (None, accumulation.fp32)
                and not (self.immediate_update_avoids and accumulation.immediate_update)
                and (not self.through_outputs or through_outputs is not False)
                and _within(deepspeed, self.first_measured, self.fixed_in)
                and (self.accelerate is None or (accelerate is not None and _within(accelerate, *self.accelerate))))

    def wrong_micro_batches(self, g: int) -> List[int]:
        """The 1-based micro-batches of a window that do not weigh 1/G."""
        return list(range(g if self.last_only else self.first_wrong, g if self.last_kept else g + 1))

    def message(self, deepspeed: str, g: int) -> str:
        wrong = self.wrong_micro_batches(g)
        return (f"DeepSpeed {deepspeed} {self.effect} (micro-batch(es) {wrong} of every window of {g}; measured on "
                f"{self.first_measured} to {self.last_measured}, right again on {self.fixed_in}): {self.avoid}")


@dataclass(frozen=True)
class Accumulation:
    """How a bf16 config accumulates gradients: ``data_types.grad_accum_dtype: fp32`` (``fp32``; with ZeRO-1 it
    makes DeepSpeed pick its BF16_Optimizer) and ``bf16.immediate_grad_update`` (``immediate_update``)."""

    fp32: bool = False
    immediate_update: bool = False

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> Accumulation:
        """As a DeepSpeed config (a dict) asks it."""
        types = config.get("data_types") or {}
        bf16 = config.get("bf16") or config.get("bfloat16") or {}
        return cls(isinstance(types, dict) and str(types.get("grad_accum_dtype")).lower() in FP32_NAMES,
                   isinstance(bf16, dict) and bf16.get("immediate_grad_update") is True)


def _within(release: str, first: str, fixed: str) -> bool:
    return parse_version(first) <= parse_version(release) < parse_version(fixed)


FAULTS = (
    WeightFault("offload-keeps-first-and-last", (2,), True, None, 3, "0.17.5", "0.18.9", "0.19.0", None,
                "with ZeRO-2 and the optimizer offloaded to the CPU keeps only the first and the last micro-batch "
                "of each window in the update: the ones between weigh 0",
                "upgrade DeepSpeed to 0.19.0 or later, or use ZeRO-1 or ZeRO-3 with the same offload, or G <= 2",
                first_wrong=2, last_kept=True),
    WeightFault("zero2-keeps-the-last", (2,), False, None, 2, "0.17.6", "0.18.2", "0.18.3", "0.17.5",
                "with ZeRO-2 keeps only the last micro-batch of each window in the update: the others weigh 0",
                "upgrade DeepSpeed to 0.18.3 or later, or use ZeRO-1", last_kept=True),
    WeightFault("bf16-zero0-divided", (0,), False, "bf16", 2, "0.18.3", "0.18.5", "0.18.6", "0.18.2",
                "with ZeRO-0 in bf16 divides every gradient by 65536: each micro-batch weighs 1/(65536 G)",
                "upgrade DeepSpeed to 0.18.6 or later, or use ZeRO-1"),
    WeightFault("trainer-loss-divided-again", (0, 1, 2, 3), None, None, 2, "0.18.3", "0.18.3", "0.18.4", "0.18.2",
                "divides the Trainer's loss, already divided by G, by G again (its output hooks ignore "
                "scale_wrt_gas=False): each micro-batch weighs 1/G^2",
                "upgrade DeepSpeed to 0.18.4 or later (or pin 0.18.2); policy 'sync' undoes the extra division",
                calls=(BackwardCall.TRAINER,), repairable=True),
    WeightFault("outputs-divided-again", (0, 1, 2), None, None, 2, "0.18.3", "0.19.5", "0.19.6", "0.18.2",
                "divides the gradient by G once more for each tensor of the model's output that the loss is "
                "computed from (a transformers model's logits): each micro-batch weighs 1/G^2 or less",
                "upgrade DeepSpeed to 0.19.6 or later, or return the loss alone from forward (the other "
                "tensors detached), or use ZeRO-3; policy 'sync' undoes the extra division",
                calls=(BackwardCall.ENGINE, BackwardCall.ACCELERATE), through_outputs=True, repairable=True),
    WeightFault("trainer-outputs-divided-again", (0, 1, 2), None, None, 2, "0.18.3", "0.18.3", "0.18.4", "0.18.2",
                "divides the gradient by G once more for each tensor of the model's output that the loss is "
                "computed from (a transformers model's logits), on top of the Trainer's extra division",
                "upgrade DeepSpeed to 0.18.4 or later; policy 'sync' undoes the extra division",
                calls=(BackwardCall.TRAINER,), through_outputs=True, repairable=True),
    WeightFault("accelerate-no-sync-undivided", (0, 1), False, None, 2, "0.16.2", "0.18.2", "0.18.3", "0.15.4",
                "inside accelerate's accumulate() on several ranks (accelerate 1.8.0 - 1.12.x enters the engine's "
                "no_sync()) leaves the micro-batches before the last of each window undivided by G: each weighs "
                "1 in place of 1/G",
                "upgrade accelerate to 1.13.0 or later, or DeepSpeed to 0.18.3 or later",
                last_kept=True, calls=(BackwardCall.ACCELERATE,), accelerate=("1.8.0", "1.13.0"), smallest_world=2),
    WeightFault("bf16-optimizer-last-unaveraged", (1,), False, "bf16", 1, "0.18.5", "0.18.9", "0.19.0", "0.18.2",
                "with ZeRO-1 in bf16 and an fp32 gradient accumulation (data_types.grad_accum_dtype) adds each "
                "window's last micro-batch after the average across ranks: in the part of the update each rank "
                "holds, its own last micro-batch weighs 1/G (N times its share on N ranks) and the other ranks' "
                "last micro-batches weigh 0; with G=1 no gradient is averaged across ranks",
                'set "bf16": {"immediate_grad_update": true} in the DeepSpeed config (read only when the engine '
                "is built), or upgrade DeepSpeed to 0.19.0 or later, or drop data_types.grad_accum_dtype",
                last_only=True, smallest_world=2, grad_accum_fp32=True, immediate_update_avoids=True),
    WeightFault("bf16-zero1-fp32-accumulation-divided", (1,), False, "bf16", 1, "0.18.3", "0.18.4", "0.18.5",
                "0.18.2",
                "with ZeRO-1 in bf16 and an fp32 gradient accumulation (data_types.grad_accum_dtype) takes ZeRO-0's "
                "bf16 optimizer, which divides every gradient by 65536: each micro-batch weighs 1/(65536 G)",
                "upgrade DeepSpeed to 0.19.0 or later, or drop data_types.grad_accum_dtype",
                grad_accum_fp32=True),
)


def weight_faults(deepspeed: str, stage: int, offload: bool, precision: str, g: int,
                  call: BackwardCall = BackwardCall.ENGINE,
                  through_outputs: Optional[bool] = False, accelerate: Optional[str] = None,
                  world_size: int = 1, accumulation: Optional[Accumulation] = None) -> List[WeightFault]:
    """The faults that show on this release and configuration, as probed (``through_outputs`` None: those that
    need the loss to be computed from another output tensor are included, to be confirmed at the first forward)."""
    return [fault for fault in FAULTS
            if fault.shows(deepspeed, stage, offload, precision, g, call, through_outputs, accelerate, world_size,
                           accumulation)]


class SeveralBackwards(str, Enum):
    """What ZeRO 1 and 2 make of a loop's several backward() calls before one step() with the config's G=1, by
    release (``probes/raw_loop_probe.py``, ``probes/raw_loop.json``: fp32 and bf16, K=4, one-hot weights)."""

    KEEPS_ALL = "keeps_all"  # every micro-batch applied (0.15.4 - 0.17.5 measured)
    FAILS = "fails"  # TypeError at the second backward(); on ZeRO-2, with the boundary set before the last backward(),
    # only that micro-batch applied, and a zero loss's closing backward() applies none (0.17.6 - 0.18.2 measured)
    REPLACES = "replaces"  # each backward() at a boundary replaces the gradients reduced before it (0.18.3 - 0.19.8)


def several_backwards(deepspeed: str) -> SeveralBackwards:
    """What ZeRO 1 and 2 of release ``deepspeed`` make of several backward() calls before one step()."""
    if parse_version(deepspeed) < parse_version("0.17.6"):
        return SeveralBackwards.KEEPS_ALL
    return SeveralBackwards.FAILS if parse_version(deepspeed) < parse_version("0.18.3") else SeveralBackwards.REPLACES


def probes() -> list:
    """The stored probe rows (``weight_probes.json``)."""
    with open(PROBES) as handle:
        return json.load(handle)
