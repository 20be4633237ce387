"""stepsync/core/fsdp_releases.py equals what the probes measured (probes/fsdp_precision.json: torch 2.11.0, 2.12.0,
2.13.0 and 2.14.1 on a CPU), and so do the words stepsync/fsdp/precision.py builds on them: which precisions keep
a micro-batch's small gradient in a window's sum and which round it away."""
import json
import os

import pytest

from harness.paths import REPO
from stepsync.core.fsdp_releases import FSDP_PRECISION_ROWS, PROBED_TORCH, probed_range, shows

with open(os.path.join(REPO, "probes", "fsdp_precision.json")) as handle:
    PROBED = json.load(handle)["releases"]
CASES = [(release, row) for release, rows in PROBED.items() for row in rows]


def test_the_probed_releases_are_the_data_s():
    assert PROBED_TORCH == tuple(PROBED) and probed_range() == "torch 2.11.0 - 2.14.1"
    assert {row.behaviour for row in FSDP_PRECISION_ROWS} == {"grad_dtype_dropped", "late_parameter_fails"}


@pytest.mark.parametrize("release, row", CASES, ids=[
    f"{release}-{row['policy']}-G{row['g']}{'-late' if row['late_parameter'] else ''}" for release, row in CASES])
def test_each_probed_case_is_what_the_rows_and_the_words_say(release, row):
    if row["late_parameter"]:  # only bf16 compute with fp32 reduce is probed so
        assert row["policy"] == "bf16_reduce_fp32"
        assert shows("late_parameter_fails", release) is True
        assert row["cannot_run"].startswith("AssertionError: FSDP reduce-scatter expects uniform gradient dtype")
        return
    assert row["shares"] == [1.0] * row["g"]  # each micro-batch whole on its own entry, in every precision
    # float32 sums keep the small gradient; a bfloat16 sum rounds it away, a float32 grad_dtype or not
    kept = row["policy"] in ("none", "bf16_reduce_fp32")
    assert row["small_kept"] == [1.0 if kept else 0.0] * (row["g"] - 1)
    if row["policy"] == "bf16_weights_grad_dtype_fp32":
        assert shows("grad_dtype_dropped", release) is True


def test_a_release_outside_the_probed_ones_is_not_said_to_show_anything():
    assert shows("grad_dtype_dropped", "2.10.0") is None and shows("grad_dtype_dropped", "2.15.0") is None
    # a build's local label is the same release: the CPU and CUDA builds of the newest probed one
    assert shows("grad_dtype_dropped", "2.14.1+cpu") is shows("grad_dtype_dropped", "2.14.1+cu130") is True
