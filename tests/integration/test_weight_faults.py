"""A release that drops micro-batches from an update is named before the first micro-batch: the real Trainer on
the installed DeepSpeed with ZeRO-2 and its optimizer offloaded to the CPU, G=3. Which micro-batches it drops is
what `stepsync verify` measures on this stack (tests/integration/test_verify.py); here, that the run says it
first, and that raise and sync stop before any micro-batch."""
from importlib.metadata import version

import pytest

from harness.runs import run
from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]


def offloaded():
    from stepsync.tools.tiny_run import deepspeed_config

    config = deepspeed_config(2)
    config["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW, offloaded
    return config


@pytest.mark.parametrize("policy", ["warn", "raise", "sync"])
def test_the_dropped_micro_batches_are_named_before_the_first(tmp_path, policy):
    from stepsync.core.weights import weight_faults

    faults = weight_faults(version("deepspeed"), 2, True, "fp32", 3)
    result = run(tmp_path, 6, 3, 1, policy=policy, deepspeed=offloaded())
    report = result.callback.report
    if not faults:  # this release keeps every micro-batch: nothing to say, nothing stopped
        assert result.error is None and report.weight_faults == []
        return
    said = faults[0].message(version("deepspeed"), 3)
    assert "micro-batch(es) [2] of every window of 3" in said
    if policy == "warn":
        assert result.error is None and said in report.weight_faults and said in report.notes
        assert f"updates: {said}" in str(report)
        return
    assert f"policy '{policy}' stops before the first micro-batch" in str(result.error)
    assert result.recording.engine_steps == []  # not one micro-batch ran


def test_g_of_two_keeps_both(tmp_path):
    result = run(tmp_path, 4, 2, 1, policy="warn", deepspeed=offloaded())
    assert result.error is None and not any("offloaded" in fault for fault in result.callback.report.weight_faults)
