"""Naming a window's rule from its tokens' weights (stepsync/core/tokens.py), against a brute-force simulation: every
token of a window weighed by each rule, one weight per token, grouped into what the logits' hook reports."""
import pytest
from hypothesis import assume, given, settings, strategies as st

from stepsync.core.errors import StepSyncConfigError
from stepsync.core.tokens import (OFF_SCALE, TELLS_APART, Normalisation, SequenceWeights, micro_batch_tokens,
                                  rules_that_fit, tells_apart, weigh_window)

windows = st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=3), min_size=1, max_size=6)


def token_weights(window, rule: str, scale: float = 1.0):
    """Every token's weight, per micro-batch and sequence, as ``rule`` gives it (brute force: token by token)."""
    n = sum(sum(seqs) for seqs in window)
    sequences = sum(len(seqs) for seqs in window)
    weights = []
    for seqs in window:
        group = []
        for count in seqs:
            if rule == "token_mean":
                each = 1 / n
            elif rule == "micro_batch_mean":
                each = 1 / (len(window) * sum(seqs))
            elif rule == "sequence_mean":
                each = 1 / (sequences * count)
            else:  # "sum": every token's loss added
                each = 1.0
            group.append([each * scale] * count)
        weights.append(group)
    return weights


def hooked(weights, noise=0.0):
    """What the logits' hook reports of them: one record per sequence."""
    records = []
    for i, group in enumerate(weights):
        for tokens in group:
            w = [t * (1 + noise * ((j % 3) - 1)) for j, t in enumerate(tokens)]
            records.append(SequenceWeights(i, len(w), min(w), max(w), sum(w)))
    return records


def differ_enough(window) -> bool:
    totals = [sum(seqs) for seqs in window]
    return len(totals) >= 2 and max(totals) >= TELLS_APART * min(totals)


@given(windows, st.sampled_from(["token_mean", "micro_batch_mean", "sequence_mean"]))
def test_a_window_that_tells_the_rules_apart_is_named_by_the_rule_that_weighed_it(window, rule):
    records = hooked(token_weights(window, rule))
    assert tells_apart(records) is differ_enough(window)
    assume(differ_enough(window))
    fits = rules_that_fit(records)
    assert Normalisation(rule) in fits
    if rule == "micro_batch_mean":
        assert Normalisation.TOKEN_MEAN not in fits  # the micro-batches' totals differ by 25% or more
    named = weigh_window(records, Normalisation(rule), 1, 1, "fix", g=len(window))
    assert named.found is Normalisation(rule) and named.as_expected
    assert named.total == pytest.approx(1.0)
    assert named.tokens == tuple(sum(seqs) for seqs in window)


@given(windows, st.sampled_from([0.02, -0.02]))
def test_bf16_rounding_does_not_change_the_rule_named(window, noise):
    assume(differ_enough(window))
    for rule in ("token_mean", "micro_batch_mean"):
        named = weigh_window(hooked(token_weights(window, rule), noise), Normalisation.TOKEN_MEAN, 1, 1, "fix")
        assert named.found is Normalisation(rule)


def test_the_ratio_is_the_heaviest_token_over_the_lightest():
    named = weigh_window(hooked(token_weights([[3], [9], [17], [33]], "micro_batch_mean")), Normalisation.TOKEN_MEAN,
                         2, 5, "the fix", g=4)
    assert named.ratio == pytest.approx(11.0) and named.tokens == (3, 9, 17, 33)
    assert not named.as_expected and not named.off_scale
    text = named.message()
    assert text.startswith("epoch 2, update 5: micro-batches of 3, 9, 17, 33 trained tokens; the loss weighs them as "
                           "a mean per micro-batch")
    assert "expected a mean over the window's trained tokens" in text and text.endswith("; the fix")


@pytest.mark.parametrize("scale, said", [(4.0, "(G = 4: the window is summed, not averaged)"),
                                         (0.25, "(1/G: the loss is divided by G once more than a mean needs)"),
                                         (2.0, "the update is 2x what the learning rate assumes;")])
def test_a_mean_at_the_wrong_scale_is_named_with_its_factor(scale, said):
    named = weigh_window(hooked(token_weights([[3], [9], [17], [33]], "token_mean", scale)), Normalisation.TOKEN_MEAN,
                         1, 1, "the fix", g=4)
    assert named.found is Normalisation.TOKEN_MEAN and named.off_scale and not named.as_expected
    assert said in named.message() and "stepsync verify" in named.message()


def test_a_mean_within_the_scale_band_is_as_expected():
    for scale in (1 / OFF_SCALE * 1.01, 0.94, 1.0, OFF_SCALE * 0.99):
        named = weigh_window(hooked(token_weights([[3], [9]], "token_mean", scale)), Normalisation.TOKEN_MEAN, 1, 1, "")
        assert named.as_expected, scale


def test_several_ranks_do_not_read_the_scale():
    named = weigh_window(hooked(token_weights([[3], [9]], "token_mean", 4.0)), Normalisation.TOKEN_MEAN, 1, 1, "",
                         reads_total=False)
    assert named.total is None and named.as_expected and "in all" not in named.message()


def test_a_loss_that_is_not_a_cross_entropy_is_never_named():
    records = hooked(token_weights([[3], [9]], "token_mean"))
    records[1] = SequenceWeights(1, 9, -0.1, 0.2, 0.3)  # a negative weight: an advantage below zero
    named = weigh_window(records, Normalisation.TOKEN_MEAN, 1, 1, "fix")
    assert not named.cross_entropy and named.found is Normalisation.UNRECOGNISED and named.as_expected
    shaped = hooked(token_weights([[3], [9]], "token_mean"))
    shaped[0] = SequenceWeights(0, 3, 0.1, 0.1, 0.3, cross_entropy=False)
    assert rules_that_fit(shaped) == [] and not weigh_window(shaped, Normalisation.TOKEN_MEAN, 1, 1, "").cross_entropy


def test_weights_no_rule_fits_are_unrecognised_with_their_ratio():
    records = [SequenceWeights(0, 3, 1.0, 1.0, 3.0), SequenceWeights(1, 9, 0.5, 2.0, 9.0)]
    named = weigh_window(records, Normalisation.TOKEN_MEAN, 1, 1, "fix")
    assert named.found is Normalisation.UNRECOGNISED and named.ratio == pytest.approx(4.0) and not named.as_expected


def test_a_declared_rule_is_preferred_where_several_fit():
    """One sequence per micro-batch: a mean per micro-batch and per sequence weigh alike."""
    records = hooked(token_weights([[3], [9], [17]], "micro_batch_mean"))
    assert rules_that_fit(records) == [Normalisation.MICRO_BATCH_MEAN, Normalisation.SEQUENCE_MEAN]
    assert weigh_window(records, Normalisation.SEQUENCE_MEAN, 1, 1, "").found is Normalisation.SEQUENCE_MEAN
    assert weigh_window(records, Normalisation.TOKEN_MEAN, 1, 1, "").found is Normalisation.MICRO_BATCH_MEAN


def test_micro_batch_tokens_add_each_micro_batchs_sequences():
    records = hooked(token_weights([[3, 4], [8]], "token_mean"))
    assert micro_batch_tokens(records) == {0: 7, 1: 8}
    assert not tells_apart(records) and tells_apart(hooked(token_weights([[3, 4], [9, 1]], "token_mean")))
    assert not tells_apart(hooked(token_weights([[30]], "token_mean")))


@pytest.mark.parametrize("given_value, parsed", [("token_mean", Normalisation.TOKEN_MEAN),
                                                 ("Micro-Batch-Mean", Normalisation.MICRO_BATCH_MEAN),
                                                 (Normalisation.SEQUENCE_MEAN, Normalisation.SEQUENCE_MEAN)])
def test_a_declared_rule_is_parsed(given_value, parsed):
    assert Normalisation.parse(given_value) is parsed


@pytest.mark.parametrize("bad", ["mean", "unrecognised", Normalisation.UNRECOGNISED, 1, None])
def test_an_unknown_rule_is_refused_naming_the_choices(bad):
    with pytest.raises(StepSyncConfigError, match="Unsupported loss_normalisation .*'token_mean', "
                                                  "'micro_batch_mean', 'sequence_mean'"):
        Normalisation.parse(bad)


@settings(max_examples=50)
@given(windows)
def test_the_report_dict_holds_the_message(window):
    assume(differ_enough(window))
    named = weigh_window(hooked(token_weights(window, "micro_batch_mean")), Normalisation.TOKEN_MEAN, 1, 1, "x")
    data = named.to_dict()
    assert data["found"] == "micro_batch_mean" and data["message"] == named.message()
    assert data["as_expected"] is named.as_expected


def test_trls_generation_scale_matches_every_probe():
    """probes/trl_grpo.json: each update's window tokens over the normaliser TRL's GRPO divided the loss by, measured
    through the real Trainer (the median over every micro-batch of the run)."""
    import json
    import os

    from stepsync.core.tokens import trl_generation_scale

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "probes", "trl_grpo.json")) as rows:
        probed = json.load(rows)
    assert {row["trl"] for row in probed} >= {"1.9.0", "1.9.1", "1.14.2"}
    for row in probed:
        said = trl_generation_scale(row["trl"], row["loss_type"], row["steps_per_generation"], row["g"])
        factor = row["g"] / row["steps_per_generation"] if said else 1.0
        assert row["median_ratio"] == pytest.approx(factor, rel=0.1), row
        assert not said or f"every update is {factor:.3g}x the token mean" in said


def test_trls_generation_scale_says_nothing_where_nothing_is_scaled():
    from stepsync.core.tokens import trl_generation_scale

    assert trl_generation_scale("1.9.0", "dapo", 4, 2)
    assert trl_generation_scale("0.20.0", "cispo", 2, 4)
    assert not trl_generation_scale("1.9.0", "grpo", 4, 2)  # a mean per sequence, divided by G itself
    assert not trl_generation_scale("1.9.0", "dapo", 2, 2)  # one window per generation
    assert not trl_generation_scale("1.9.1", "dapo", 4, 2)
    assert not trl_generation_scale(None, "dapo", 4, 2)
    assert not trl_generation_scale("1.9.0", "dapo", None, 2)


def test_a_sum_over_the_tokens_is_named_a_sum():
    named = weigh_window(hooked(token_weights([[3], [9], [17], [33]], "sum")), Normalisation.TOKEN_MEAN, 1, 1, "", g=4)
    assert named.found is Normalisation.TOKEN_MEAN and named.total == pytest.approx(62.0) and not named.as_expected
    assert "the loss weighs them as a sum over the window's trained tokens (each weighs the same)" in named.message()
    assert "the update is 62x what the learning rate assumes" in named.message()
