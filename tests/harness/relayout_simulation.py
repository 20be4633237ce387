"""Brute-force simulation of a resume on another layout, micro-batch by micro-batch: accelerate's sharding of an
epoch's batches over the ranks (the last round padded from the start), the saved run up to its checkpoint, then
the Trainer's own resume arithmetic on the new layout (``skip_first_batches``) to the end; no closed form."""
from collections import Counter
from typing import Dict, Tuple


def positions(examples, world, batch, micro_batch):
    """The epoch's positions (< examples) that every rank's micro-batch ``micro_batch`` covers."""
    batches = -(-examples // batch)
    covered = []
    for rank in range(world):
        index = micro_batch * world + rank
        if index < batches:  # a padded round repeats batches from the start: not new positions
            covered.extend(range(index * batch, min((index + 1) * batch, examples)))
    return covered


def simulate(examples, saved, resumed, epochs, stood_epoch, stood_micro, global_step, planned) -> Tuple[Dict, Dict]:
    """(skipped, repeated) per 1-based epoch: the saved run ``(world, batch, G)`` trained up to micro-batch
    ``stood_micro`` of ``stood_epoch``; the resumed one starts where the Trainer's arithmetic puts it."""
    trained = {epoch: Counter() for epoch in range(epochs)}

    def per_rank(world, batch):
        return -(-(-(-examples // batch)) // world)

    for epoch in range(stood_epoch + 1):
        end = stood_micro if epoch == stood_epoch else per_rank(saved[0], saved[1])
        for micro in range(end):
            trained[epoch].update(positions(examples, saved[0], saved[1], micro))
    world, batch, gas = resumed
    n = per_rank(world, batch)
    per_epoch = -(-n // gas) if planned == "ceil" else max(n // gas, 1)
    first_epoch, skip = global_step // per_epoch, (global_step % per_epoch) * gas
    for epoch in range(first_epoch, epochs):
        for micro in range(skip if epoch == first_epoch else 0, n):
            trained[epoch].update(positions(examples, world, batch, micro))
    skipped, repeated = {}, {}
    for epoch, counts in trained.items():
        missing = examples - len(counts)
        twice = sum(c - 1 for c in counts.values())
        if missing:
            skipped[epoch + 1] = missing
        if twice:
            repeated[epoch + 1] = twice
    return skipped, repeated
