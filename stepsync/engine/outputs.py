"""DeepSpeed's output hooks (0.18.3 on): what they do to a model whose loss is computed from another tensor of its
output, seen at the first forward, said before the first backward, and undone under ``sync``.

From 0.18.3 the engine divides by G in a hook on every tensor of the model's output that has a gradient. The loss's
hook is the division meant; a hook on a tensor the loss is computed from (a transformers model's logits) divides
the same gradient once more (0.18.3-0.19.5), and 0.18.3 divides the Trainer's loss even where the Trainer asks it
not to (``scale_wrt_gas=False``). Which of those a run meets is known only once the model has returned: a forward
hook on the engine's module reads the first output. Duck-typed: no torch import.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Set, Tuple

from ..core.choices import FaultAnswer
from ..core.errors import StepSyncConfigError
from ..core.weights import WeightFault

# The loss's graph is searched this far for the other output tensors: a model's logits sit a few nodes from it.
GRAPH_NODES_SEARCHED = 100_000


def loss_and_others(output: Any) -> Tuple[Any, List[Any]]:
    """(the loss, the other tensors with a gradient) of a model's output, as the Trainer and Lightning read it: the
    ``"loss"`` entry of a mapping, the first item of a tuple or list, or the tensor itself."""
    tensors: List[Any] = []
    _collect(output, tensors)
    if isinstance(output, dict):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)):
        loss = output[0] if output else None
    else:
        loss = output
    if not _has_graph(loss):
        return None, tensors
    return loss, [tensor for tensor in tensors if tensor is not loss]


def _has_graph(value: Any) -> bool:
    return getattr(value, "grad_fn", None) is not None and hasattr(value, "register_hook")


def _collect(output: Any, tensors: List[Any]) -> None:
    """Every tensor with a gradient that DeepSpeed's hooks reach: nested tuples, lists and mappings."""
    if _has_graph(output):
        tensors.append(output)
    elif isinstance(output, (tuple, list)):
        for item in output:
            _collect(item, tensors)
    elif isinstance(output, dict):
        for item in output.values():
            _collect(item, tensors)


def computed_from(loss: Any, others: Sequence[Any]) -> List[Any]:
    """The tensors of ``others`` the loss is computed from: their nodes, found in the loss's autograd graph."""
    wanted = {id(tensor.grad_fn): tensor for tensor in others}
    found: List[Any] = []
    seen: Set[int] = set()
    frontier = [loss.grad_fn]
    while frontier and wanted and len(seen) < GRAPH_NODES_SEARCHED:
        node = frontier.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in wanted:
            found.append(wanted.pop(id(node)))
        frontier.extend(parent for parent, _ in getattr(node, "next_functions", ()))
    return found


class OutputHooks:
    """Reads the model's first output for the faults that need it, and, under ``sync``, multiplies by G the gradient
    at each tensor whose division is extra (every forward), so that each micro-batch weighs 1/G again.

    ``faults``: the faults of this release and configuration, those that need the output included. ``repair_loss``:
    the loss's own division is extra too (the Trainer on 0.18.3).
    """

    def __init__(self, run: Any, faults: Sequence[WeightFault], deepspeed: str, g: int) -> None:
        self.run = run
        self.faults = list(faults)
        self.deepspeed = deepspeed
        self.g = g
        self.repairs = run.policy.steers_the_boundary
        self.repair_loss = any(not fault.through_outputs for fault in self.faults)
        self.repair_others = False
        self.first = True
        self.handle = run.engine.module.register_forward_hook(self._after_forward)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _after_forward(self, module: Any, inputs: Any, output: Any) -> None:
        loss, others = loss_and_others(output)
        if loss is None:
            return  # evaluation (no graph), or an output without a loss: nothing is divided here
        if self.first:
            self.first = False
            try:
                self._say(computed_from(loss, others))
            finally:  # a stop under raise leaves no hook behind (a notebook may train the model again)
                if not (self.repairs and (self.repair_loss or self.repair_others)):
                    self.remove()
            if self.handle is None:
                return
        g = self.g
        for tensor in ([loss] if self.repair_loss else []) + (others if self.repair_others else []):
            tensor.register_hook(lambda grad: grad * g)

    def _say(self, sources: List[Any]) -> None:
        """Name the faults this output meets: a warning, a stop under raise, the repair under sync."""
        for fault in self.faults:
            if not fault.through_outputs or not sources:
                continue  # said at the start, or not met: the loss is not computed from another output tensor
            self.repair_others = True
            text = fault.message(self.deepspeed, self.g)
            self.run.report.weight_faults.append(text)
            answer = self.run.policy.answer_to_weight_fault(repairable=True)
            if answer is FaultAnswer.REFUSE:
                raise StepSyncConfigError(f"{text}; policy '{self.run.policy.value}' stops at the first forward, "
                                          "before any gradient is made")
            if answer is FaultAnswer.REPAIR:
                self.run.voice.note(f"{text}; policy '{self.run.policy.value}' multiplies the gradient at those "
                                    f"tensors by {self.g}, so that each micro-batch weighs 1/G")
            else:
                self.run.voice.warn(text)


def watch_outputs(run: Any, faults: Sequence[WeightFault], deepspeed: Optional[str], g: int) -> Optional[OutputHooks]:
    """Hooks on the engine's module where a fault is to be read from the output or undone; None where none is."""
    wanted = [fault for fault in faults if fault.through_outputs
              or run.policy.answer_to_weight_fault(fault.repairable) is FaultAnswer.REPAIR]
    module = getattr(run.engine, "module", None)
    if not wanted or deepspeed is None or not hasattr(module, "register_forward_hook"):
        return None
    return OutputHooks(run, wanted, deepspeed, g)
