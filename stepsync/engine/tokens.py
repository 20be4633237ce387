"""Each trained token's weight in an update, read at the logits' gradient, until one window names the rule.

A cross-entropy's gradient at a token's logits is ``w * (softmax(z) - onehot(label))``: ``w`` is the weight the
whole chain (the loss's normalisation, the framework's and the engine's divisions) gives that token. A hook on the
output embeddings' output (a transformers model's ``get_output_embeddings()``, found in the engine's module, whatever
the framework around it) reads ``w`` for every trained token: the label is the entry of largest magnitude, ``w`` its
gradient over ``p - 1``, and a second entry checks the shape. No labels, no extra forward or backward: one
log-sum-exp over the trained positions' logits per micro-batch, paid only until a window whose micro-batches hold
different numbers of trained tokens is named; then every hook is removed. torch is imported only inside the hooks.
"""
from __future__ import annotations

from typing import Any, List, Optional

from ..core.errors import LossNormalisationError
from ..core.frameworks import EngineBoundary
from ..core.tokens import Normalisation, SequenceWeights, TokenWeighting, micro_batch_tokens, tells_apart, weigh_window
from .deepspeed import spread_across_ranks
from .outputs import loss_and_others

# Windows read at most: a run whose first windows all hold near-equal token counts is one where the rule makes
# little difference, and the reading stops paying its cost there.
WINDOWS_READ = 4
# Training forwards without the output embeddings' logits after which nothing is read (a fused or chunked loss).
UNSEEN_FORWARDS = 4
# Positions whose log-sum-exp is taken at once: bounds the float copy of the logits to ROWS_AT_ONCE * vocabulary.
ROWS_AT_ONCE = 256


def output_embeddings(module: Any) -> Any:
    """The module that makes the logits: the first ``get_output_embeddings()`` in ``module`` (a transformers
    model, inside a Lightning module or not); None where there is none."""
    for inner in getattr(module, "modules", lambda: ())():
        found = getattr(inner, "get_output_embeddings", None)
        if not callable(found):
            continue
        try:
            head = found()
        except Exception:  # a model without a head raises NotImplementedError in some releases
            continue
        if hasattr(head, "register_forward_hook"):
            return head
    return None


def sequence_weights(logits: Any, grad: Any, micro_batch: int) -> List[SequenceWeights]:
    """The trained tokens of each sequence of ``logits`` ([sequences, positions, vocabulary], or [positions,
    vocabulary] for one) and their weights, from the gradient that reached them: a few reductions over the
    gradient, one log-sum-exp over the trained positions' logits, and one copy to the host."""
    import torch

    vocabulary = logits.shape[-1]
    z = logits.reshape(-1, logits.shape[-2] if logits.dim() > 1 else 1, vocabulary)
    g = grad.reshape(z.shape)
    low, high = torch.aminmax(g, dim=-1)
    trained = high > low  # an untrained position's gradient is all zero
    rows, g_rows = z[trained], g[trained]
    positive = (low.abs() >= high)[trained]  # the label's entry is p - 1 < 0 times a positive weight
    lowest, highest = g_rows.argmin(-1), g_rows.argmax(-1)
    label, other = torch.where(positive, lowest, highest), torch.where(positive, highest, lowest)
    lse = _log_sum_exp(rows)
    p_label = (rows.gather(-1, label[:, None])[:, 0].float() - lse).exp()
    p_other = (rows.gather(-1, other[:, None])[:, 0].float() - lse).exp()
    weight = g_rows.gather(-1, label[:, None])[:, 0].float() / (p_label - 1)
    expected = weight * p_other
    shaped = ((g_rows.gather(-1, other[:, None])[:, 0].float() - expected).abs() <= 0.05 * expected.abs() + 1e-30)
    sequence = trained.nonzero()[:, 0]
    count = z.shape[0]

    def per_sequence(values: Any, how: str) -> Any:
        return weight.new_zeros(count).scatter_reduce(0, sequence, values.float(), how, include_self=False)

    table = torch.stack([per_sequence(torch.ones_like(weight), "sum"), per_sequence(weight, "amin"),
                         per_sequence(weight, "amax"), per_sequence(weight, "sum"),
                         per_sequence(shaped.float(), "amin")]).t().tolist()
    return [SequenceWeights(micro_batch, int(tokens), lightest, heaviest, total, bool(ok))
            for tokens, lightest, heaviest, total, ok in table if tokens]


def _log_sum_exp(rows: Any) -> Any:
    """Each row's log-sum-exp in float32, ROWS_AT_ONCE rows at a time."""
    import torch

    return torch.cat([rows[start:start + ROWS_AT_ONCE].float().logsumexp(-1)
                      for start in range(0, rows.shape[0], ROWS_AT_ONCE)] or [rows.new_zeros(0).float()])


class TokenWeights:
    """Reads each micro-batch's token weights at the logits until a window tells the rules apart, then names the
    rule (a note where it is the one expected; a warning, or under ``raise`` a stop before that window's update,
    where not). On several ranks every rank reads until every rank has named its window, and one all-reduce per
    window lets ``raise`` stop them together."""

    def __init__(self, run: Any, head: Any, expected: Normalisation, fix: str) -> None:
        self.run = run
        self.expected = expected
        self.fix = fix
        facts = run.facts
        self.ranks = facts.data_parallel_size
        self.reads_total = self.ranks == 1 and facts.precision != "fp16"
        self.window: List[SequenceWeights] = []
        self.micro_batch = -1
        self.named: Optional[TokenWeighting] = None
        self.windows = 0
        self.widest = 0  # the most micro-batches a window read held
        self.unseen = 0  # training forwards in a row whose logits the output embeddings did not make
        self.logits: List[Any] = []  # made by the head, not yet hooked
        self.handle: Any = head.register_forward_hook(self._after_head)
        engine = run.engine
        self.engine_handle: Any = engine.register_forward_hook(self._after_engine) \
            if hasattr(engine, "register_forward_hook") else None

    def remove(self) -> None:
        for handle in (self.handle, self.engine_handle):
            if handle is not None:
                handle.remove()
        self.handle = self.engine_handle = None
        self.logits = []

    def _after_head(self, module: Any, inputs: Any, output: Any) -> None:
        if self.handle is None or not getattr(output, "requires_grad", False):
            return  # evaluation, or done
        if self.logits:  # the engine's forward did not return since: hook what waits now
            self._hook_logits()
        self.logits.append(output)

    def forward_returned(self, output: Any) -> None:
        """The framework's training forward returned ``output``, where no forward hook of the engine can say so
        (Lightning without DeepSpeed calls its module's training_step itself)."""
        self._after_engine(None, (), output)

    @property
    def reading(self) -> bool:
        """Whether it still reads (it stops once a window names the rule, or it cannot)."""
        return self.handle is not None

    def _after_engine(self, module: Any, inputs: Any, output: Any) -> None:
        if self.logits:
            self.unseen = 0
            self._hook_logits()
        elif self.handle is not None and self.micro_batch < 0 and self.windows == 0 and \
                loss_and_others(output)[0] is not None:
            self.unseen += 1  # a training forward whose logits the output embeddings did not make
            if self.unseen >= UNSEEN_FORWARDS:
                self.remove()
                self.run.voice.not_checked(
                    f"loss normalisation: not read: the model's output embeddings made no logits in {UNSEEN_FORWARDS} "
                    "training forwards (its loss computes them itself, as TRL's chunked cross-entropy and fused "
                    "kernels do)")

    def _hook_logits(self) -> None:
        """Hook the logits once the engine's forward has returned: DeepSpeed's own hooks on its output (0.18.3 on)
        are then registered before this one, which reads the gradient as they leave it."""
        for logits in self.logits:
            values = logits.detach()
            logits.register_hook(lambda grad, values=values: self._read(values, grad))
        self.logits = []

    def _read(self, logits: Any, grad: Any) -> None:
        if self.handle is None:
            return
        try:
            self._take(logits, grad)
        except LossNormalisationError:
            raise
        except Exception as exc:  # a fault here ends this check only; the run's other checks go on
            self.remove()
            self.run.voice.error(f"stopped reading each token's weight (the rest of the run is watched): internal "
                                 f"error {exc!r}")
            if self.run.policy.stops:
                raise

    def _take(self, logits: Any, grad: Any) -> None:
        self.micro_batch += 1  # one forward, one micro-batch
        if self.named is None:
            self.window.extend(sequence_weights(logits, grad, self.micro_batch))
        if not self._window_ends():
            return
        window, self.window, self.micro_batch = self.window, [], -1
        self.windows += 1
        wrong = False
        if self.named is None and tells_apart(window):
            self.named = self._name(window)
            wrong = not self.named.as_expected
        pending, wrong = self._agree(self.named is None and self.windows < WINDOWS_READ, wrong)
        self.widest = max(self.widest, len(micro_batch_tokens(window)))
        if not pending and self.named is None:
            held = "windows held one micro-batch each" if self.widest < 2 else \
                "windows' micro-batches held numbers of trained tokens too close to tell the rules apart (within 25%)"
            self.run.voice.not_checked(f"loss normalisation: not named: the first {self.windows} {held}")
        if not pending:
            self.remove()
        if wrong and self.run.policy.stops:
            named = self.named if self.named is not None and not self.named.as_expected else None
            if named is not None:
                self.run.voice.alert("loss normalisation", f"loss normalisation: {named.message()}")
            self.remove()
            self.run.stopped = True
            raise LossNormalisationError(named)

    def _window_ends(self) -> bool:
        """Whether this backward's micro-batch closes the window the next update applies: the engine's boundary, or
        the loop's own word where the loop steps the optimizer without the engine (Fabric)."""
        run = self.run
        if run.behaviour.engine_boundary is EngineBoundary.NEVER_STEPPED:
            return bool(run.loop_window_ends)
        return bool(run.engine.is_gradient_accumulation_boundary())

    def _name(self, window: List[SequenceWeights]) -> TokenWeighting:
        run = self.run
        named = weigh_window(window, self.expected, max(run.epoch, 0) + 1, run.engine.global_steps + 1, self.fix,
                             self.reads_total, len(micro_batch_tokens(window)))
        run.report.token_weighting = named
        if not named.as_expected and not run.policy.stops:  # as expected, it is in the report alone
            repair = (f"; policy '{run.policy.value}' cannot repair it from outside (a window's token count is "
                      "known only at its last micro-batch)") if run.policy.interferes else ""
            run.voice.finding("loss normalisation", f"loss normalisation: {named.message()}{repair}")
        return named

    def _agree(self, pending: bool, wrong: bool) -> tuple:
        """(whether any rank still reads, whether any rank's window is wrong): one all-reduce on several ranks."""
        if self.ranks < 2:
            return pending, wrong
        (_, any_pending), (_, any_wrong) = spread_across_ranks([pending, wrong], getattr(self.run.engine, "device",
                                                                                         "cpu"))
        return bool(any_pending), bool(any_wrong)


def watch_tokens(run: Any, expected: Normalisation, fix: str) -> Optional[TokenWeights]:
    """Read each token's weight in ``run`` where its engine's module has output embeddings; None where it has
    none (the report's ``token_weighting`` stays None) or where neither DeepSpeed nor the framework says where a
    window ends (a run without DeepSpeed whose adapter gives no word on it)."""
    if not (run.facts.deepspeed or getattr(run.engine, "tells_its_windows", False)):
        run.voice.not_checked("loss normalisation: not read: without DeepSpeed this framework does not say where "
                              "its windows end")
        return None
    head = output_embeddings(getattr(run.engine, "module", None))
    if head is None:
        return None
    return TokenWeights(run, head, expected, fix)
