"""What FSDP2 (``fully_shard``) does with a window's gradients in low precision, by torch release, as probed.

``probes/fsdp_precision_probe.py`` ran torch 2.11.0, 2.12.0, 2.13.0 and 2.14.1 on a CPU (``probes/fsdp_precision.json``;
``tests/unit/test_fsdp_releases.py`` fails when these rows and that data disagree): every probed release does the
same. Pure Python: never imports torch.
"""
from __future__ import annotations

from typing import Optional

from .versions import ReleaseRow, parse_version

PROBED_TORCH = ("2.11.0", "2.12.0", "2.13.0", "2.14.1")

FSDP_PRECISION_ROWS = (
    ReleaseRow("torch", "2.11.0", None, "grad_dtype_dropped",
               "bfloat16 weights whose grad_dtype is float32 have their gradients summed in bfloat16 over the "
               "micro-batches whose sync is off: a micro-batch's gradient 2**-10 of the window's is rounded away "
               "(PyTorch PR 194434, open)"),
    ReleaseRow("torch", "2.11.0", None, "late_parameter_fails",
               "under MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), a parameter "
               "that only a window's last (synced) micro-batch uses fails the backward with 'FSDP reduce-scatter "
               "expects uniform gradient dtype' (PyTorch issue 196996)"),
)


def shows(fact: str, torch: str) -> Optional[bool]:
    """Whether torch release ``torch`` shows ``fact`` (a row's behaviour): None where it was not probed and lies
    outside the probed releases' range."""
    row = next(row for row in FSDP_PRECISION_ROWS if row.behaviour == fact)
    release = torch.split("+")[0]  # a build's local label (+cpu, +cu130) is the same release
    if not parse_version(PROBED_TORCH[0]) <= parse_version(release) <= parse_version(PROBED_TORCH[-1]):
        return None
    return row.covers(release)


def probed_range() -> str:
    return f"torch {PROBED_TORCH[0]} - {PROBED_TORCH[-1]}"
