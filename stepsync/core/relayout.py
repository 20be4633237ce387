"""A resume on another layout (data-parallel ranks, per-device batch, G): where the Trainer lands in the data,
where the saved run really stood, and the samples it will skip or train twice. Pure arithmetic.

An epoch's samples come in one global order on every layout (the sampler does not depend on the ranks): its
k-th micro-batch on W ranks of batch b covers positions ``[k*W*b, (k+1)*W*b)`` of that order. The Trainer
places a resume with its own arithmetic on the new layout (``epochs = global_step // U'``, then
``(global_step % U') * G'`` micro-batches skipped, U' its updates per epoch there), which nothing corrects.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from . import rules
from .errors import StepSyncConfigError
from .versions import PlannedSteps


@dataclass(frozen=True)
class Layout:
    """How one run splits its data: data-parallel ranks, per-device batch, G, and the dataset's length.

    Attributes:
        world_size: data-parallel ranks (W).
        per_device_batch: samples per micro-batch on one rank (b).
        gradient_accumulation_steps: G.
        examples: samples in an epoch (the dataset's length, D).
        zero_stage: DeepSpeed's ZeRO stage, when known.
        drop_last: the dataloader drops an epoch's incomplete batch, and accelerate its incomplete last round of
            batches on several ranks (``dataloader_drop_last``): each epoch's tail past :attr:`epoch_end` is never
            trained on this layout.
    """

    world_size: int
    per_device_batch: int
    gradient_accumulation_steps: int
    examples: int
    zero_stage: Optional[int] = None
    drop_last: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "per_device_batch", "gradient_accumulation_steps", "examples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise StepSyncConfigError(f"{name} must be a positive integer, got {value!r}")

    @property
    def micro_batches_per_epoch(self) -> int:
        """A rank's micro-batches per epoch: the batches of the epoch, shared out, the last round padded (dropped
        with ``drop_last``, as is an incomplete batch)."""
        if self.drop_last:
            return self.examples // self.per_device_batch // self.world_size
        batches = -(-self.examples // self.per_device_batch)
        return -(-batches // self.world_size)

    @property
    def epoch_end(self) -> int:
        """The position of the epoch's order where this layout's epoch ends: the dataset's end, or its dropped
        tail's start."""
        return min(self.micro_batches_per_epoch * self.samples_per_micro_batch, self.examples)

    @property
    def samples_per_micro_batch(self) -> int:
        """Positions of the epoch's order that one micro-batch of every rank covers."""
        return self.world_size * self.per_device_batch

    @property
    def samples_per_update(self) -> int:
        return self.samples_per_micro_batch * self.gradient_accumulation_steps

    def describe(self) -> str:
        return (f"{self.world_size} rank(s) x batch {self.per_device_batch} x G={self.gradient_accumulation_steps} "
                f"({self.samples_per_update} samples per update)")


@dataclass
class ResumeShift:
    """What a resume on ``resumed`` does to the data, against where the run on ``saved`` stood.

    Attributes:
        global_step: the count the Trainer placed the resume from.
        stood: (0-based epoch, sample position) where the saved run's next micro-batch was.
        lands: (0-based epoch, sample position) where the Trainer resumes on the new layout.
        skipped, repeated: per 1-based epoch, samples never trained and trained twice.
        fixed_layouts: layouts on as many ranks that land exactly (each changes G or the batch); ``fixes`` says
            each as the change to make.
        read_from_files: how the saved layout was learnt where the checkpoint holds no stepsync record ("" where
            the record kept it).
        placement: how the framework places the resume, in words ("" for the Trainer's own placement at ``lands``);
            ``advice``: the fix where no other layout helps ("" for the Trainer's).
    """

    saved: Layout
    resumed: Layout
    global_step: int
    stood: Tuple[int, int]
    lands: Tuple[int, int]
    skipped: Dict[int, int] = field(default_factory=dict)
    repeated: Dict[int, int] = field(default_factory=dict)
    read_from_files: str = ""
    fixed_layouts: List[Layout] = field(default_factory=list)
    placement: str = ""
    advice: str = ""

    @property
    def exact(self) -> bool:
        return not self.skipped and not self.repeated

    @property
    def fixes(self) -> List[str]:
        """Each of ``fixed_layouts`` as the one setting it changes."""
        return [f"gradient_accumulation_steps={layout.gradient_accumulation_steps}"
                if layout.gradient_accumulation_steps != self.resumed.gradient_accumulation_steps
                else f"per_device_train_batch_size={layout.per_device_batch}" for layout in self.fixed_layouts]

    def message(self, with_fix: bool = True) -> str:
        """What the Trainer will do, and (``with_fix``) how to resume exactly."""
        if self.exact:
            return (f"the run resumes on another layout ({self.resumed.describe()}; saved on {self.saved.describe()}) "
                    "and lands exactly where it stood")
        what = []
        if self.skipped:
            what.append(f"skip {sum(self.skipped.values())} sample(s) ({_per_epoch(self.skipped)}) that are never "
                        "trained")
        if self.repeated:
            what.append(f"train {sum(self.repeated.values())} sample(s) twice ({_per_epoch(self.repeated)})")
        fix = ("; resume with " + ", or ".join(self.fixes)) if self.fixes else f"; {self.advice}" if self.advice else (
            f"; no layout on {self.resumed.world_size} rank(s) lands there (the Trainer places a resume by whole "
            "updates of the new layout): resume on the saved layout, or accept the shift")
        fix = fix if with_fix else ""
        source = f" ({self.read_from_files})" if self.read_from_files else ""
        placed = self.placement or (f"the Trainer places the resume at epoch {self.lands[0] + 1}, sample "
                                    f"{self.lands[1]} of its order")
        return (f"checkpoint saved on {self.saved.describe()}{source}, resumed on {self.resumed.describe()}: "
                f"{placed}, while the run stood at epoch {self.stood[0] + 1}, sample {self.stood[1]}; it will "
                f"{' and '.join(what)}{fix}")

    def to_dict(self) -> dict:
        return {"saved": asdict(self.saved), "resumed": asdict(self.resumed), "global_step": self.global_step,
                "stood": list(self.stood), "lands": list(self.lands),
                "skipped": {str(k): v for k, v in self.skipped.items()},
                "repeated": {str(k): v for k, v in self.repeated.items()}, "fixes": list(self.fixes),
                "read_from_files": self.read_from_files}


def _per_epoch(counts: Dict[int, int]) -> str:
    return ", ".join(f"{n} of epoch {epoch}" for epoch, n in sorted(counts.items()))


def landing(layout: Layout, global_step: int, planned: PlannedSteps) -> Tuple[int, int]:
    """(0-based epoch, slot) where the Trainer resumes on ``layout`` from ``global_step``: the slot of the epoch's
    padded order (past ``examples``, a slot holds a copy of an earlier sample; :func:`clamped` gives the position)."""
    n, g = layout.micro_batches_per_epoch, layout.gradient_accumulation_steps
    per_epoch = rules.planned_updates_per_epoch(planned.value, n, g)
    skip = (global_step % per_epoch) * g if per_epoch else 0
    return (global_step // per_epoch if per_epoch else 0), skip * layout.samples_per_micro_batch


def example_landing(layout: Layout, global_step: int) -> Tuple[int, int]:
    """(0-based epoch, slot) where transformers' run_*_no_trainer.py examples resume from ``step_N`` on ``layout``:
    ``N * G`` micro-batches of the new dataloader, whole epochs first (``skip_first_batches``), as if every update
    took G micro-batches (an epoch's short last window does not)."""
    return micro_batch_landing(layout, global_step * layout.gradient_accumulation_steps)


def micro_batch_landing(layout: Layout, micro_batches: int) -> Tuple[int, int]:
    """(0-based epoch, slot) after ``micro_batches`` of the new dataloader, whole epochs first: where accelerate's
    ``examples/by_feature/checkpointing.py`` resumes from ``step_N``, whose N counts micro-batches."""
    n = layout.micro_batches_per_epoch
    return micro_batches // n, (micro_batches % n) * layout.samples_per_micro_batch


def places_by_name(name: str, n: int, g: int) -> List[Tuple[str, Tuple[int, int]]]:
    """Where the examples' resume from a ``save_state`` folder called ``name`` lands, in (0-based epoch, micro-batches
    done in it) of ``n`` per epoch: ``epoch_E`` at the next epoch's start; ``step_N`` after N micro-batches
    (accelerate's examples/by_feature/checkpointing.py) or after N * G (transformers' run_*_no_trainer.py), whole
    epochs first."""
    kind, _, number = name.rpartition("_")
    if not number.isdigit() or n < 1:
        return []
    if kind == "epoch":
        return [("the examples' epoch_N arithmetic", (int(number) + 1, 0))]
    count = int(number)
    return [("accelerate's checkpointing.py arithmetic (N micro-batches)", (count // n, count % n)),
            ("transformers' run_*_no_trainer.py arithmetic (N * G micro-batches)", (count * g // n, count * g % n))]


def clamped(layout: Layout, where: Tuple[int, int]) -> Tuple[int, int]:
    """A (0-based epoch, slot) as a position of the epoch's order: the padding's slots all stand at its end."""
    return where[0], min(where[1], layout.examples)


def position(layout: Layout, epoch: int, micro_batches: int) -> Tuple[int, int]:
    """(0-based epoch, sample position) of a run on ``layout`` after ``micro_batches`` of ``epoch``; the end of an
    epoch is the start of the next."""
    at = micro_batches * layout.samples_per_micro_batch
    return (epoch + 1, 0) if at >= layout.epoch_end else (epoch, at)


def resume_shift(saved: Layout, resumed: Layout, global_step: int, stood: Tuple[int, int], planned: PlannedSteps,
                 epochs: Optional[int] = None, place: Optional[Callable[[Layout, int], Tuple[int, int]]] = None
                 ) -> ResumeShift:
    """The shift of a resume on ``resumed`` from a checkpoint at ``global_step`` saved while the run on ``saved``
    stood at ``stood`` (0-based epoch, sample position); ``epochs``: the run's epochs (what lies past them is never
    trained either way); ``place``: where the resuming code lands on a layout (default: the Trainer's
    :func:`landing` under ``planned``)."""
    place = place or (lambda layout, step: landing(layout, step, planned))
    slot = place(resumed, global_step)
    shift = ResumeShift(saved, resumed, global_step, stood, clamped(resumed, slot))
    shift.skipped, shift.repeated = _counts(saved, resumed, stood, slot, epochs)
    if not shift.exact:
        shift.fixed_layouts = _fixes(saved, resumed, global_step, stood, place, epochs)
    return shift


REPLAY_ADVICE = ("resume from a checkpoint saved at an epoch's end, on the number of ranks it was saved on, or give "
                 "Lightning a dataloader that keeps its place (one with state_dict and load_state_dict, such as "
                 "torchdata's StatefulDataLoader)")


def replayed_epoch_shift(saved: Layout, resumed: Layout, stood: Tuple[int, int], epoch: int, done: int,
                         batches_per_epoch: int, epochs: Optional[int] = None) -> ResumeShift:
    """A resume that restarts ``epoch`` (0-based) from the start of its order and runs only the batches its count
    says are left (``batches_per_epoch - done`` on each rank): Lightning's, with a dataloader that keeps no state.
    Every epoch's order is the same on any number of ranks (a distributed sampler shards one order), so what each
    side trained of an epoch is a prefix of it."""
    examples = saved.examples
    trained = min(examples, max(batches_per_epoch - done, 0) * resumed.samples_per_micro_batch)
    shift = ResumeShift(saved, resumed, 0, stood, (epoch, 0), placement=(
        f"Lightning restarts epoch {epoch + 1} from the start of its order and runs the {batches_per_epoch - done} "
        f"batch(es) a rank has left of {batches_per_epoch} (its dataloader keeps no place)"), advice=REPLAY_ADVICE)
    for x in range(min(stood[0], epoch), max(stood[0], epoch) + 1):
        if epochs is not None and x >= epochs:
            break
        before = examples if x < stood[0] else stood[1] if x == stood[0] else 0
        after = 0 if x < epoch else trained if x == epoch else examples
        if examples - max(before, after):
            shift.skipped[x + 1] = examples - max(before, after)
        if min(before, after):
            shift.repeated[x + 1] = min(before, after)
    return shift


def _counts(saved: Layout, resumed: Layout, stood: Tuple[int, int], slot: Tuple[int, int],
            epochs: Optional[int]) -> Tuple[Dict[int, int], Dict[int, int]]:
    """(skipped, repeated) per 1-based epoch of a resume on ``resumed`` that starts at ``slot``, where the run on
    ``saved`` stood at ``stood``, counted by sample over the part of each epoch both layouts train: a sample is
    skipped when neither run trains it, repeated when both do. Each layout's own padding (a few samples twice) and
    dropped tail (with ``drop_last``) are there with or without a resume, and not counted."""
    common = min(saved.epoch_end, resumed.epoch_end)
    skipped: Dict[int, int] = {}
    repeated: Dict[int, int] = {}
    for epoch in range(min(stood[0], slot[0]), max(stood[0], slot[0]) + 1):  # the others are trained whole once
        if epochs is not None and epoch >= epochs:
            break
        before = [(0, saved.epoch_end if epoch < stood[0] else stood[1] if epoch == stood[0] else 0)]
        after = _trained_after(resumed, 0 if epoch > slot[0] else slot[1] if epoch == slot[0] else None)
        either = _length(_intersection(_union(before + after), [(0, common)]))
        skipped[epoch + 1] = common - either
        repeated[epoch + 1] = _length(_intersection(before, after))
    return _within(skipped, epochs), _within(repeated, epochs)


def _trained_after(resumed: Layout, start: Optional[int]) -> List[Tuple[int, int]]:
    """The positions the resumed run trains in an epoch it starts at slot ``start`` (None: one it never reaches).
    On several ranks without ``drop_last`` accelerate completes the last round with the first samples of the order
    again: slot ``p`` holds sample ``p mod D``; one process is not sharded (its last batch is short)."""
    if start is None:
        return []
    examples, end = resumed.examples, resumed.epoch_end
    padded_to = resumed.micro_batches_per_epoch * resumed.samples_per_micro_batch
    trained = [(min(start, end), end)]
    if padded_to > examples and resumed.world_size > 1:
        trained += _cyclic(max(start, examples), padded_to, examples)
    return trained


def _within(counts: Dict[int, int], epochs: Optional[int]) -> Dict[int, int]:
    """The epochs of ``counts`` with something in them, up to the run's last."""
    return {epoch: n for epoch, n in counts.items() if n and (epochs is None or epoch <= epochs)}


def _cyclic(low: int, high: int, examples: int) -> List[Tuple[int, int]]:
    """The positions slots ``[low, high)`` hold, slot ``p`` holding sample ``p mod examples``."""
    if high - low >= examples:
        return [(0, examples)]
    low, high = low % examples, low % examples + high - low
    return [(low, min(high, examples))] + ([(0, high - examples)] if high > examples else [])


def _union(intervals: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    merged: List[Tuple[int, int]] = []
    for low, high in sorted(i for i in intervals if i[1] > i[0]):
        if merged and low <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return merged


def _intersection(first: List[Tuple[int, int]], second: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    return [(max(a, c), min(b, d)) for a, b in first for c, d in second if min(b, d) > max(a, c)]


def _length(intervals: List[Tuple[int, int]]) -> int:
    return sum(high - low for low, high in _union(intervals))


def _fixes(saved: Layout, resumed: Layout, global_step: int, stood: Tuple[int, int],
           place: Callable[[Layout, int], Tuple[int, int]], epochs: Optional[int]) -> List[Layout]:
    """The layouts on ``resumed``'s ranks, G or the batch changed, that keep the global batch and land exactly where
    the run stood."""
    found: List[Layout] = []
    w, b, g, keep = resumed.world_size, resumed.per_device_batch, resumed.gradient_accumulation_steps, \
        saved.samples_per_update
    for batch, gas in ((b, keep // (w * b)), (keep // (w * g), g)):
        if batch < 1 or gas < 1 or w * batch * gas != keep:
            continue
        fixed = Layout(w, batch, gas, saved.examples, resumed.zero_stage, resumed.drop_last)
        if fixed not in found and _counts(saved, fixed, stood, place(fixed, global_step), epochs) == ({}, {}):
            found.append(fixed)
    return found
