"""What each trained token weighs in an update: how a window's loss is normalised across micro-batches that hold
different numbers of trained tokens, named from the weights measured at the logits (:mod:`stepsync.engine.tokens`).

A token's weight is what its loss is multiplied by in the gradient the window's update applies: ``1 / N`` for
each of the window's ``N`` trained tokens under a token mean. A loop that averages each micro-batch's own tokens
gives a token of a short micro-batch more (``1 / (G * n_i)``); a per-sequence loss gives each sequence's tokens
``1 / n_s``. Which rule a window follows is known only where its micro-batches' token counts differ, so a window
is named only then (:func:`tells_apart`). Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Dict, List, Optional, Sequence, Tuple, Union

from .choices import unsupported
from .errors import StepSyncConfigError
from .versions import parse_version

# Two weights are the same within this share: bf16 gradients carry about 0.4% per element.
SAME_WEIGHT = 0.05
# A window tells the rules apart where its micro-batches' token counts differ by this factor or more: the rules
# then differ by the same factor, well beyond SAME_WEIGHT.
TELLS_APART = 1.25
# A window's tokens weighing this much in all where a mean weighs 1, or its inverse or less, make an update that is
# not the one the learning rate assumes (summed rather than averaged, or divided once more).
OFF_SCALE = 1.5
# A total within this share of G or 1/G is named as such.
NEAR = 0.1


class Normalisation(str, Enum):
    """How a window's loss weighs its trained tokens."""

    TOKEN_MEAN = "token_mean"  # every trained token of the window weighs the same: 1 / N
    MICRO_BATCH_MEAN = "micro_batch_mean"  # each micro-batch's tokens weigh 1 / (G * its own count)
    SEQUENCE_MEAN = "sequence_mean"  # each sequence's tokens weigh in inverse proportion to its own count
    UNRECOGNISED = "unrecognised"  # none of the above: the weights measured, no rule named

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Union[str, Normalisation]) -> Normalisation:
        """The rule a user declares: ``"token_mean"`` (the default), ``"micro_batch_mean"``, ``"sequence_mean"``."""
        if isinstance(value, cls) and value is not cls.UNRECOGNISED:
            return value
        choices = [member.value for member in cls if member is not cls.UNRECOGNISED]
        if isinstance(value, str) and value.strip().lower().replace("-", "_") in choices:
            return cls(value.strip().lower().replace("-", "_"))
        raise StepSyncConfigError(unsupported("loss_normalisation", value, choices))

    @property
    def words(self) -> str:
        return _WORDS[self]


_WORDS = {
    Normalisation.TOKEN_MEAN: "a mean over the window's trained tokens",
    Normalisation.MICRO_BATCH_MEAN: "a mean per micro-batch (a token of a short micro-batch weighs more)",
    Normalisation.SEQUENCE_MEAN: "a mean per sequence (a token of a short sequence weighs more)",
    Normalisation.UNRECOGNISED: "no rule stepsync knows",
}


@dataclass(frozen=True)
class SequenceWeights:
    """The trained tokens of one sequence of one micro-batch, as measured at the logits' gradient.

    Attributes:
        micro_batch: 0-based in its window.
        tokens: trained tokens (positions whose logits received a gradient).
        lightest, heaviest: the smallest and largest token weight.
        total: the sum of its tokens' weights.
        cross_entropy: every token's gradient had a cross-entropy's shape (a probability less one at its label, a
            probability elsewhere, times one weight); False for another loss, whose weights are not named.
    """

    micro_batch: int
    tokens: int
    lightest: float
    heaviest: float
    total: float
    cross_entropy: bool = True


def tells_apart(window: Sequence[SequenceWeights]) -> bool:
    """Whether ``window`` tells the rules apart: two micro-batches or more whose trained-token counts differ by
    :data:`TELLS_APART` or more."""
    counts = list(micro_batch_tokens(window).values())
    return len(counts) >= 2 and min(counts) > 0 and max(counts) >= TELLS_APART * min(counts)


def micro_batch_tokens(window: Sequence[SequenceWeights]) -> Dict[int, int]:
    """Trained tokens per micro-batch of ``window``, in order."""
    counts: Dict[int, int] = {}
    for seq in window:
        counts[seq.micro_batch] = counts.get(seq.micro_batch, 0) + seq.tokens
    return dict(sorted(counts.items()))


def _same(values: Sequence[float]) -> bool:
    return min(values) > 0 and max(values) <= (1 + SAME_WEIGHT) * min(values)


def rules_that_fit(window: Sequence[SequenceWeights]) -> List[Normalisation]:
    """Every rule ``window``'s measured weights follow, token mean first (empty when none does)."""
    if not window or not all(seq.cross_entropy and seq.lightest > 0 for seq in window):
        return []
    fits = []
    if _same([seq.lightest for seq in window] + [seq.heaviest for seq in window]):
        fits.append(Normalisation.TOKEN_MEAN)
    by_micro_batch: Dict[int, List[SequenceWeights]] = {}
    for seq in window:
        by_micro_batch.setdefault(seq.micro_batch, []).append(seq)
    tokens = micro_batch_tokens(window)
    if all(_same([s.lightest for s in group] + [s.heaviest for s in group]) for group in by_micro_batch.values()) \
            and _same([group[0].heaviest * tokens[i] for i, group in by_micro_batch.items()]):
        fits.append(Normalisation.MICRO_BATCH_MEAN)
    if all(_same([seq.lightest, seq.heaviest]) for seq in window) and _same([seq.heaviest * seq.tokens
                                                                             for seq in window]):
        fits.append(Normalisation.SEQUENCE_MEAN)
    return fits


@dataclass(frozen=True)
class TokenWeighting:
    """How one window weighed its trained tokens, and what that means for the run.

    Attributes:
        found: the rule its weights follow (:attr:`Normalisation.UNRECOGNISED` where none does).
        expected: the rule the user declared (the token mean unless told otherwise).
        epoch, update: where the window was (1-based epoch; the engine's update it closed, 1-based).
        tokens: trained tokens per micro-batch of the window.
        ratio: the heaviest token's weight over the lightest's.
        total: the sum of every token's weight, where a mean over the window weighs 1 (None where it is not read:
            several ranks, fp16's loss scale).
        cross_entropy: False where the loss is not a cross-entropy over the logits (a policy-gradient loss): then
            nothing is named.
        fix: what to change, for the framework that computed the loss.
        g: the window's micro-batches per update, as the engine accumulates them.
    """

    found: Normalisation
    expected: Normalisation
    epoch: int
    update: int
    tokens: Tuple[int, ...]
    ratio: float
    total: Optional[float]
    cross_entropy: bool = True
    fix: str = ""
    g: int = 1

    @property
    def off_scale(self) -> bool:
        """The window's tokens weigh :data:`OFF_SCALE` times a mean's or more in all, or that much less."""
        return self.total is not None and not 1 / OFF_SCALE < self.total < OFF_SCALE

    @property
    def as_expected(self) -> bool:
        """Whether the run trains as the user means: the declared rule, at a mean's scale (or a loss stepsync does
        not name)."""
        return not self.cross_entropy or (self.found is self.expected and not self.off_scale)

    def _scale(self) -> str:
        said = f"; the update is {self.total:.3g}x what the learning rate assumes"
        if self.g > 1 and abs(self.total / self.g - 1) <= NEAR:  # type: ignore[operator]  # off_scale: a total
            return f"{said} (G = {self.g}: the window is summed, not averaged)"
        if self.g > 1 and abs(self.total * self.g - 1) <= NEAR:  # type: ignore[operator]
            return f"{said} (1/G: the loss is divided by G once more than a mean needs)"
        return said

    def message(self) -> str:
        where = f"epoch {self.epoch}, update {self.update}: micro-batches of {_counts(self.tokens)} trained tokens"
        if not self.cross_entropy:
            return (f"{where}; the loss is not a cross-entropy over the logits (some token's gradient has another "
                    "shape, as a policy-gradient loss's has): how it weighs tokens is not named")
        words = self.found.words
        if self.found is Normalisation.TOKEN_MEAN and self.total is not None and self.total >= OFF_SCALE:
            words = "a sum over the window's trained tokens (each weighs the same)"
        said = f"{where}; the loss weighs them as {words}; the heaviest token weighs {self.ratio:.3g}x the lightest"
        if self.total is not None:
            said += f"; the window's tokens weigh {self.total:.3g} in all, where a mean weighs 1"
        if self.as_expected:
            return said
        if self.found is not self.expected:
            return f"{said}; expected {self.expected.words}{self._scale() if self.off_scale else ''}; {self.fix}"
        return (f"{said}{self._scale()}; find what divides the loss (or sums it) once more or less than a mean needs: "
                "stepsync verify measures each micro-batch's weight on your stack")

    def to_dict(self) -> dict:
        return {"found": self.found.value, "expected": self.expected.value, "epoch": self.epoch,
                "update": self.update, "tokens": list(self.tokens), "ratio": self.ratio, "total": self.total,
                "cross_entropy": self.cross_entropy, "g": self.g, "as_expected": self.as_expected,
                "message": self.message()}


def _counts(tokens: Sequence[int]) -> str:
    return ", ".join(str(count) for count in tokens)


def weigh_window(window: Sequence[SequenceWeights], expected: Normalisation, epoch: int, update: int, fix: str,
                 reads_total: bool = True, g: int = 1) -> TokenWeighting:
    """Name the rule ``window``'s weights follow (the declared one where it fits among others)."""
    cross_entropy = all(seq.cross_entropy for seq in window) and all(seq.lightest > 0 for seq in window)
    fits = rules_that_fit(window)
    found = expected if expected in fits else (fits[0] if fits else Normalisation.UNRECOGNISED)
    lightest = min(seq.lightest for seq in window)
    heaviest = max(seq.heaviest for seq in window)
    ratio = heaviest / lightest if lightest > 0 else float("inf")
    total = sum(seq.total for seq in window) if reads_total else None
    return TokenWeighting(found, expected, epoch, update, tuple(micro_batch_tokens(window).values()), ratio, total,
                          cross_entropy, fix, g)


# TRL's GRPO losses that divide by the tokens of ``num_items_in_batch``, which spans the generation batch.
TRL_TOKEN_LOSSES = ("dapo", "cispo", "vespo")
# The first TRL release measured to rescale them to one accumulation window (probes/trl_grpo.json: 1.9.0 scales each
# update by G / steps_per_generation, 1.9.1 and 1.14.2 do not).
TRL_RESCALES_TO_THE_WINDOW = "1.9.1"


def trl_generation_scale(trl: Optional[str], loss_type: object, steps_per_generation: object, g: int) -> str:
    """What TRL's GRPO does to each update where its generation batch is not one window, as probed; "" where
    nothing (another loss, one window per generation, or a release that rescales)."""
    if trl is None or loss_type not in TRL_TOKEN_LOSSES or not isinstance(steps_per_generation, int) \
            or steps_per_generation in (g, 0) or parse_version(trl) >= parse_version(TRL_RESCALES_TO_THE_WINDOW):
        return ""
    return (f"TRL {trl}'s GRPO divides each '{loss_type}' loss by the completion tokens of its whole generation batch "
            f"(steps_per_generation={steps_per_generation} micro-batches) while an update holds "
            f"gradient_accumulation_steps={g}: every update is {g / steps_per_generation:.3g}x the token mean over its "
            f"window (measured on TRL 1.9.0; {TRL_RESCALES_TO_THE_WINDOW} rescales it): upgrade TRL to "
            f"{TRL_RESCALES_TO_THE_WINDOW} or later, or set steps_per_generation={g}")
