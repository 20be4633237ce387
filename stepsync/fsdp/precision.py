"""FSDP2's mixed precision, in words: what the start of an FSDP2 loop's watch says."""
from __future__ import annotations

from typing import Any, Optional


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def precision_in_force(model: Any) -> Optional[str]:
    """FSDP2's mixed precision as each sharded module's ``MixedPrecisionPolicy`` sets it, in words; None where none
    is set (every dtype the weights' own)."""
    kept = next((p.dtype for p in model.parameters()), None)
    found = []
    for module in model.modules():
        policy = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_mp_policy", None)
        compute = getattr(policy, "param_dtype", None)
        reduce = getattr(policy, "reduce_dtype", None) or compute
        if (compute, reduce) != (None, None) and (compute, reduce) not in found:
            found.append((compute, reduce))
    if not found:
        return None
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
