"""stepsync.engine.outputs on plain torch modules: which output tensors the loss is computed from, what the first
forward says under each policy, and the repair: the gradient at each extra-divided tensor multiplied by G, as a
hook dividing it by G (DeepSpeed's, 0.18.3-0.19.5) would need."""
import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch", reason="autograd hooks need torch: the training stack's test run has it")

from stepsync.core.choices import Policy
from stepsync.core.errors import StepSyncConfigError
from stepsync.core.report import SyncReport
from stepsync.core.weights import weight_faults
from stepsync.engine.outputs import computed_from, loss_and_others, watch_outputs

G = 2


class Linear(torch.nn.Module):
    def __init__(self, outputs="loss+logits"):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.outputs = outputs

    def forward(self, x):
        logits = self.w * x
        if self.outputs == "tuple":
            return logits.sum(), logits
        if self.outputs == "unrelated":
            return {"loss": (self.w ** 2).sum(), "logits": (self.w * x).detach() * self.w}
        return {"loss": logits.sum(), "logits": logits} if self.outputs == "loss+logits" else logits.sum()


class Engine:
    """What the hooks read of a DeepSpeed engine: its module, and DeepSpeed's extra division on every output."""

    def __init__(self, module, divides=True):
        self.module = module
        self.divides = divides

    def __call__(self, x):
        output = self.module(x)
        if self.divides:  # as DeepSpeed 0.18.3-0.19.5 does, after the module's forward hooks
            loss, others = loss_and_others(output)
            for tensor in [loss] + others:
                tensor.register_hook(lambda grad: grad / G)
        return output


class FakeRun:
    def __init__(self, engine, policy):
        self.engine = engine
        self.report = SyncReport(policy)
        self.policy = policy
        self.said = []
        self.voice = self

    def note(self, text):
        self.said.append(("note", text))

    def warn(self, text):
        self.said.append(("warn", text))


def test_the_loss_and_the_tensors_it_is_computed_from():
    x = torch.ones(3)
    loss, others = loss_and_others(Linear()(x))
    assert len(others) == 1 and computed_from(loss, others) == others
    loss, others = loss_and_others(Linear("tuple")(x))
    assert len(others) == 1 and computed_from(loss, others) == others
    loss, others = loss_and_others(Linear("unrelated")(x))
    assert len(others) == 1 and computed_from(loss, others) == []
    loss, others = loss_and_others(Linear("loss")(x))
    assert others == [] and loss is not None
    with torch.no_grad():
        assert loss_and_others(Linear()(x)) == (None, [])  # evaluation: no graph, nothing to read


def grad_after_one_backward(policy, outputs="loss+logits"):
    module = Linear(outputs)
    engine = Engine(module)
    run = FakeRun(engine, policy)
    faults = weight_faults("0.18.4", 0, False, "fp32", G, "engine", None)
    hooks = watch_outputs(run, faults, "0.18.4", G)
    output = engine(torch.ones(3))
    loss = output["loss"] if isinstance(output, dict) else output
    loss.backward()
    return module.w.grad.tolist(), run, hooks


def test_warn_names_the_fault_at_the_first_forward_and_leaves_the_gradient():
    grad, run, hooks = grad_after_one_backward(Policy.WARN)
    assert grad == [0.25] * 3  # 1/G^2: the loss's hook and the logits' hook
    assert run.report.weight_faults and run.said == [("warn", run.report.weight_faults[0])]
    assert hooks.handle is None  # the forward hook is gone after the first forward


def test_sync_undoes_the_extra_division_at_every_forward():
    module = Linear()
    engine = Engine(module)
    run = FakeRun(engine, Policy.SYNC)
    watch_outputs(run, weight_faults("0.18.4", 0, False, "fp32", G, "engine", None), "0.18.4", G)
    for _ in range(3):
        engine(torch.ones(3))["loss"].backward()
    assert module.w.grad.tolist() == [1.5] * 3  # 3 micro-batches at 1/G each
    assert run.said[0][0] == "note" and "multiplies the gradient at those tensors by 2" in run.said[0][1]


def test_raise_stops_at_the_first_forward():
    with pytest.raises(StepSyncConfigError, match="stops at the first forward"):
        grad_after_one_backward(Policy.RAISE)


def test_a_loss_alone_is_not_named():
    grad, run, _ = grad_after_one_backward(Policy.RAISE, "loss")
    assert grad == [0.5] * 3 and run.report.weight_faults == [] and run.said == []


def test_nothing_is_hooked_where_no_fault_needs_the_output():
    run = FakeRun(Engine(Linear()), Policy.SYNC)
    assert watch_outputs(run, weight_faults("0.19.8", 0, False, "fp32", G, "engine", None), "0.19.8", G) is None


def test_a_stop_under_raise_leaves_no_hook_behind():
    """Training the same model again after the stop (a notebook) divides as DeepSpeed does, nothing more."""
    module = Linear()
    engine = Engine(module)
    run = FakeRun(engine, Policy.RAISE)
    hooks = watch_outputs(run, weight_faults("0.18.4", 0, False, "fp32", G, "engine", None), "0.18.4", G)
    with pytest.raises(StepSyncConfigError):
        engine(torch.ones(3))
    assert hooks.handle is None
    engine(torch.ones(3))["loss"].backward()
    assert module.w.grad.tolist() == [0.25] * 3
