"""DeepSpeed's output hooks (0.18.3-0.19.5) divide the gradient once more at each tensor of the model's output that
the loss is computed from. Real accelerate loops and the real Trainer on the installed DeepSpeed, a linear model
with one weight per sample returning the loss with its logits (as every transformers model does) or the loss alone,
plain SGD at lr 1: each sample's share of the update is read from the parameters and held against the same loop
without DeepSpeed, the truth. stepsync must name the fault where the shares are wrong (and only there), stop at the
first forward under raise, and under sync make the shares equal to the run without DeepSpeed."""
from importlib.metadata import version

import pytest

from harness.runs import forget_deepspeed
from harness.stack import needs_stack
from stepsync.tools.tiny_run import cpu_distributed_env

pytestmark = [needs_stack, pytest.mark.integration]

G, SAMPLES, SCALE = 2, 4, 1e-3


def model(outputs):
    import torch

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(SAMPLES))

        def forward(self, x, labels=None):
            logits = self.w * x
            loss = SCALE * logits.sum()
            return {"loss": loss, "logits": logits} if outputs == "loss+logits" else {"loss": loss}

    return Linear()


def shares(module):
    """Each sample's share of the updates, G times: 1 each where every micro-batch weighs 1/G."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([module.w]):
        return [round(-float(v) / SCALE * G, 4) for v in module.w.detach()]


def fault_shows(call):
    from stepsync.core.weights import weight_faults

    return bool(weight_faults(version("deepspeed"), 0, False, "fp32", G, call, through_outputs=True))


def loop(outputs, policy, deepspeed=True):
    """One epoch of SAMPLES one-hot micro-batches through an accelerate loop: (shares, watch report, error, engine
    updates)."""
    cpu_distributed_env()
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import stepsync

    forget_deepspeed()  # a DeepSpeed loop leaves it switched on: the next loop would be DeepSpeed's again
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": G,
              "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True}
    plugin = DeepSpeedPlugin(hf_ds_config=config) if deepspeed else None
    accelerator = Accelerator(gradient_accumulation_steps=G, deepspeed_plugin=plugin)
    net = model(outputs)
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    data = torch.utils.data.DataLoader(torch.eye(SAMPLES), batch_size=1)
    net, optimizer, data = accelerator.prepare(net, optimizer, data)
    watch = stepsync.watch(accelerator, policy, dataloader=data, num_epochs=1, console=False) if policy else None
    error = None
    try:
        for x in data:
            with accelerator.accumulate(net):
                accelerator.backward(net(x[0])["loss"])
                optimizer.step(), optimizer.zero_grad()
    except Exception as exc:  # asserted on
        error = exc
    finally:
        if watch is not None:
            watch.close()
    module = accelerator.unwrap_model(net)
    engine = accelerator.deepspeed_engine_wrapped.engine if deepspeed else None
    return shares(module), (watch.report if watch else None), error, (engine.global_steps if engine else None)


def test_the_truth_without_deepspeed():
    assert loop("loss+logits", None, deepspeed=False)[0] == [1.0] * SAMPLES


@pytest.mark.parametrize("policy", ["warn", "sync", "raise"])
def test_an_accelerate_loop_with_logits(policy):
    truth = loop("loss+logits", None, deepspeed=False)[0]
    unwatched = loop("loss+logits", None)[0]
    got, report, error, updates = loop("loss+logits", policy)
    if not fault_shows("engine"):  # this release divides once: nothing to say, nothing stopped
        assert unwatched == truth and got == truth and report.weight_faults == [] and error is None
        return
    assert unwatched == [1 / G] * SAMPLES  # the fault, seen by the recorder without stepsync
    assert len(report.weight_faults) == 1 and "once more for each tensor of the model's output" in \
        report.weight_faults[0]
    if policy == "warn":
        assert error is None and got == unwatched and report.weight_faults[0] in report.notes
    elif policy == "sync":
        assert error is None and got == truth  # the extra division undone: equal to the run without DeepSpeed
        assert any("policy 'sync' multiplies the gradient" in note for note in report.notes)
    else:
        assert "stops at the first forward" in str(error) and updates == 0 and got == [0.0] * SAMPLES


def test_an_accelerate_loop_with_the_loss_alone_is_not_warned():
    got, report, error, _ = loop("loss", "sync")
    assert error is None and got == [1.0] * SAMPLES and report.weight_faults == []


def trainer_run(tmp_path, outputs, policy, deepspeed=True):
    """One epoch of the real Trainer: (shares, stepsync's report or None, the error that ended it or None)."""
    cpu_distributed_env()
    import torch
    from transformers import Trainer, TrainingArguments

    from stepsync import StepSyncCallback

    forget_deepspeed()

    class OneHot(torch.utils.data.Dataset):
        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return {"x": torch.eye(SAMPLES)[i]}

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True,
              # Under DeepSpeed the Trainer builds its own optimizer: the config's, plain SGD at a constant lr 1.
              "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1.0, "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto"}}}
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=G,
                             num_train_epochs=1, max_grad_norm=0.0, learning_rate=1.0, warmup_steps=0,
                             report_to=[], save_strategy="no", use_cpu=True,
                             deepspeed=config if deepspeed else None, remove_unused_columns=False, disable_tqdm=True)
    callback = StepSyncCallback(policy=policy) if policy else None
    net = model(outputs)
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trainer = Trainer(model=net, args=args, train_dataset=OneHot(), callbacks=[callback] if callback else [],
                      optimizers=(None, None) if deepspeed else (optimizer, constant))
    error = None
    try:
        trainer.train()
    except Exception as exc:  # asserted on
        error = exc
    module = getattr(trainer.model_wrapped, "module", trainer.model) if deepspeed else trainer.model
    return shares(module), (callback.report if callback else None), error


@pytest.mark.parametrize("outputs", ["loss", "loss+logits"])
@pytest.mark.parametrize("policy", ["warn", "sync", "raise"])
def test_the_trainer(tmp_path, outputs, policy):
    """The Trainer passes scale_wrt_gas=False: from 0.18.4 its output hooks divide nothing, so nothing is said;
    0.18.3 divides its loss again (and again at the logits): named before the first micro-batch, or at the first
    forward, repaired under sync."""
    from stepsync.core.weights import weight_faults

    faults = weight_faults(version("deepspeed"), 0, False, "fp32", G, "trainer", outputs == "loss+logits")
    if not faults and policy != "warn":
        return  # nothing to say: one policy shows it
    truth = trainer_run(tmp_path / "plain", outputs, None, deepspeed=False)[0]
    assert truth == [1.0] * SAMPLES
    got, report, error = trainer_run(tmp_path / "ds", outputs, policy)
    if not faults:
        assert got == truth and report.weight_faults == [] and error is None
        return
    unwatched = trainer_run(tmp_path / "unwatched", outputs, None)[0]
    assert unwatched == [round(1 / G ** len(faults), 4)] * SAMPLES  # 1/G once more for each fault
    # raise stops at the first one it meets (a fault of the call at the start, before the output is seen)
    assert len(report.weight_faults) == (1 if policy == "raise" else len(faults))
    if policy == "warn":
        assert error is None and got == unwatched
    elif policy == "sync":
        assert error is None and got == truth  # each extra division undone: the run without DeepSpeed's update
    else:
        assert "policy 'raise' stops" in str(error) and got == [0.0] * SAMPLES


@pytest.mark.parametrize("framework", ["accelerate", "trainer"])
def test_stepsync_verify_calls_backward_as_the_real_framework_does(tmp_path, framework):
    """What `stepsync verify --framework X` measures equals what the real framework's run trained on this stack."""
    import json
    import subprocess
    import sys

    if framework == "accelerate":
        real = loop("loss+logits", None)[0]
    else:
        real = trainer_run(tmp_path / "ds", "loss+logits", None)[0]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    done = subprocess.run([sys.executable, "-m", "stepsync", "verify", "--deepspeed", str(path), "--gas", str(G),
                           "--framework", framework, "--json"], capture_output=True, text=True, timeout=300)
    measured = json.loads(done.stdout)["weights_with_logits"]
    assert [round(w * G, 4) for w in measured] == real[:G]
