"""The run and every policy, driven by a small fake engine through the Trainer's loop: exact decisions.

The fake engine keeps DeepSpeed's two counters and its boundary rule (``(micro_steps + 1) % G == 0`` unless
``set_gradient_accumulation_boundary`` overrides it); the loop counts an update as transformers 5.x does
(every G-th micro-batch and at the epoch's end) and applies what the run returns, as the callback does.
The real Trainer and DeepSpeed are exercised by tests/integration; these pin the decisions themselves.
"""
import json
from types import SimpleNamespace

import pytest

from stepsync.core.choices import Policy
from stepsync.core.errors import (NonFiniteUpdateError, StepDriftError, StepSyncConfigError, StepSyncError,
                                  UpdateSkippedError)
from stepsync.core.events import Cause
from stepsync.core.frameworks import ACCELERATE_LOOP, LIGHTNING, TRAINER
from stepsync.core.lightning_versions import LightningStack, lightning_behaviour_of
from stepsync.core.plan import RunPlan
from stepsync.core.tracking import finding_metrics
from stepsync.core.versions import Stack, behaviour_of
from stepsync.display.output import ConsoleOutput
from stepsync.engine.lifecycle import RunStart, close_run, open_run
from stepsync.engine.policies import RealignAction, Steering, loop_action_for

DRIFTING = Stack("5.24.0", "1.7.0", "0.19.8")
ALIGNED = Stack("5.24.0", "1.16.0", "0.19.8")


class Weights:
    """What stepsync reads of a weight tensor or parameter (``numel``, ``detach().sum()``), over plain floats: the
    fast loop runs without torch."""

    def __init__(self, size):
        self.values = [0.0] * size

    def numel(self):
        return len(self.values)

    def detach(self):
        return self

    @property
    def data(self):
        return self

    def sum(self):
        return sum(self.values)

    def __setitem__(self, index, value):
        self.values[index] = value


class Module:
    """A module whose parameters are read one by one (ZeRO-3, or no flat buffer)."""

    def __init__(self, *sizes):
        self.weights = [Weights(size) for size in sizes]

    def parameters(self):
        return iter(self.weights)


class FakeEngine:
    """DeepSpeed's counters and boundary, nothing else."""

    def __init__(self, g, steerable=True, skips=(), clip=None, fp16=False, scale=None, nan_at=None, flat=True):
        self.global_steps = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._g = g
        self._skips = set(skips)  # the updates (1-based) whose gradients are not finite: counted, not applied
        self._is_gradient_accumulation_boundary = None
        self.optimizer = SimpleNamespace()
        if not steerable:
            self.set_gradient_accumulation_boundary = None
        if clip is not None:
            self.gradient_clipping = lambda: clip
        if fp16:
            self.fp16_enabled = self.dynamic_loss_scale = lambda: True
        if scale is not None:  # fp16's dynamic scaler: (now, minimum, window)
            self.optimizer.loss_scaler = SimpleNamespace(cur_scale=scale[0], min_scale=scale[1], scale_window=scale[2])
        self._nan_at = nan_at  # the update (1-based) that leaves the weights not finite
        self._weights = Weights(3)
        if flat:  # ZeRO 1-2 keep every weight in a flat buffer
            self.optimizer.bit16_groups_flat = [self._weights]
        else:
            self.module = Module(3, 1)

    def gradient_accumulation_steps(self):
        return self._g

    def set_gradient_accumulation_boundary(self, value):
        self._is_gradient_accumulation_boundary = value

    def is_gradient_accumulation_boundary(self):  # the value set, else the micro-step counter's
        boundary = self._is_gradient_accumulation_boundary
        return (self.micro_steps + 1) % self._g == 0 if boundary is None else boundary

    def step(self):  # what accelerate < 1.8 calls after every backward
        boundary = self.is_gradient_accumulation_boundary()
        self.global_steps += boundary
        skipped = boundary and self.global_steps in self._skips
        self.skipped_steps += skipped
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if skipped and scaler is not None:
            scaler.cur_scale = max(scaler.cur_scale / 2, scaler.min_scale)
        if boundary and self.global_steps == self._nan_at:
            self._weights[1] = float("nan")
            for param in getattr(self, "module", Module(1, 1)).parameters():
                param.data[0] = float("nan")
        self.micro_steps += 1


def drive(policy, n, g, epochs, stack=DRIFTING, engine=None):
    """Run the Trainer's loop over a fake engine; (run, [(epoch, micro-batch, Steering)], final count)."""
    engine = engine or FakeEngine(g)
    planned = epochs * -(-n // g)
    run, started = open_run(RunStart(TRAINER, Policy.parse(policy), engine, behaviour_of(stack), n, g,
                                     ConsoleOutput(False), planned_steps=planned, plan=RunPlan(n, g, epochs)))
    decisions = []
    if started is not None:
        decisions.append((0, 0, started))
        planned = started.max_steps or planned
    count = 0
    for epoch in range(1, epochs + 1):
        run.begin_epoch()
        for position in range(1, n + 1):
            counted = position % g == 0 or position == n
            engine.step()
            count += counted
            steering = run.after_micro_batch(counted, count)
            if steering is not None:
                decisions.append((epoch, position, steering))
                count = steering.trainer_steps if steering.trainer_steps is not None else count
                if steering.end_epoch:
                    break
            if counted and count >= planned:
                break
        steering = run.end_epoch(count)
        if steering is not None:
            decisions.append((epoch, "end", steering))
            count = steering.trainer_steps if steering.trainer_steps is not None else count
        if count >= planned:
            break
    close_run(run.report, run, count)
    return run, decisions, count


def test_warn_decides_nothing_and_reports_each_change_of_the_drift():
    run, decisions, count = drive("warn", 3, 2, 2)
    assert decisions == []
    assert (count, run.engine.global_steps) == (4, 3)
    assert [(e.epoch, e.micro_batch, e.where, e.drift, e.cause) for e in run.report.events] == [
        (1, 3, "step_end", 1, Cause.PARTIAL_WINDOW)]
    assert [(row.trainer_steps, row.engine_steps) for row in run.report.epochs] == [(2, 1), (4, 3)]
    assert run.report.unapplied_micro_batches == 0


def test_warn_on_an_aligned_stack_sees_no_event_even_when_the_engine_drifts():
    run, _, count = drive("warn", 3, 2, 2, stack=ALIGNED)  # the fake engine still counts its own windows
    assert [(e.where, e.drift) for e in run.report.events] == [("step_end", 1)]


def test_raise_stops_before_the_first_micro_batch_where_the_forecast_says_the_counts_part():
    engine = FakeEngine(2)
    with pytest.raises(StepDriftError) as stopped:
        drive("raise", 3, 2, 2, engine=engine)
    event = stopped.value.event
    assert engine.micro_steps == 0  # nothing trained
    assert (event.epoch, event.micro_batch, event.trainer_steps, event.engine_steps) == (1, 3, 2, 1)
    assert event.where == "forecast" and event.cause is Cause.PARTIAL_WINDOW
    said = str(stopped.value)
    assert said.startswith("the forecast: affected: the Trainer counts 4 updates, the engine makes 3")
    assert "stops every rank before the first micro-batch" in said and "epoch 1, micro-batch 3" in said


def test_raise_without_a_forecast_stops_at_the_first_divergence():
    """A run whose epoch length is not known has no forecast: raise stops where the counts part."""
    engine = FakeEngine(2)
    run, started = open_run(RunStart(TRAINER, Policy.RAISE, engine, behaviour_of(DRIFTING), None, 2,
                                     ConsoleOutput(False), planned_steps=4, plan=None))
    run.begin_epoch()
    with pytest.raises(StepDriftError) as stopped:
        for count in (0, 1, 1):
            engine.step()
            run.after_micro_batch(count == 1 and engine.micro_steps == 2, count)
        run.end_epoch(2)
    assert stopped.value.event.where != "forecast" and engine.micro_steps == 3


def test_sync_steers_the_engine_to_every_trainer_update_and_gives_the_boundary_back():
    engine = FakeEngine(2)
    run, decisions, count = drive("sync", 3, 2, 2, engine=engine)
    assert decisions == []
    assert (count, engine.global_steps) == (4, 4)
    assert run.report.events == []
    assert engine._is_gradient_accumulation_boundary is None  # finish() restored DeepSpeed's own rule


def test_sync_that_cannot_steer_falls_back_to_realign_at_the_start():
    run, decisions, count = drive("sync", 3, 2, 2, engine=FakeEngine(2, steerable=False))
    first = decisions[0][2]
    assert isinstance(first.replacement, RealignAction) and first.max_steps == 3
    assert run.report.policy is Policy.REALIGN and count == run.engine.global_steps == 3
    assert any("falling back to policy 'realign'" in note for note in run.report.notes)


def test_realign_lowers_the_plan_and_moves_the_trainer_back_to_the_engine():
    run, decisions, count = drive("realign", 3, 2, 2)
    assert decisions == [
        (0, 0, Steering(max_steps=3)),
        (1, 3, Steering(trainer_steps=1, decide_flow_again=False)),  # the epoch's partial window: no engine update
    ]
    assert (count, run.engine.global_steps, run.report.corrections) == (3, 3, 1)


def test_drop_last_ends_every_epoch_after_its_last_whole_window():
    run, decisions, count = drive("drop_last", 5, 2, 2)
    assert decisions == [(0, 0, Steering(max_steps=4)), (1, 4, Steering(end_epoch=True)),
                         (2, 4, Steering(end_epoch=True))]
    assert (count, run.engine.global_steps) == (4, 4)
    assert run.report.dropped_micro_batches == {1: 1, 2: 1}


def test_drop_last_refuses_an_epoch_shorter_than_a_window():
    with pytest.raises(StepSyncConfigError, match="lower gradient_accumulation_steps"):
        drive("drop_last", 1, 2, 2)


@pytest.mark.parametrize("policy", ["sync", "realign"])
def test_a_remedy_with_nothing_to_do_says_so_and_decides_nothing(policy):
    run, decisions, count = drive(policy, 4, 2, 2, stack=ALIGNED, engine=FakeEngine(2))
    assert [d for d in decisions if d[2].trainer_steps or d[2].end_epoch] == []
    assert any("does nothing here" in note for note in run.report.notes)


def test_the_record_says_where_the_next_micro_batch_is():
    from stepsync.engine.resume import record_of

    engine = FakeEngine(2)
    run, _ = open_run(RunStart(TRAINER, Policy.WARN, engine, behaviour_of(DRIFTING), 3, 2, ConsoleOutput(False)))
    run.begin_epoch()
    engine.step()
    run.after_micro_batch(False, 0)
    record = record_of(run)
    assert (record.next_epoch, record.next_skip, record.unapplied_at_save, record.resume_steps) == (0, 1, 1, None)


def test_a_fault_while_observing_ends_only_the_observing():
    run, _, _ = drive("realign", 3, 2, 1)
    run.observing = True

    def broken(*args):
        raise OSError("disk full")

    run.observe(broken)
    assert not run.observing and run.report.policy is Policy.REALIGN and "still acts" in run.report.inactive_reason


def loop_run(policy, n, g, epochs, stack=DRIFTING, engine=None):
    """An accelerate loop over a fake engine, its windows said by the loop (``sync_gradients``) before each
    backward, as ``stepsync.watch`` passes them on: (run, the loop's count)."""
    engine = engine or FakeEngine(g)
    behaviour = behaviour_of(stack)
    run, _ = open_run(RunStart(ACCELERATE_LOOP, Policy.parse(policy), engine, behaviour, n, g, ConsoleOutput(False),
                               plan=RunPlan(n, g, epochs), action=loop_action_for(Policy.parse(policy))))
    count = 0
    for _ in range(epochs):
        run.begin_epoch()
        for position in range(1, n + 1):
            counted = position % g == 0 or position == n
            run.before_micro_batch(counted)
            engine.step()
            count += counted
            run.after_micro_batch(counted, count)
        run.end_epoch(count)
    close_run(run.report, run, count)
    return run, count


def test_a_loops_sync_makes_the_engine_follow_the_loops_own_word_and_gives_the_boundary_back():
    engine = FakeEngine(2)
    run, count = loop_run("sync", 3, 2, 2, engine=engine)
    assert (count, engine.global_steps) == (4, 4) and run.report.events == []
    assert engine._is_gradient_accumulation_boundary is None
    warned, _ = loop_run("warn", 3, 2, 2)
    assert (warned.report.trainer_steps, warned.report.engine_steps) == (4, 3)
    assert warned.report.events[0].counter == "loop updates" and str(warned.report).startswith(
        "stepsync report (policy 'warn'): your loop 4 updates, engine 3")


def test_a_loops_sync_on_an_engine_that_cannot_be_steered_is_refused_at_the_start():
    with pytest.raises(StepSyncConfigError, match="cannot steer this engine.*use policy='warn'"):
        loop_run("sync", 3, 2, 2, engine=FakeEngine(2, steerable=False))


def test_what_the_updates_miss_is_in_the_final_report_not_only_in_the_forecast():
    behaviour = lightning_behaviour_of(LightningStack("2.6.6", "0.19.8"))
    engine = FakeEngine(2)
    run, _ = open_run(RunStart(LIGHTNING, Policy.WARN, engine, behaviour, 4, 2, ConsoleOutput(False),
                               plan=RunPlan(4, 2, 1, zero_stage=2)))
    run.begin_epoch()
    for position in range(1, 5):
        engine.step()
        run.after_micro_batch(position % 2 == 0, position // 2)
    run.end_epoch(2)
    report = close_run(run.report, run, 2)
    assert report.update_flaws == ["each micro-batch weighs 1/4 of its update, not 1/2 (Lightning and DeepSpeed both "
                                   "divide the loss by G)"]
    assert "updates: each micro-batch weighs 1/4 of its update" in str(report)
    assert report.to_dict()["update_flaws"] == report.update_flaws and report.to_dict()["framework"] == "Lightning"
    assert report.finished and report.planned_steps == 2 and report.events == []


def test_an_update_the_engine_skips_is_counted_apart_where_it_happened():
    engine = FakeEngine(2, skips={2})
    run, _, count = drive("warn", 3, 2, 2, engine=engine)
    report = run.report
    assert [(s.epoch, s.micro_batch, s.engine_steps, s.by_design) for s in report.skipped_updates] == [(2, 1, 2, False)]
    assert (report.engine_steps, report.engine_skipped, report.applied_steps) == (3, 1, 2)
    assert [row.engine_skipped for row in report.epochs] == [0, 1]
    assert report.missed_updates == 2 and not report.schedule_finished  # planned 4, applied 2
    assert "schedule: planned 4, made 3 (1 skipped, 2 applied) (2 not made)" in str(report)
    assert "skipped update 2 at epoch 2, micro-batch 1: a gradient was not finite" in str(report)
    assert "applied: 2 of the engine's 3 updates (1 skipped)" in str(report)
    assert sum("the engine skipped update 2" in note for note in report.notes) == 1
    assert report.to_dict()["applied_steps"] == 2 and report.to_dict()["skipped_updates"][0]["engine_steps"] == 2


def render_text(report) -> str:
    """The summary view as a terminal 100 columns wide shows it."""
    import io

    from rich.console import Console

    from stepsync.display.render import summary_view

    shown = io.StringIO()
    Console(file=shown, width=100).print(summary_view(report))
    return shown.getvalue()


def test_a_run_that_skips_update_after_update_keeps_a_bounded_report():
    """200 updates, every one skipped (a gradient not finite each time): the report keeps the first 7 and the last,
    counts all 200, and its summary and JSON stay the same size as a run with 20 skips."""
    from stepsync.core.report import KEPT

    def skipping(updates):
        engine = FakeEngine(2, skips=set(range(1, updates + 1)))
        run, _, _ = drive("warn", 2 * updates, 2, 1, engine=engine)
        return run.report

    long, short = skipping(200), skipping(20)
    assert [skip.engine_steps for skip in long.skipped_updates] == [*range(1, KEPT), 200]
    assert (long.skips_lost, long.skips_by_design, long.engine_skipped, long.applied_steps) == (200, 0, 200, 0)
    assert "applied: 0 of the engine's 200 updates (200 skipped)" in str(long)
    assert "the engine skipped 200 update(s) it counted: first update 1" in " ".join(render_text(long).split())
    assert len(json.dumps(long.to_dict())) - len(json.dumps(short.to_dict())) < 40  # digits, not entries
    assert sum("the engine skipped update" in note for note in long.notes) == 1


def test_updates_that_lose_micro_batches_are_kept_bounded_and_counted_whole():
    from stepsync.core.events import LostGradients
    from stepsync.core.report import KEPT, SyncReport

    report = SyncReport(Policy.WARN, active=True)
    for update in range(1, 101):
        report.took_lost_gradients(LostGradients(1, 4 * update, update, 4, 3, 2))
    assert [lost.engine_steps for lost in report.lost_gradients] == [*range(1, KEPT), 100]
    assert (report.updates_losing, report.lost_micro_batches) == (100, 300)
    assert "lost: 300 micro-batch(es) in 100 update(s); first update 1" in str(report)


def test_raise_stops_at_the_first_skipped_update_before_another_is_made():
    engine = FakeEngine(2, skips={1, 2})
    with pytest.raises(UpdateSkippedError) as stopped:
        drive("raise", 4, 2, 2, engine=engine)
    assert (stopped.value.skip.engine_steps, engine.global_steps) == (1, 1)
    assert isinstance(stopped.value, StepSyncError)


def test_fp16s_loss_scale_search_is_counted_as_such_and_does_not_stop_raise():
    engine = FakeEngine(2, skips={1}, fp16=True)
    run, _, _ = drive("raise", 4, 2, 1, engine=engine)
    assert [s.by_design for s in run.report.skipped_updates] == [True] and run.report.lost_updates == []
    assert any("fp16's dynamic loss scale" in note for note in run.report.notes)


def test_an_fp16_skip_at_the_minimum_loss_scale_is_lost_data_and_stops_raise():
    # The scale halves 4 -> 2 -> 1 (its minimum) at the first two skips: a search. The third finds it at 1 already.
    engine = FakeEngine(2, skips={1, 2, 3}, fp16=True, scale=(4.0, 1.0, 1000))
    run, _, _ = drive("warn", 8, 2, 1, engine=engine)
    skips = run.report.skipped_updates
    assert [(s.engine_steps, s.by_design, s.at_minimum_scale, s.loss_scale) for s in skips] == [
        (1, True, False, 2.0), (2, True, False, 1.0), (3, False, True, 1.0)]
    assert run.report.lost_updates == [skips[2]] and "minimum loss scale" in str(skips[2])
    engine = FakeEngine(2, skips={1, 2, 3}, fp16=True, scale=(4.0, 1.0, 1000))
    with pytest.raises(UpdateSkippedError) as stopped:
        drive("raise", 8, 2, 1, engine=engine)
    assert stopped.value.skip.engine_steps == 3 and engine.global_steps == 3
    # Enough clean updates between two skips for the scale to grow again: a search, not lost data.
    engine = FakeEngine(2, skips={1, 4}, fp16=True, scale=(2.0, 1.0, 2))
    run, _, _ = drive("raise", 12, 2, 1, engine=engine)
    assert [s.by_design for s in run.report.skipped_updates] == [True, True]


@pytest.mark.parametrize("flat", [True, False])
def test_the_update_that_leaves_the_weights_not_finite_is_named_once(flat):
    engine = FakeEngine(2, nan_at=2, flat=flat)
    run, _, _ = drive("warn", 8, 2, 1, engine=engine)
    found = run.report.non_finite
    # Flat buffers are read after every update; a module's parameters at the epoch's end.
    assert (found.epoch, found.micro_batch, found.engine_steps, found.each_update) == (
        (1, 4, 2, True) if flat else (1, 8, 4, False))
    assert sum("left weights that are not finite" in note for note in run.report.notes) == 1
    assert finding_metrics(run.report) == {"stepsync/non_finite_at_update": found.engine_steps}
    assert run.report.to_dict()["non_finite"]["engine_steps"] == found.engine_steps
    assert f"made 4 (weights not finite {'from' if flat else 'by'} update {found.engine_steps})" in str(run.report)
    engine = FakeEngine(2, nan_at=2, flat=flat)
    with pytest.raises(NonFiniteUpdateError) as stopped:
        drive("raise", 8, 2, 1, engine=engine)
    assert isinstance(stopped.value, StepSyncError) and engine.global_steps == (2 if flat else 4)


def test_the_weights_are_not_read_where_the_engine_checks_its_gradients():
    from stepsync.engine.deepspeed import engine_facts

    def facts(**calls):
        engine = FakeEngine(2)
        for name, value in calls.items():
            setattr(engine, name, lambda value=value: value)
        return engine_facts(engine).unchecked_gradients

    assert facts(fp16_enabled=True) == ""
    bf16 = FakeEngine(2)
    bf16.bfloat16_enabled = lambda: True
    bf16._config = SimpleNamespace(bfloat16_config=SimpleNamespace(check_grad_overflow=True))
    from stepsync.engine.deepspeed import engine_facts as read
    assert read(bf16).unchecked_gradients == ""
    bf16._config.bfloat16_config.check_grad_overflow = False
    assert '"check_grad_overflow": true' in read(bf16).unchecked_gradients
    assert "fp32" in facts()
    run, _, _ = drive("warn", 4, 2, 1, engine=FakeEngine(2, fp16=True))
    assert run.updates.weights is None


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_the_clip_norm_in_force_is_held_against_the_one_asked(policy):
    def start(clip, asked):
        return open_run(RunStart(TRAINER, Policy.parse(policy), FakeEngine(2, clip=clip), behaviour_of(DRIFTING), 3,
                                 2, ConsoleOutput(False), asked_clip=asked))[0]

    assert not any("clip" in note for note in start(1.0, 1.0).report.notes)
    if policy == "raise":
        with pytest.raises(StepSyncConfigError, match="does not clip at all.*gradient_clipping.*auto"):
            start(0.0, 0.5)
        return
    notes = start(1.0, 0.5).report.notes
    assert any("asks to clip gradients at 0.5 but the DeepSpeed engine clips at 1" in note for note in notes)


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_an_engine_whose_g_is_not_the_frameworks_is_named_and_raise_stops_before_the_first(policy):
    def start():
        return open_run(RunStart(TRAINER, Policy.parse(policy), FakeEngine(3), behaviour_of(ALIGNED), 6, 2,
                                 ConsoleOutput(False)))[0]

    if policy == "raise":
        with pytest.raises(StepSyncConfigError, match="gradient_accumulation_steps=3 differs from .* 2.*before the "
                                                      "first micro-batch"):
            start()
        return
    assert any("gradient_accumulation_steps=3 differs" in note for note in start().report.notes)


def test_a_run_never_watched_says_why_not_counts_it_never_read():
    """The report of a run without DeepSpeed, after training: why it was not watched, never "0 updates"."""
    from stepsync.core.frameworks import TRAINER
    from stepsync.engine.lifecycle import idle_report

    report = idle_report(TRAINER, Policy.WARN, "the Trainer does not use DeepSpeed: nothing to check", speaks=False)
    report.finished = True
    assert str(report) == ("stepsync report (policy 'warn'): not active: the Trainer does not use DeepSpeed: nothing "
                           "to check")


def test_sync_sets_the_boundary_wherever_each_rule_counts_an_update():
    """SyncAction finds each window's end G after the last one, asking the rule only at an epoch's start and end:
    the boundaries it sets are the rule's, micro-batch by micro-batch, for every rule (brute force)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from stepsync.core import rules
    from stepsync.core.versions import TrainerRule
    from stepsync.engine.policies import SyncAction

    class Override:
        def set(self, value):
            pass

    @settings(max_examples=400, deadline=None)
    @given(st.sampled_from(list(TrainerRule)), st.integers(1, 40), st.integers(1, 9), st.integers(0, 30),
           st.integers(0, 39))
    def check(rule, n, g, t_before, skip):
        skip = skip % n  # a resumed epoch starts after its skipped micro-batches
        action = SyncAction()
        action.override, action.n = Override(), n
        run = SimpleNamespace(position=skip, g=g, t_before_epoch=t_before,
                              behaviour=SimpleNamespace(trainer_rule=rule))
        action.before_epoch(run)
        expected = []
        for position in range(skip + 1, n + 1):
            expected.append(action.expected)
            run.position = position
            action._prepare(run)
        assert expected == [rules.is_trainer_boundary(rule, p, n, g, t_before) for p in range(skip + 1, n + 1)]

    check()


def test_a_loop_whose_g_lives_only_in_the_engine_gets_no_forecast_and_every_drift_its_cause():
    """accelerate's checkpointing.py example with G only in the DeepSpeed plugin (accelerate 1.7): the loop counts
    every micro-batch, the engine every third. One forecast cannot count both; the fix names the accelerator."""
    from stepsync.core.events import Cause

    engine = FakeEngine(3)
    run, count = loop_run("warn", 13, 1, 2, engine=engine)
    report = run.report
    assert (count, engine.global_steps) == (26, 8) and (report.trainer_steps, report.engine_steps) == (26, 8)
    assert report.forecast is None and report.forecast_mismatches == []
    assert any(note.startswith("no forecast: the engine's gradient_accumulation_steps is 3 and your loop counts with 1")
               for note in report.notes)
    said = next(note for note in report.notes if "gradient_accumulation_steps=3 differs" in note)
    assert "Accelerator(gradient_accumulation_steps=...)" in said and "fix the DeepSpeed config" not in said
    assert report.events and {event.cause for event in report.events} <= {Cause.TWO_GS, Cause.CAUGHT_UP}


@pytest.mark.parametrize("framework", ["loop", "trainer"])
def test_sync_never_turns_the_engines_windows_into_the_frameworks_where_the_gs_differ(framework):
    """Following a count of G=1 would make the engine update at every micro-batch: sync watches only, says so, and
    every drift names what makes them one G."""
    engine = FakeEngine(3)
    if framework == "loop":
        run, _ = loop_run("sync", 13, 1, 2, engine=engine)
    else:
        run = drive("sync", 13, 1, 2, engine=engine)[0]
    report = run.report
    assert engine.global_steps == 8 and engine._is_gradient_accumulation_boundary is None
    assert any(note.startswith("policy 'sync' does not steer this run: the engine's gradient_accumulation_steps is 3") for note in
               report.notes)
    assert report.events and all(event.remedy == run.remedy for event in report.events)


def test_ranks_found_apart_in_words_in_the_report_and_in_its_json():
    from stepsync.core.events import RanksApart
    from stepsync.core.report import SyncReport

    apart = RanksApart(1, 4, 2, 0, "epoch end", 2)
    assert str(apart) == ("the 2 ranks' copies of the weights differ at update 2 (found at the epoch end, epoch 1, "
                          "micro-batch 4; they agreed after update 0)")
    assert "no comparison on this run found them agreeing" in str(RanksApart(1, 0, 0, None, "train begin", 4))
    report = SyncReport(Policy.WARN, active=True, ranks_apart=apart)
    assert f"ranks apart: {apart}" in str(report)
    assert report.to_dict()["ranks_apart"] == {"epoch": 1, "micro_batch": 4, "engine_steps": 2, "agreed_at": 0,
                                               "where": "epoch end", "ranks": 2}
    assert "ranks apart" not in str(SyncReport(Policy.WARN, active=True))


def test_an_unsynced_update_says_where_the_gradients_went_as_fsdp2_and_ddp_keep_them():
    """FSDP2 keeps a gradient the sync skipped for the next synced backward; DDP applies it at once on its own rank."""
    from stepsync.core.events import UnsyncedUpdate

    none_fsdp, none_ddp = UnsyncedUpdate(1, 2, 1, 2, 0, 0), UnsyncedUpdate(1, 2, 1, 2, 0, 0, applied_alone=True)
    assert "received no reduced gradient" in str(none_fsdp) and "the optimizer applied nothing" in str(none_fsdp)
    assert "each rank applied its own micro-batches alone, unreduced, and the ranks' weights part" in str(none_ddp)
    assert "set_requires_gradient_sync(is_last)" in str(none_fsdp) and "model.no_sync()" in str(none_ddp)
    waits, alone = UnsyncedUpdate(1, 4, 2, 3, 1, 2), UnsyncedUpdate(1, 4, 2, 3, 1, 0, applied_alone=True)
    assert str(waits) == ("update 2 at epoch 1, micro-batch 4: 2 of the 3 micro-batches your loop gave it wait "
                          "unreduced for a later update (the sync was off after its last synced backward); it holds 2 "
                          "micro-batch(es) of earlier windows; turn the sync on for the last micro-batch of each window "
                          "only (model.set_requires_gradient_sync(is_last) before its forward)")
    assert str(alone).startswith("update 2 at epoch 1, micro-batch 4: 2 of the 3 micro-batches your loop gave it are "
                                 "applied unreduced, each on its own rank alone")
    assert (waits.left, alone.left) == (2, 2)
