"""``stepsync verify --framework fsdp``: what the installed torch's FSDP2 does with a window's gradients in the
precision asked, measured, not looked up.

One window of G micro-batches through a linear model ``fully_shard`` shards (one rank, gloo, on a CPU), plain SGD at
lr 1, the sync off for the window's first G - 1 micro-batches and on for its last, as a loop writes it: micro-batch
k puts 1 on its own weight (its share of the update: 1, whole) and, for k >= 1, a gradient 2**-10 of micro-batch 0's
on a weight they share, smaller than a bfloat16 can add to 1. What the update kept of each small gradient says
where the window's gradients were summed: float32 keeps each, bfloat16 none (``probes/fsdp_precision.json``).
Needs torch only.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from ..core.errors import ConfigInputError
from ..core.frameworks import Framework
from ..core.versions import installed_version
from ..fsdp.precision import KEEPS_IT
from .tiny_run import cpu_distributed_env
from .verify_ranks import as_a_process_of_its_own

SMALL = 2.0 ** -10
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class FsdpVerdict:
    """One measured window: each micro-batch's share of its own weight's update, what the update kept of each later
    micro-batch's small gradient (1 kept, 0 rounded away), and the error FSDP2 raised, if any."""

    torch: str
    g: int
    weights_dtype: str = "float32"
    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None
    grad_dtype: Optional[str] = None
    shares: List[float] = field(default_factory=list)
    small_kept: List[float] = field(default_factory=list)
    error: str = ""

    @property
    def right(self) -> bool:
        return not self.error and all(abs(share - 1) < 1e-3 for share in self.shares) and \
            all(abs(kept - 1) < 0.1 for kept in self.small_kept)

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "right": self.right}


def measure_fsdp_window(g: int, weights_dtype: str = "float32", param_dtype: Optional[str] = None,
                        reduce_dtype: Optional[str] = None, grad_dtype: Optional[str] = None,
                        late_parameter: bool = False) -> FsdpVerdict:
    """The window above on this process's group (one of its own is started where there is none); ``grad_dtype``:
    set on each parameter before ``fully_shard`` (autograd's ``grad_dtype``); ``late_parameter``: a second parameter
    that only the window's last micro-batch uses."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        cpu_distributed_env()
        dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)), world_size=1)
    verdict = FsdpVerdict(torch.__version__.split("+")[0], g, weights_dtype, param_dtype, reduce_dtype, grad_dtype)
    size = 2 * g - 1

    class Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(size))
            self.v = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x: Any, last: bool) -> Any:
            out = (x.to(self.w.dtype) * self.w).sum()
            return out + self.v.sum() if last else out

    torch.manual_seed(0)
    model = Linear().to(getattr(torch, weights_dtype))
    if grad_dtype is not None:
        for parameter in model.parameters():
            parameter.grad_dtype = getattr(torch, grad_dtype)
    policy = {} if param_dtype is None and reduce_dtype is None else {"mp_policy": MixedPrecisionPolicy(
        param_dtype=getattr(torch, param_dtype) if param_dtype else None,
        reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype else None)}
    fully_shard(model, **policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.w.full_tensor().detach().float().clone()
    try:
        for k in range(g):
            x = torch.zeros(size)
            x[k] = 1.0
            if k == 0:
                x[g:] = 1.0
            else:
                x[g + k - 1] = SMALL
            model.set_requires_gradient_sync(k == g - 1)
            model(x, late_parameter and k == g - 1).backward()
        optimizer.step()
    except Exception as exc:  # FSDP2's own refusal: the verdict says it
        verdict.error = f"{type(exc).__name__}: {exc}"[:300]
        return verdict
    moved = (before - model.w.full_tensor().detach().float()).tolist()
    verdict.shares = [round(value, 6) for value in moved[:g]]
    verdict.small_kept = [round((moved[g + k - 1] - moved[0]) / SMALL, 4) for k in range(1, g)]
    return verdict


def explain_fsdp(verdict: FsdpVerdict) -> List[str]:
    """The verdict in lines, for the console."""
    policy = ("no MixedPrecisionPolicy" if verdict.param_dtype is None and verdict.reduce_dtype is None else
              f"MixedPrecisionPolicy(param_dtype={verdict.param_dtype}, reduce_dtype={verdict.reduce_dtype})")
    asked = f" (grad_dtype {verdict.grad_dtype} set before fully_shard)" if verdict.grad_dtype else ""
    lines = [f"FSDP2 on torch {verdict.torch}, {verdict.weights_dtype} weights{asked}, {policy}, G={verdict.g}: one "
             "window measured (the sync off but for its last micro-batch)"]
    if verdict.error:
        return [*lines, f"FSDP2 failed the window: {verdict.error}"]
    for i, share in enumerate(verdict.shares):
        mark = "" if abs(share - 1) < 1e-3 else "   <- not whole"
        lines.append(f"  micro-batch {i + 1}: {share:.4g} of its own gradient in the update{mark}")
    lost = [i + 2 for i, kept in enumerate(verdict.small_kept) if abs(kept - 1) >= 0.1]
    if lost:
        lines.append(f"a gradient 2**-10 of the window's, from micro-batch(es) {lost}: rounded away (the window's "
                     f"gradients are summed in a 16-bit float; {KEEPS_IT})")
    else:
        lines.append("a gradient 2**-10 of the window's, from each later micro-batch: kept")
    if verdict.right:
        lines.append("every micro-batch's gradient reaches the update whole: the window's sum is right")
    return lines


def add_dtype_flags(verify: Any) -> None:
    """``verify``'s flags for an FSDP2 model's precision."""
    for flag, what in (("--weights-dtype", "the dtype your model's weights are kept in (default float32)"),
                       ("--param-dtype", "MixedPrecisionPolicy's param_dtype (default: none set)"),
                       ("--reduce-dtype", "MixedPrecisionPolicy's reduce_dtype (default: none set)"),
                       ("--grad-dtype", "the grad_dtype set on each parameter before fully_shard (default: none)")):
        verify.add_argument(flag, choices=DTYPES, default=None, help=f"with --framework fsdp: {what}")


def refuse_dtype_flags(args: Any) -> None:
    """The dtype flags given for a DeepSpeed run (whose precision is its config's): refused, with the fix."""
    if any((args.weights_dtype, args.param_dtype, args.reduce_dtype, args.grad_dtype)):
        raise ConfigInputError("--weights-dtype, --param-dtype, --reduce-dtype and --grad-dtype describe an FSDP2 "
                               "model: use them with --framework fsdp (a DeepSpeed run's precision is its config's)")


def verify_sharded_command(framework: Framework, args: Any) -> int:
    """``stepsync verify --framework fsdp`` with the command line's ``args``: what it cannot measure is refused
    before anything runs; the verdict printed: 0 when every micro-batch's gradient reaches the update whole, 1 when
    one does not, 2 when FSDP2 fails the window (with its words, never a traceback)."""
    if not framework.backward_call.fully_sharded:
        raise ConfigInputError(f"stepsync verify measures a DeepSpeed engine or FSDP2's fully_shard; "
                               f"{framework.name} sums a window's gradients in its weights' dtype, which "
                               "--framework fsdp with --weights-dtype measures")
    given = [flag for flag, value in (("--deepspeed-config", args.deepspeed), ("--training-args", args.training_args),
                                      ("--world-size", args.world_size != 1)) if value]
    if given:
        raise ConfigInputError(f"{', '.join(given)}: --framework {framework.key} measures FSDP2's window on one rank, "
                               "with no DeepSpeed or Trainer file; leave it out")
    if args.gas is None:
        raise ConfigInputError(f"--framework {framework.key} needs --gas G: the micro-batches per optimizer.step() "
                               "your loop means")
    if installed_version("torch") is None:
        print(f"stepsync: error: stepsync verify --framework {framework.key} runs FSDP2: it needs torch",
              file=sys.stderr)
        return 2
    as_a_process_of_its_own()
    verdict = measure_fsdp_window(args.gas, args.weights_dtype or "float32", args.param_dtype, args.reduce_dtype,
                                  args.grad_dtype)
    print(json.dumps(verdict.to_dict()) if args.json else "\n".join(explain_fsdp(verdict)))
    if verdict.error:
        print(f"stepsync: error: FSDP2 on torch {verdict.torch} fails this window: {verdict.error}", file=sys.stderr)
        return 2
    return 0 if verdict.right else 1
