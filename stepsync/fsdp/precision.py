"""FSDP2's mixed precision, in words: what the start of an FSDP2 loop's watch says, and what the installed torch
gets wrong in it (``stepsync.core.fsdp_releases``)."""
from __future__ import annotations

from typing import Any, Optional

from ..core.fsdp_releases import probed_range, shows

# what keeps a micro-batch's small gradient in a window's sum (probes/fsdp_precision.json: float32 sums keep it)
KEEPS_IT = "float32 weights with MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) keep it"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def precision_in_force(model: Any, torch: Optional[str] = None) -> Optional[str]:
    """FSDP2's mixed precision as each sharded module's ``MixedPrecisionPolicy`` sets it, in words, or what
    low-precision weights without one do (``torch``: the installed release); None where every dtype is float32."""
    kept = next((p.dtype for p in model.parameters()), None)
    found = []
    for module in model.modules():
        policy = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_mp_policy", None)
        compute = getattr(policy, "param_dtype", None)
        reduce = getattr(policy, "reduce_dtype", None) or compute
        if (compute, reduce) != (None, None) and (compute, reduce) not in found:
            found.append((compute, reduce))
    if not found:
        return _low_precision_weights(kept, torch)
    words = []
    for compute, reduce in found:
        text = (f"forward and backward in {_dtype_name(compute or kept)}, gradients reduced (and accumulated over "
                f"the micro-batches whose sync is off) in {_dtype_name(reduce or kept)}")
        if reduce is not None and kept is not None and reduce.itemsize < kept.itemsize:
            text += (f" (sums in {_dtype_name(reduce)} round away a micro-batch's gradient much smaller than the "
                     "window's; MixedPrecisionPolicy(reduce_dtype=torch.float32) keeps it)")
        words.append(text)
    return (f"FSDP2 mixed precision in force: {'; '.join(words)}; the sharded weights and the optimizer in "
            f"{_dtype_name(kept)}")


def _low_precision_weights(kept: Any, torch: Optional[str]) -> Optional[str]:
    """Weights FSDP2 keeps in a low precision without a policy: their gradients are summed in it, in words (a
    ``grad_dtype`` set before ``fully_shard`` is gone after it, so it is said where probed, not read)."""
    if kept is None or kept.itemsize >= 4 or not kept.is_floating_point:
        return None
    dropped = None if torch is None else shows("grad_dtype_dropped", torch)
    grad_dtype = "" if dropped is False else (
        f"; a float32 grad_dtype set on them before fully_shard does not change that ({probed_range()}, as probed"
        + ("" if dropped else f"; torch {torch} was not probed") + ")")
    return (f"FSDP2 weights in {_dtype_name(kept)} without a MixedPrecisionPolicy: gradients accumulated over the "
            f"micro-batches whose sync is off in {_dtype_name(kept)} (sums in it round away a micro-batch's gradient "
            f"much smaller than the window's{grad_dtype}); {KEEPS_IT}")
