"""How each window's loss weighs its trained tokens, named at run time in every framework, against the truth: the
first update of a window whose micro-batches hold 3, 9, 17 and 33 trained tokens (G=4, SGD at lr 1, no clipping)
held against each rule's gradient computed apart with plain torch from the same weights
(tests/harness/token_runs.py). A run trained by a rule has scale 1 and a residual near 0 against it.

The loops follow upstream: the accelerate loop written as transformers'
examples/pytorch/language-modeling/run_clm_no_trainer.py is (``model(**batch).loss`` inside ``accumulate()``), and
as accelerate's examples/by_feature/gradient_accumulation_for_autoregressive_models.py is (``num_items_in_batch``
counted over the window before it starts, the loss times G); the engine loop as DeepSpeed-Chat's step-1
``main.py`` (``model.backward(loss)``, ``model.step()``); Fabric's as its documented accumulation loop."""
import pytest

from harness.stack import INSTALLED
from packaging.version import Version

pytestmark = pytest.mark.integration

INSTALLED_TRANSFORMERS = Version(INSTALLED.transformers if INSTALLED.transformers not in (None, "newest") else "0")
# DeepSpeed 0.18.3 - 0.19.5 divide the gradient at a transformers model's logits once more (docs/updates.md).
DEEPSPEED_DIVIDES_THE_LOGITS = INSTALLED.deepspeed not in (None, "newest") and \
    Version("0.18.3") <= Version(INSTALLED.deepspeed) < Version("0.19.6")

COUNTS = [3, 9, 17, 33]
EXACT = 1e-4  # fp32: the update follows the rule's gradient to float rounding
BF16 = 0.1  # bf16 rounds the update itself


def right(run, rule, scale=1.0, residual=EXACT):
    found_scale, found_residual = run.against(rule)
    assert found_residual < residual and found_scale == pytest.approx(scale, rel=0.02), (rule, run.against(rule))


def wrong(run, rule):
    assert run.against(rule)[1] > 0.3, (rule, run.against(rule))


RULES = ("token_mean", "micro_batch_mean", "sequence_mean")


def agrees_with_the_truth(run, residual=EXACT) -> str:
    """stepsync names the rule the weights followed, the scale they moved by, and warns exactly where that is not
    a mean over the window's tokens; returns the rule."""
    rule = next(rule for rule in RULES if run.against(rule)[1] < residual)
    scale = run.against(rule)[0]
    named = run.report.token_weighting
    assert named.found.value == rule, (named, {r: run.against(r) for r in RULES})
    if named.total is not None:
        assert named.total == pytest.approx(scale, rel=0.02)
    assert named.as_expected is (rule == named.expected.value and 1 / 1.5 < scale < 1.5)
    assert bool(warned(run)) is (not named.as_expected)
    return rule


def said(run) -> list:
    return [note for note in run.report.notes if note.startswith("loss normalisation:")]


def not_checked(run) -> list:
    return [note for note in run.report.not_checked if note.startswith("loss normalisation:")]


def warned(run) -> list:
    named = run.report.token_weighting
    return [] if named is None or named.as_expected else said(run)


def transformers_stack():
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")


# ---------------------------------------------------------------- accelerate loops

def test_an_accelerate_loop_written_as_the_examples_is_named_a_mean_per_micro_batch():
    transformers_stack()
    from harness.token_runs import run_accelerate_tokens
    from stepsync.core.tokens import Normalisation

    run = run_accelerate_tokens(COUNTS, 4, loss="examples")
    assert run.error is None and run.engine_steps == 1
    assert agrees_with_the_truth(run) == "micro_batch_mean"
    wrong(run, "token_mean")
    named = run.report.token_weighting
    assert named.found is Normalisation.MICRO_BATCH_MEAN and not named.as_expected
    assert named.tokens == (3, 9, 17, 33) and named.ratio == pytest.approx(33 / 3, rel=1e-3)
    assert (named.epoch, named.update, named.g) == (1, 1, 4)
    assert len(warned(run)) == 1 and "gradient_accumulation_for_autoregressive_models" in warned(run)[0]


def test_accelerates_recipe_is_named_the_token_mean_and_nothing_is_warned():
    transformers_stack()
    from harness.token_runs import run_accelerate_tokens
    from stepsync.core.tokens import Normalisation

    run = run_accelerate_tokens(COUNTS, 4, loss="recipe")
    assert run.error is None
    assert agrees_with_the_truth(run) == "token_mean"
    wrong(run, "micro_batch_mean")
    named = run.report.token_weighting
    assert named.found is Normalisation.TOKEN_MEAN and named.ratio == pytest.approx(1.0, abs=1e-3)
    if not DEEPSPEED_DIVIDES_THE_LOGITS:
        assert named.as_expected and named.total == pytest.approx(1.0, rel=1e-3) and warned(run) == []


def test_a_declared_mean_per_micro_batch_holds_the_run_to_it():
    transformers_stack()
    from harness.token_runs import run_accelerate_tokens

    from stepsync.core.errors import StepSyncError

    run = run_accelerate_tokens(COUNTS, 4, loss="examples", declared="micro_batch_mean")
    assert agrees_with_the_truth(run) == "micro_batch_mean"
    stopped = run_accelerate_tokens(COUNTS, 4, loss="examples", declared="micro_batch_mean", policy="raise")
    if run.report.token_weighting.as_expected:
        assert stopped.error is None and stopped.engine_steps == 1
    else:  # DeepSpeed 0.18.3 - 0.19.5: the rule as declared, not the scale: stopped before the update (at the
        # first forward, where the release's extra division at the logits is said)
        assert isinstance(stopped.error, StepSyncError) and stopped.engine_steps == 0
    run = run_accelerate_tokens(COUNTS, 4, loss="recipe", declared="micro_batch_mean")
    agrees_with_the_truth(run)
    assert "expected a mean per micro-batch" in warned(run)[0]


def test_zero_2_in_bf16_names_the_same_rule():
    transformers_stack()
    from harness.token_runs import run_accelerate_tokens
    from stepsync.core.tokens import Normalisation

    run = run_accelerate_tokens(COUNTS, 4, loss="examples", stage=2, bf16=True)
    assert run.error is None
    assert agrees_with_the_truth(run, residual=BF16) == "micro_batch_mean"
    assert run.report.token_weighting.found is Normalisation.MICRO_BATCH_MEAN


# ---------------------------------------------------------------- the Trainer

def test_the_trainer_with_a_transformers_model_trains_the_token_mean(tmp_path):
    transformers_stack()
    from harness.token_runs import run_trainer_tokens
    from stepsync.core.tokens import Normalisation

    run = run_trainer_tokens(str(tmp_path), COUNTS, 4, model="transformers")
    assert run.error is None and run.engine_steps == 1
    assert agrees_with_the_truth(run) == "token_mean"
    wrong(run, "micro_batch_mean")
    named = run.report.token_weighting
    assert named.found is Normalisation.TOKEN_MEAN
    if INSTALLED_TRANSFORMERS < Version("4.47"):
        # transformers 4.46's Trainer divides by G once more under DeepSpeed: a quarter of the token mean's update
        # with G=4.
        assert named.total == pytest.approx(1 / 4, rel=0.1) and "(1/G: the loss is divided by G" in warned(run)[0]
    else:
        assert named.total == pytest.approx(1.0, rel=0.1) and named.as_expected


def test_the_trainer_with_a_model_that_ignores_num_items_in_batch_sums_each_micro_batchs_mean(tmp_path):
    transformers_stack()
    from harness.token_runs import run_trainer_tokens
    from stepsync.core.tokens import Normalisation

    run = run_trainer_tokens(str(tmp_path), COUNTS, 4, model="ignores")
    assert run.error is None
    assert agrees_with_the_truth(run) == "micro_batch_mean"
    named = run.report.token_weighting
    assert named.found is Normalisation.MICRO_BATCH_MEAN and not named.as_expected
    said = warned(run)[0]
    assert "num_items_in_batch" in said and "accepts_loss_kwargs" in said
    if INSTALLED_TRANSFORMERS >= Version("4.47"):  # 4.46 knows a forward takes them by the name loss_kwargs only
        assert named.total == pytest.approx(4.0, rel=1e-3) and "(G = 4: the window is summed" in said


@pytest.mark.parametrize("model, rule", [("ignores", "micro_batch_mean"), ("transformers", "token_mean")])
def test_the_trainer_without_deepspeed_is_named_by_its_loss_too(tmp_path, model, rule):
    """The Trainer alone (one process, its own SGD): where the window ends is accelerate's sync_gradients, read at
    each backward; a model that ignores num_items_in_batch sums each micro-batch's mean (G times the window's
    token mean for equal micro-batches), named and warned as with DeepSpeed, a transformers model's loss is the
    token mean and nothing is warned."""
    transformers_stack()
    from harness.token_runs import run_trainer_tokens

    run = run_trainer_tokens(str(tmp_path), COUNTS, 4, model=model, deepspeed=False)
    assert run.error is None and run.report.updater == "optimizer"
    assert agrees_with_the_truth(run) == rule
    assert bool(warned(run)) == (rule != "token_mean")


def test_accepts_loss_kwargs_false_makes_the_trainer_average_each_micro_batchs_mean(tmp_path):
    """The fix the warning above offers, run: the Trainer then divides each micro-batch's own mean by G (the
    micro-batch mean rule at scale 1), which a run declaring that rule finds as expected."""
    transformers_stack()
    from harness.token_runs import run_trainer_tokens

    run = run_trainer_tokens(str(tmp_path / "fixed"), COUNTS, 4, model="ignores", accepts_loss_kwargs=False,
                             declared="micro_batch_mean")
    assert run.error is None and agrees_with_the_truth(run) == "micro_batch_mean"
    assert run.against("micro_batch_mean")[0] == pytest.approx(1.0, rel=1e-3)
    assert run.report.token_weighting.as_expected and warned(run) == []


def each_micro_batchs_mean(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func as TRL's users write one: each micro-batch's own token mean, num_items_in_batch ignored."""
    from harness.token_runs import summed_token_loss

    return summed_token_loss(outputs.logits, labels) / int((labels[..., 1:] != -100).sum())


def the_windows_token_mean(outputs, labels, num_items_in_batch=None):
    """The fix the compute_loss_func warning offers: the summed token losses over the window's trained tokens."""
    from harness.token_runs import summed_token_loss

    return summed_token_loss(outputs.logits, labels) / num_items_in_batch


@pytest.mark.skipif(INSTALLED_TRANSFORMERS < Version("4.46"), reason="compute_loss_func is 4.46's")
def test_with_a_compute_loss_func_the_warning_offers_the_fix_that_works_there(tmp_path):
    """With a compute_loss_func, the Trainer never divides by G (model.accepts_loss_kwargs changes nothing: the
    update stays the window's summed means, measured); the warning offers dividing by num_items_in_batch in that
    function, and that run is a token mean, as expected."""
    transformers_stack()
    from harness.token_runs import run_trainer_tokens

    summed = run_trainer_tokens(str(tmp_path / "summed"), COUNTS, 4, model="ignores", accepts_loss_kwargs=False,
                                compute_loss_func=each_micro_batchs_mean)
    plain = run_trainer_tokens(str(tmp_path / "plain"), COUNTS, 4, model="ignores",
                               compute_loss_func=each_micro_batchs_mean)
    assert summed.error is None and agrees_with_the_truth(summed) == "micro_batch_mean"
    # accepts_loss_kwargs changed nothing (measured against the same run without it)
    assert summed.against("micro_batch_mean")[0] == pytest.approx(plain.against("micro_batch_mean")[0], rel=1e-4)
    if INSTALLED_TRANSFORMERS >= Version("4.47"):  # 4.46 lets DeepSpeed divide by G (scale 1, not G)
        assert summed.against("micro_batch_mean")[0] == pytest.approx(4.0, rel=1e-3)
    said = warned(summed)[0]
    assert "compute_loss_func" in said and "num_items_in_batch" in said and "accepts_loss_kwargs" not in said
    fixed = run_trainer_tokens(str(tmp_path / "fixed"), COUNTS, 4, model="ignores",
                               compute_loss_func=the_windows_token_mean)
    if INSTALLED_TRANSFORMERS < Version("4.57.6"):  # the release hands the function no num_items_in_batch: said so
        assert isinstance(fixed.error, TypeError) and "4.46.3 passes None: there count them yourself" in said
        return
    assert fixed.error is None and agrees_with_the_truth(fixed) == "token_mean" and warned(fixed) == []
    assert said.startswith(warned(summed)[0].split(";")[0]) and "divide the summed token losses by " \
        "num_items_in_batch in your compute_loss_func" in said


def test_the_trainer_under_raise_stops_before_the_windows_update(tmp_path):
    transformers_stack()
    from harness.token_runs import run_trainer_tokens
    from stepsync.core.errors import LossNormalisationError

    run = run_trainer_tokens(str(tmp_path), COUNTS, 4, model="ignores", policy="raise")
    assert isinstance(run.error, LossNormalisationError) and run.engine_steps == 0
    assert all(float((a - b).abs().max()) == 0 for a, b in zip(run.after, run.before))


# ---------------------------------------------------------------- a loop that drives the engine itself

@pytest.mark.parametrize("loss, rule", [("micro_batch_mean", "micro_batch_mean"), ("token_mean", "token_mean")])
def test_a_deepspeed_chat_loop_is_named_by_its_loss(loss, rule):
    pytest.importorskip("deepspeed")
    from harness.token_runs import run_engine_tokens

    run = run_engine_tokens(COUNTS, 4, loss=loss)
    assert run.error is None and run.engine_steps == 1
    right(run, rule)
    assert agrees_with_the_truth(run) == rule
    assert run.report.token_weighting.as_expected is (rule == "token_mean")


def test_raise_stops_an_engine_loop_before_any_of_the_window_is_applied():
    pytest.importorskip("deepspeed")
    from harness.token_runs import run_engine_tokens
    from stepsync.core.errors import LossNormalisationError

    run = run_engine_tokens(COUNTS, 4, policy="raise")
    assert isinstance(run.error, LossNormalisationError) and run.engine_steps == 0
    assert all(float((a - b).abs().max()) == 0 for a, b in zip(run.after, run.before))
    assert run.report.forecast_mismatches == []  # stopped inside the epoch: not an epoch that ended short


def test_sync_says_it_cannot_repair_and_changes_nothing():
    pytest.importorskip("deepspeed")
    from harness.token_runs import run_engine_tokens

    plain = run_engine_tokens(COUNTS, 4, policy=None)
    synced = run_engine_tokens(COUNTS, 4, policy="sync")
    assert synced.error is None
    assert all(float((a - b).abs().max()) == 0 for a, b in zip(plain.after, synced.after))
    assert "policy 'sync' cannot repair it from outside" in warned(synced)[0]


def test_a_per_sequence_mean_is_named_and_holds_where_declared():
    pytest.importorskip("deepspeed")
    from harness.token_runs import run_engine_tokens
    from stepsync.core.tokens import Normalisation

    counts = [(3, 9), (17, 33), (5, 7), (20, 2)]  # two sequences per micro-batch
    run = run_engine_tokens(counts, 4, loss="sequence_mean")
    right(run, "sequence_mean")
    wrong(run, "token_mean")
    assert agrees_with_the_truth(run) == "sequence_mean"
    assert run.report.token_weighting.found is Normalisation.SEQUENCE_MEAN and warned(run)
    declared = run_engine_tokens(counts, 4, loss="sequence_mean", declared="sequence_mean", policy="raise")
    assert declared.error is None and declared.report.token_weighting.as_expected
    assert declared.report.token_weighting.ratio == pytest.approx(33 / 2, rel=1e-3)


def test_a_policy_gradient_loss_is_not_named():
    """Tokens weighed by +1 and -1 advantages: not a cross-entropy's shape, so no rule is claimed, nothing warned,
    and raise does not stop."""
    pytest.importorskip("deepspeed")
    from harness.token_runs import run_engine_tokens

    run = run_engine_tokens([(3, 9), (17, 33), (5, 7), (20, 2)], 4, loss="advantage", policy="raise")
    assert run.error is None and run.engine_steps == 1
    named = run.report.token_weighting
    assert not named.cross_entropy and named.as_expected and "not a cross-entropy" in named.message()


def test_windows_that_cannot_tell_the_rules_apart_are_read_for_a_bounded_time():
    pytest.importorskip("deepspeed")
    from harness.token_runs import run_engine_tokens
    from stepsync.engine.tokens import WINDOWS_READ

    run = run_engine_tokens([9] * (2 * WINDOWS_READ + 2), 2)
    assert run.error is None and run.report.token_weighting is None
    assert said(run) == []  # nothing to act on: in the report's not_checked, never in the summary
    assert not_checked(run) == [f"loss normalisation: not named: the first {WINDOWS_READ} windows' micro-batches "
                                "held numbers of trained tokens too close to tell the rules apart (within 25%)"]
    single = run_engine_tokens(COUNTS * 2, 1)  # G=1: one micro-batch per window, whatever its tokens
    assert single.error is None and single.report.token_weighting is None
    assert said(single) == [] and not_checked(single) == [
        f"loss normalisation: not named: the first {WINDOWS_READ} windows held one micro-batch each"]


def test_zero_3_in_bf16_names_the_rule():
    pytest.importorskip("deepspeed")
    from harness.token_runs import run_engine_tokens
    from stepsync.core.tokens import Normalisation

    # DeepSpeed before 0.16 cannot train ZeRO-3 on this CPU, before 0.17.6 not bf16 (docs/updates.md)
    release = Version(INSTALLED.deepspeed if INSTALLED.deepspeed != "newest" else "1000")
    if release < Version("0.16"):
        pytest.skip("ZeRO-3 cannot run on a CPU with this DeepSpeed release")
    bf16 = release >= Version("0.17.6")
    run = run_engine_tokens(COUNTS, 4, stage=3, bf16=bf16)
    assert run.error is None
    assert agrees_with_the_truth(run, residual=BF16) == "micro_batch_mean"
    assert run.report.token_weighting.found is Normalisation.MICRO_BATCH_MEAN


@pytest.mark.parametrize("loop", ["engine", "accelerate"])
def test_two_ranks_name_their_own_windows_and_stop_together(tmp_path, loop):
    """Rank 0's window holds 3, 9, 17, 33 trained tokens, rank 1's 8 each. The update is the mean over both ranks
    of each micro-batch's own mean; rank 0 names it, rank 1 has nothing to name; under raise both stop before it."""
    pytest.importorskip("deepspeed")
    if loop == "accelerate":
        transformers_stack()
        if INSTALLED.accelerate != "newest" and Version(INSTALLED.accelerate) < Version("1.13"):
            pytest.skip("accelerate before 1.13 runs accumulate() on several ranks into DeepSpeed's no_sync(), which "
                        "fails or divides wrong (docs/updates.md)")
    import torch

    from harness.paths import entry_script
    from harness.runs import two_ranks
    from harness.token_runs import projection

    stage = "2" if loop == "engine" else "1"  # accumulate() enters no_sync(), which ZeRO-2 refuses
    first, second, _ = two_ranks(entry_script("token_ranks.py"), tmp_path, stage, loop, "none", "warn", "raise")
    for policy in ("none", "warn"):
        a, b = first[policy], second[policy]
        assert a["error"] is b["error"] is None and a["engine_steps"] == b["engine_steps"] == 1
        assert a["update"] == b["update"]
        update = [torch.tensor(a["update"])]
        both = [(torch.tensor(a["micro_batch_mean"]) + torch.tensor(b["micro_batch_mean"])) / 2]
        scale, residual = projection(update, both)
        assert scale == pytest.approx(1.0, rel=1e-3) and residual < EXACT
        tokens = (torch.tensor(a["token_mean"]) * a["trained"] + torch.tensor(b["token_mean"]) * b["trained"])
        assert projection(update, [tokens])[1] > 0.3
    assert (first["warn"]["found"], second["warn"]["found"]) == ("micro_batch_mean", None)
    assert first["warn"]["total"] is None  # not read on several ranks
    assert first["none"]["found"] is None
    assert first["raise"]["error"] == second["raise"]["error"] == "LossNormalisationError"
    assert first["raise"]["engine_steps"] == second["raise"]["engine_steps"] == 0
    assert max(map(abs, first["raise"]["update"])) == max(map(abs, second["raise"]["update"])) == 0


# ---------------------------------------------------------------- Lightning and Fabric

@pytest.mark.parametrize("loss", ["micro_batch_mean", "token_mean"])
def test_lightning_is_named_by_its_modules_loss(loss):
    pytest.importorskip("lightning")
    from harness.token_runs import run_lightning_tokens

    run = run_lightning_tokens(COUNTS, 4, loss=loss)
    assert run.error is None and run.engine_steps == 1
    # Lightning divides the loss by G and the engine again: every token at 1/G of the rule.
    right(run, loss, scale=0.25)
    assert agrees_with_the_truth(run) == loss
    assert "(1/G: the loss is divided by G once more than a mean needs)" in warned(run)[0]


@pytest.mark.parametrize("loss", ["micro_batch_mean", "token_mean"])
def test_lightning_without_deepspeed_is_named_by_its_modules_loss(loss):
    """Lightning's own accumulation: its closure divides the loss by G once, as a mean needs; the callback says
    where each training forward returns (no engine's forward hook can) and Lightning's loop where a window ends."""
    pytest.importorskip("lightning")
    from harness.token_runs import run_lightning_tokens

    run = run_lightning_tokens(COUNTS, 4, loss=loss, deepspeed=False)
    assert run.error is None and run.engine_steps == 1 and run.report.updater == "optimizer"
    right(run, loss)
    assert agrees_with_the_truth(run) == loss
    assert not [line for line in run.report.not_checked if line.startswith("loss normalisation")]


@pytest.mark.parametrize("loss", ["micro_batch_mean", "token_mean"])
def test_a_fabric_loop_is_named_at_its_own_windows(loss):
    pytest.importorskip("lightning")
    from harness.token_runs import run_fabric_tokens

    run = run_fabric_tokens(COUNTS, 4, loss=loss)
    assert run.error is None
    right(run, loss)
    assert agrees_with_the_truth(run) == loss


@pytest.mark.parametrize("loss", ["micro_batch_mean", "token_mean"])
def test_a_fabric_loop_without_deepspeed_is_named_at_its_own_windows(loss):
    pytest.importorskip("lightning")
    from harness.token_runs import run_fabric_tokens

    run = run_fabric_tokens(COUNTS, 4, loss=loss, deepspeed=False)
    assert run.error is None and run.report.updater == "optimizer"
    right(run, loss)
    assert agrees_with_the_truth(run) == loss


# ---------------------------------------------------------------- a torch-native loop sharded with FSDP2

@pytest.mark.parametrize("loss, rule", [("micro_batch_mean", "micro_batch_mean"), ("token_mean", "token_mean")])
def test_an_fsdp2_loop_is_named_by_its_loss(loss, rule):
    """The watch gives the reader the sync in force at each backward: the window's end, as FSDP2 makes it."""
    from harness.token_runs import run_sharded_tokens

    run = run_sharded_tokens(COUNTS, 4, loss=loss)
    assert run.error is None and run.engine_steps == 1
    right(run, rule)
    assert agrees_with_the_truth(run) == rule
    assert run.report.token_weighting.as_expected is (rule == "token_mean")
