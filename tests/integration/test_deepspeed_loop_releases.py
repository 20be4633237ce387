"""Several backward() calls before one step() (open-instruct's learner, tests/harness/raw_loops.py) on ZeRO 1 and 2,
on each DeepSpeed release the stack holds: what each update holds, read from the weights, against what stepsync says.

The releases differ (probes/raw_loop.json, the config's G=1, K=4): 0.15.4 - 0.17.5 apply every micro-batch;
0.17.6 - 0.18.2 fail with a TypeError at the second backward(), and on ZeRO-2 apply only the last micro-batch where
the loop sets the boundary before it; 0.18.3 and later apply only the last micro-batch. The expectations below are
that table, written apart from stepsync's own (stepsync/core/weights.py: several_backwards).
"""
import pytest

from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]


def measured() -> str:
    from packaging.version import Version

    from stepsync.core.versions import installed_version

    release = Version(installed_version("deepspeed"))
    if release < Version("0.17.6"):
        return "keeps all"
    return "fails" if release < Version("0.18.3") else "keeps the last"


@pytest.mark.parametrize("stage", [1, 2])
def test_what_each_update_holds_is_what_the_report_says(stage):
    from harness.raw_loops import run_learner_loop

    if measured() == "fails":  # DeepSpeed's own failure, with or without stepsync
        for policy in (None, "warn"):
            with pytest.raises(TypeError):
                run_learner_loop(4, 2, stage, policy=policy)
        return
    plain, watched = run_learner_loop(4, 2, stage), run_learner_loop(4, 2, stage, policy="warn")
    assert watched.shares == plain.shares == ([1.0] * 8 if measured() == "keeps all" else [0.0, 0.0, 0.0, 1.0] * 2)
    lost = sum(share == 0.0 for share in plain.shares)
    assert watched.watch.report.lost_micro_batches == lost  # never a loss where the weights show none


def test_zero2_that_stepsync_cannot_count_is_said_so():
    """The loop's own fix (the boundary before its last backward()) on ZeRO-2: every micro-batch applied, except on
    0.17.6 - 0.18.2, where only the last is, which stepsync says it cannot count."""
    from harness.raw_loops import run_learner_loop

    run = run_learner_loop(4, 2, 2, policy="warn", set_boundary=True)
    said = [note for note in run.watch.report.notes if "cannot count what each update holds" in note]
    if measured() == "fails":
        assert run.shares == [0.0, 0.0, 0.0, 1.0] * 2 and len(said) == 1
    else:
        assert run.shares == [1.0] * 8 and said == []
    assert run.watch.report.lost_gradients == []


@pytest.mark.parametrize("stage", [1, 2])
def test_sync_applies_every_micro_batch_or_refuses_before_the_step(stage):
    from harness.raw_loops import run_learner_loop
    from stepsync.core.errors import StepSyncConfigError

    run = run_learner_loop(4, 2, stage, policy="sync")
    if measured() == "fails" and stage == 2:  # its closing backward() would apply nothing: refused first
        assert isinstance(run.error, StepSyncConfigError) and run.engine_steps == [] and run.shares == [0.0] * 8
    else:
        assert run.error is None and run.engine_steps == [1, 2] and run.shares == [1.0] * 8
