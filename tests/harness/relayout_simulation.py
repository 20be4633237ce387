"""Brute-force simulation of a resume on another layout, micro-batch by micro-batch: accelerate's sharding of an
epoch's batches over the ranks (``BatchSamplerShard``: the last round completed with the first samples of the order
again), the saved run up to its checkpoint, then the Trainer's own resume arithmetic on the new layout
(``skip_first_batches``) to the end; no closed form. A sample is skipped when neither run trains it in an epoch, and
repeated when both do, over the part of the epoch both layouts train (each layout's own padding, a few samples
twice, and its dropped tail with ``drop_last``, are there with or without a resume)."""
from typing import Dict, Tuple


def per_rank(examples, world, batch, drop_last=False):
    """A rank's micro-batches per epoch: accelerate deals the batches round-robin, completing the last round from the
    start of the order, or dropping an incomplete batch and round with ``drop_last``."""
    if drop_last:
        return examples // batch // world
    return -(-(-(-examples // batch)) // world)


def positions(examples, world, batch, micro_batch, drop_last=False):
    """The samples every rank's micro-batch ``micro_batch`` trains: its batch of the epoch's order, or, in the last
    round, the order's first samples again (accelerate's ``initial_data``)."""
    if world == 1 or drop_last:  # one process is not sharded (its last batch is short); drop_last never pads
        return list(range(micro_batch * world * batch, min((micro_batch + 1) * world * batch, examples)))
    covered = []
    for rank in range(world):
        index = micro_batch * world + rank
        covered.extend(slot % examples for slot in range(index * batch, (index + 1) * batch))
    return covered


def simulate(examples, saved, resumed, epochs, stood_epoch, stood_micro, global_step, planned,
             drop_last=False) -> Tuple[Dict, Dict]:
    """(skipped, repeated) per 1-based epoch: the saved run ``(world, batch, G)`` trained up to micro-batch
    ``stood_micro`` of ``stood_epoch``; the resumed one starts where the Trainer's arithmetic puts it."""
    before = {epoch: set() for epoch in range(epochs)}
    after = {epoch: set() for epoch in range(epochs)}
    for epoch in range(stood_epoch + 1):
        end = stood_micro if epoch == stood_epoch else per_rank(examples, saved[0], saved[1], drop_last)
        for micro in range(end):
            before[epoch].update(positions(examples, saved[0], saved[1], micro, drop_last))
    world, batch, gas = resumed
    n = per_rank(examples, world, batch, drop_last)
    per_epoch = -(-n // gas) if planned == "ceil" else max(n // gas, 1)
    first_epoch, skip = global_step // per_epoch, (global_step % per_epoch) * gas
    for epoch in range(first_epoch, epochs):
        for micro in range(skip if epoch == first_epoch else 0, n):
            after[epoch].update(positions(examples, world, batch, micro, drop_last))
    # The part of an epoch both layouts train: with drop_last, up to the shorter one's tail.
    both_train = set(range(min(examples, *(per_rank(examples, w, b, drop_last) * w * b for w, b, _ in (saved, resumed)))))
    skipped, repeated = {}, {}
    for epoch in range(epochs):
        missing = len(both_train - before[epoch] - after[epoch])
        twice = len(before[epoch] & after[epoch])
        if missing:
            skipped[epoch + 1] = missing
        if twice:
            repeated[epoch + 1] = twice
    return skipped, repeated
