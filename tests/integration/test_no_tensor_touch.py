"""stepsync's hooks read integer counters only: no tensor op, no .item(), no .cpu(), nothing that waits for a
device. Every torch call made during real runs is seen through a TorchFunctionMode; a call whose nearest
non-torch caller is stepsync's own code fails the test, outside the bounded readers of harness/touches.py: where the
engine itself does not check its gradients, the sums that tell whether the weights are still finite (FiniteWeights),
at most once per update or epoch end, never per micro-batch; on several ranks, the weights' fingerprint at train
begin, epoch ends and checkpoints (WeightFingerprint, tests/multiprocess/test_ranks_apart.py); and each token's
weight at the logits' gradient (engine/tokens.py), inside the backward of at most WINDOWS_READ windows'
micro-batches, then never again."""
import os

import pytest

from harness.stack import needs_stack
from harness.runs import run
from harness.touches import PACKAGE, reader_of, touching_mode

pytestmark = [needs_stack, pytest.mark.integration]


@pytest.mark.parametrize("policy", ["warn", "raise", "sync", "realign", "drop_last"])
def test_hooks_touch_no_tensor(tmp_path, policy, monkeypatch):
    from stepsync.engine import tokens

    reads = []
    read = tokens.sequence_weights
    monkeypatch.setattr(tokens, "sequence_weights", lambda *args: reads.append(args[2]) or read(*args))
    watch = touching_mode()
    samples = 4 if policy == "raise" else 3
    with watch:
        result = run(tmp_path, samples, 2, 2, policy=policy, save_strategy="steps", save_steps=2)
    assert result.error is None
    assert result.callback.report.active and result.callback.report.finished
    assert [where for name, path, where in watch.touches if reader_of(path, name) is None] == []
    # The tiny run's micro-batches hold 8 trained tokens each: no window tells the rules apart, and the reading stops
    # after WINDOWS_READ windows of G=2 (or at the run's end: drop_last trains 2 windows).
    trained = result.callback.report.micro_batches
    assert trained and len(reads) == min(tokens.WINDOWS_READ * 2, trained - trained % 2)
    # fp32 ZeRO-0: the engine checks no gradient and keeps no flat buffer, so the weights are summed at both epoch
    # ends and at the end (a detach, a sum and a float per parameter each time), never in between.
    reads = [where for name, path, where in watch.touches if name == "FiniteWeights.finite"]
    parameters = len(list(result.engine.module.parameters()))
    assert len(reads) == 3 * 3 * parameters


def test_an_engine_that_checks_its_gradients_gets_no_tensor_read(tmp_path, monkeypatch):
    from harness.nonfinite import bf16_config, deepspeed_skips

    if not deepspeed_skips(2):
        pytest.skip("this DeepSpeed does not check bf16 gradients on ZeRO-2")
    bf16_config(monkeypatch)
    watch = touching_mode()
    with watch:
        result = run(tmp_path, 3, 2, 2, stage=2, policy="warn", bf16=True)
    assert result.error is None and result.callback.report.finished
    assert [touch for touch in watch.touches if touch[1] != os.path.join(PACKAGE, "engine", "tokens.py")] == []
