"""What a resumed run really trained, from the samples every rank recorded (tests/entry/relayout_runs.py's
recording Trainer), never from stepsync."""


def skipped_and_repeated(saved, resumed, checkpoint_step, samples, epochs, alongside=None):
    """(skipped, repeated) per 1-based epoch, from the samples every rank trained: the saved run up to its
    checkpoint, then the resumed run. A sample is skipped when neither trains it in an epoch, repeated when both do
    (a sampler that pads an epoch trains a few samples twice on its own, with or without a resume: not a repeat).
    With ``dataloader_drop_last`` each layout leaves its own tail of every epoch: ``alongside``, an uninterrupted run
    on the resumed layout, says with the whole saved run which samples both layouts train, the ones counted."""
    before = {epoch: set() for epoch in range(epochs)}
    after = {epoch: set() for epoch in range(epochs)}
    for rank in saved:
        for epoch, step_before, indices in rank["trained"]:
            if step_before < checkpoint_step:
                before[epoch].update(indices)
    for rank in resumed:
        for epoch, _, indices in rank["trained"]:
            after[epoch].update(indices)
    both_train = {epoch: set(range(samples)) for epoch in range(epochs)}
    if alongside is not None:
        both_train = {epoch: trained_in(saved, epoch) & trained_in(alongside, epoch) for epoch in range(epochs)}
    skipped = {e + 1: len(both_train[e] - before[e] - after[e]) for e in range(epochs)
               if both_train[e] - before[e] - after[e]}
    repeated = {e + 1: len(before[e] & after[e]) for e in range(epochs) if before[e] & after[e]}
    return skipped, repeated


def trained_in(ranks, epoch):
    """Every sample a whole run trained in (0-based) ``epoch``."""
    return {index for rank in ranks for e, _, indices in rank["trained"] if e == epoch for index in indices}


def said(rank):
    """(skipped, repeated) as stepsync's report on ``rank`` says them ({} and {} where it says no shift)."""
    shift = rank["report"]["resume_shift"] if rank.get("report") else None
    if shift is None:
        return {}, {}
    return ({int(k): v for k, v in shift["skipped"].items()}, {int(k): v for k, v in shift["repeated"].items()})
