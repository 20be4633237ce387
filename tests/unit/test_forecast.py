"""The closed-form forecast equals a brute-force micro-batch simulation, for every rule and policy."""
import re
import time

import pytest
from hypothesis import given, settings, strategies as st

from harness.simulate import simulate
from stepsync.core.choices import Policy
from stepsync.core.forecast import RunPlan, forecast
from stepsync.core.versions import Stack, behaviour_of

STACKS = {
    "aligned": Stack("5.24.0", "1.16.0", "0.19.8"),
    "drifting": Stack("5.24.0", "1.7.0", "0.19.8"),
    "4.47": Stack("4.47.1", "1.2.1", "0.16.2"),
    "4.47-fixed": Stack("4.47.1", "1.8.1", "0.16.2"),
    "4.46": Stack("4.46.3", "1.1.1", "0.15.4"),
    "4.51": Stack("4.51.3", "1.6.0", "0.16.9"),
    "4.45": Stack("4.45.2", "0.34.2", "0.15.4"),
    "4.28": Stack("4.28.1", "0.18.0", "0.14.5"),
    "4.24": Stack("4.24.0", "0.15.0", "0.14.5"),
}


def rows_of(result):
    return [
        (r.epoch, r.micro_batches, r.trainer_updates, r.engine_updates, r.trainer_steps, r.engine_steps,
         r.partial_window, r.dropped, r.cut)
        for r in result.epochs
    ]


@pytest.mark.parametrize(
    "stack, n, g, epochs, max_steps, trainer, engine",
    [
        ("aligned", 3, 2, 2, -1, 4, 4),
        ("drifting", 3, 2, 2, -1, 4, 3),
        ("4.47", 3, 2, 2, 4, 4, 3),
        ("4.47-fixed", 3, 2, 2, 4, 4, 4),
        ("4.45", 3, 4, 2, -1, 2, 1),
        ("4.28", 3, 4, 2, -1, 2, 1),
        ("4.24", 3, 2, 3, -1, 3, 4),
    ],
)
def test_measured_runs(stack, n, g, epochs, max_steps, trainer, engine):
    """The runs measured on real stacks (the README's support table and the probes)."""
    result = forecast(RunPlan(n, g, epochs, max_steps), behaviour_of(STACKS[stack]))
    assert (result.trainer_steps, result.engine_steps) == (trainer, engine)
    assert result.aligned == (trainer == engine)


def test_the_smallest_drifting_case_rows():
    result = forecast(RunPlan(3, 2, 2), behaviour_of(STACKS["drifting"]))
    assert [(r.trainer_steps, r.engine_steps, r.drift, r.partial_window) for r in result.epochs] == [
        (2, 1, 1, 1),
        (4, 3, 1, 1),
    ]
    assert result.unapplied_micro_batches == 0
    assert "upgrade to accelerate>=1.8.0" in result.verdict()


@settings(max_examples=600, deadline=None)
@given(
    stack=st.sampled_from(sorted(STACKS)),
    policy=st.sampled_from(list(Policy)),
    n=st.integers(1, 23),
    g=st.integers(1, 7),
    epochs=st.integers(1, 5) | st.sampled_from([0.5, 1.5, 2.25]),
    max_steps=st.sampled_from([-1, -1, 1, 2, 3, 5, 8, 13]),
    trainer_start=st.sampled_from([0, 0, 0, 1, 2, 5]),
    engine_offset=st.sampled_from([0, 0, -1, 1]),
    batch=st.sampled_from([None, 1, 2, 3]),
)
def test_forecast_equals_simulation(stack, policy, n, g, epochs, max_steps, trainer_start, engine_offset, batch):
    behaviour = behaviour_of(STACKS[stack])
    engine_start = max(trainer_start + engine_offset, 0)
    # The dataset's length: N full batches, the last one maybe short (what the remainder cut reads).
    examples = None if batch is None else max(n * batch - (batch - 1 if n > 1 else 0), 1)
    plan = RunPlan(n, g, epochs, max_steps, trainer_start, engine_start, examples_per_epoch=examples)
    result = forecast(plan, behaviour, policy)
    rows, _, _, unapplied = simulate(n, g, epochs, max_steps, behaviour, policy, trainer_start, engine_start,
                                     examples)
    assert rows_of(result) == rows
    assert result.unapplied_micro_batches == unapplied


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.REALIGN, Policy.DROP_LAST])
@pytest.mark.parametrize("stack", ["drifting", "4.47", "4.45", "4.24"])
@pytest.mark.parametrize("n, g", [(3, 2), (5, 2), (7, 3), (3, 4), (10, 4)])
def test_remedies_leave_no_new_drift(policy, stack, n, g):
    result = forecast(RunPlan(n, g, 3), behaviour_of(STACKS[stack]), policy)
    if policy is Policy.DROP_LAST and n < g:
        assert result.epochs == []
    else:
        assert result.aligned, result.verdict()


def test_forecast_is_closed_form():
    started = time.perf_counter()
    result = forecast(RunPlan(10**6, 7, 100), behaviour_of(STACKS["drifting"]))
    elapsed = time.perf_counter() - started
    assert result.trainer_steps == 100 * -(-10**6 // 7)
    assert result.engine_steps == 100 * 10**6 // 7
    assert elapsed < 1.0  # generous: the benchmark reports the real figure


@pytest.mark.parametrize("kwargs, message", [
    (dict(micro_batches_per_epoch=0, gradient_accumulation_steps=2), "len(train_dataloader)"),
    (dict(micro_batches_per_epoch=3, gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    (dict(micro_batches_per_epoch=3, gradient_accumulation_steps=2, num_train_epochs=0), "num_train_epochs"),
    (dict(micro_batches_per_epoch=3, gradient_accumulation_steps=2, trainer_steps_at_start=-1), ">= 0"),
])
def test_bad_plans_say_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RunPlan(**kwargs)


def test_unknown_policy_lists_choices():
    with pytest.raises(ValueError, match="Possible choices are: 'warn', 'raise', 'sync', 'realign', 'drop_last'"):
        Policy.parse("fix-it")
