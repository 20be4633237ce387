"""Runs built the way users build them, checked against the truth recorded beside stepsync.

The cases are chosen pairwise over the settings that touch counting and checkpoints: every pair of
settings appears in some case. Each case runs the real Trainer and the real DeepSpeed engine on CPU, on
the stack the suite runs on (its share of the cases), and every run is checked against an independent
recorder (harness.runs.recorder), never against stepsync's own numbers.
"""
import os

import pytest

from harness.pairwise import pairwise, uncovered_pairs
from harness.stack import DRIFTS, STACK, needs_stack

N, G = 5, 2  # 3 Trainer windows per epoch, the last one partial

FACTORS = {
    "stack": ["drifting", "aligned", "t447"],
    "policy": ["warn", "sync", "realign", "drop_last"],
    "save": ["no", "steps", "epoch"],
    "eval": ["no", "steps", "epoch"],
    "best": [False, True],
    "length": ["epochs 3", "epochs 2.5", "max_steps 2", "max_steps 5"],
    "resume": ["none", "with", "without", "mid-window", "restore"],
    "again": [False, True],
}


def valid(case):
    if case["best"] and (case["save"] == "no" or case["eval"] != case["save"]):
        return False  # load_best_model_at_end needs matching save and eval strategies
    # The checkpoints resumed from are at steps 2 and 4: beyond a 2-step run's end.
    return not (case["resume"] != "none" and case["length"] == "max_steps 2")


CASES = pairwise(FACTORS, valid)
# The targeted tests below assert transformers >= 4.47 behaviour; the adoption test runs on every stack.
on_pairwise_stacks = pytest.mark.skipif(STACK not in FACTORS["stack"],
                                        reason="asserts the counts of the drifting, aligned and t447 stacks")


def case_id(case):
    return "-".join(str(case[name]).replace(" ", "") if not isinstance(case[name], bool) else
                    (name if case[name] else f"no{name}") for name in FACTORS)


def test_the_cases_cover_every_pair():
    assert uncovered_pairs(CASES, FACTORS, valid) == set()
    assert len(CASES) < 40  # all combinations would be thousands


def arguments(case):
    """TrainingArguments overrides for ``case``."""
    options = {}
    kind, value = case["length"].split()
    if kind == "epochs":
        options["epochs"] = float(value)
    else:
        options.update(epochs=3, max_steps=int(value))
    if case["save"] == "steps":
        options.update(save_strategy="steps", save_steps=2, save_total_limit=2)
    elif case["save"] == "epoch":
        options.update(save_strategy="epoch")
    if case["eval"] != "no":
        options.update(eval_strategy=case["eval"], eval_samples=2)
        if case["eval"] == "steps":
            options["eval_steps"] = 2
    if case["best"]:
        # The first evaluation is the best, so loading the best checkpoint takes the engine's count back,
        # which the report must not take for the training's.
        options.update(load_best_model_at_end=True, metric_for_best_model="first_is_best", greater_is_better=True,
                       on_trainer=lambda trainer: setattr(trainer, "compute_metrics",
                                                          lambda _: {"first_is_best": -trainer.state.global_step}))
    return options


def run(out, policy, **options):
    from stepsync import StepSyncCallback
    from harness.runs import run_tiny

    callback = StepSyncCallback(policy, console=False) if policy else None
    epochs = options.pop("epochs", 3)
    return run_tiny(str(out), samples=N, gas=G, epochs=epochs, callback=callback, **options)


def resume_point(tmp_path, case):
    """(checkpoint folder, the record it holds or None) for the case's resume, made by a first run."""
    if case["resume"] == "none":
        return None
    first_policy = {"with": case["policy"], "restore": case["policy"], "without": None, "mid-window": "warn"}
    # The same job saved every 2 steps: a resumed Trainer keeps the checkpoint's save, eval and logging steps.
    options = {key: value for key, value in arguments(case).items()
               if key not in ("load_best_model_at_end", "metric_for_best_model", "greater_is_better", "on_trainer")}
    options.update(save_strategy="steps", save_steps=2, save_total_limit=None)
    first = run(tmp_path / "first", first_policy[case["resume"]], **options)
    assert first.error is None
    step = 2 if case["resume"] in ("with", "restore") else 4  # checkpoint-4 is inside DeepSpeed's window
    return str(tmp_path / "first" / f"checkpoint-{step}")


def truth_events(recording, start_drift, policy=None):
    """(where, Trainer, engine) at every check point where the recorded drift changed; under realign a drift
    carried in and taken back to 0 by its correction is a note, not an event."""
    events, last = [], start_drift
    for where, trainer, engine in recording.checks:
        if trainer - engine != last:
            if not (policy == "realign" and trainer == engine and where != "train_begin"):
                events.append((where, trainer, engine))
            last = trainer - engine
    return events


def entries_hold(entries, before, truth):
    """The report's entries hold exactly the changes of ``truth`` this run made, after the ``before`` it resumed
    with: each new entry starts at a change, an entry that changed again ends at the change its count reaches, and a
    saved entry the run continued (the same cause) holds the first changes."""
    assert entries[:max(len(before) - 1, 0)] == before[:-1]
    done, new = 0, entries[len(before):]
    if before:
        kept, now = before[-1], entries[len(before) - 1]
        done = now.changes - kept.changes
        assert done == 0 and now == kept or now.last[2:] == truth[done - 1][1:], (now, truth)
    for entry in new:
        assert (entry.where, entry.trainer_steps, entry.engine_steps) == truth[done], (entry, truth)
        done += entry.changes
        assert entry.last is None or entry.last[2:] == truth[done - 1][1:], (entry, truth)
    assert done == len(truth), (entries, truth)
    return True


def check(result, case, out, resumed):
    from stepsync.tools.audit import audit_output_dir

    rec, report, state = result.recording, result.callback.report, result.trainer.state
    assert result.error is None, repr(result.error)
    assert report.active and report.finished
    # The report equals the truth at every epoch end and at the end.
    assert [(row.trainer_steps, row.engine_steps) for row in report.epochs] == rec.epoch_ends
    assert (report.trainer_steps, report.engine_steps) == (state.global_step, rec.engine_steps[-1])
    assert rec.trainer_steps[-1] == state.global_step
    assert report.micro_batches == len(rec.engine_steps)
    # Every change of the drift is in an entry, and only those (changes with one cause are one entry).
    saved = report.resumed_from
    start_drift = saved.drift if saved else 0
    truth = truth_events(rec, start_drift, case["policy"])
    assert entries_hold(report.events, saved.events if saved else [], truth)
    taken_back = [note for note in report.notes if "carried until then is taken back" in note]
    assert len(taken_back) == len(truth_events(rec, start_drift)) - len(truth)
    # Every log record carries the metrics, with the counts of the moment it was written.
    assert state.log_history[rec.history_at_start:] and rec.logs
    for record in state.log_history[rec.history_at_start:]:
        assert record["stepsync/trainer_steps"] == record["step"], record
        assert record["stepsync/drift"] == record["stepsync/trainer_steps"] - record["stepsync/engine_steps"]
    for logs, engine in rec.logs:
        assert logs["stepsync/engine_steps"] == engine, logs
    # Each checkpoint's folder, DeepSpeed tag and record agree with the truth at its save; inspect says so.
    saves = dict(rec.saves)
    # the micro-batches in the engine's open window at each save: since its last update (lost on resume)
    lost = {trainer: at - max([e for e in rec.engine_updates_at if e <= at] or [0])
            for (trainer, _), at in zip(rec.saves, rec.saved_after)}
    folders = sorted(name for name in os.listdir(out) if name.startswith("checkpoint-"))
    if folders:
        audit = {item.name: item for item in audit_output_dir(str(out)).checkpoints}
        for name in (f for f in folders if int(f.split("-")[1]) in saves):  # this run's saves
            trainer = int(name.split("-")[1])
            engine = saves[trainer]
            item = audit[name]
            assert (item.trainer_step, item.deepspeed_step, item.problems) == (trainer, engine, []), name
            assert item.unapplied_at_save == lost[trainer], (name, lost)
            assert item.ok == (trainer == engine and not lost[trainer]), (name, item.mismatches)
            if item.record is not None:
                assert (item.record.trainer_steps, item.record.engine_steps) == (trainer, engine)
    # The run ends like a normal one: its plan reached, the last checkpoint and evaluation made.
    assert state.global_step == state.max_steps or resumed and state.global_step > state.max_steps
    if case["save"] != "no":
        assert f"checkpoint-{state.global_step}" in folders
    # transformers 4.47's DefaultFlowCallback evaluates at the end only on an eval step (5.x always does); a
    # resumed 4.47 run keeps the checkpoint's eval_steps.
    evaluates_at_end = case["eval"] == "epoch" or case["eval"] == "steps" and (
        STACK != "t447" or state.global_step % state.eval_steps == 0)
    if evaluates_at_end:
        assert any("eval_loss" in r and r["step"] == state.global_step for r in state.log_history)
    if report.forecast is not None and not (resumed and STACK == "t447"):
        assert report.forecast_mismatches == []
        assert [(r.trainer_steps, r.engine_steps) for r in report.forecast.epochs] == rec.epoch_ends


def check_best_model(result):
    """After load_best_model_at_end the report still describes the training that happened."""
    report, state = result.callback.report, result.trainer.state
    loaded = report.loaded_checkpoint
    engine_now = result.engine.global_steps
    best_step = int(state.best_model_checkpoint.rsplit("-", 1)[1])
    if best_step < state.global_step:  # an earlier checkpoint was loaded: the engine went back
        assert engine_now < result.recording.engine_steps[-1]
        assert loaded is not None and loaded.folder == state.best_model_checkpoint
        assert (loaded.trainer_steps, loaded.engine_steps) == (best_step, engine_now)
    else:
        assert loaded is None and engine_now == result.recording.engine_steps[-1]


@needs_stack
@pytest.mark.integration
@pytest.mark.parametrize("case", [c for c in CASES], ids=case_id)
def test_a_run_built_as_users_build_it(tmp_path, case):
    if case["stack"] != STACK:
        pytest.skip(f"runs on the {case['stack']} stack")
    checkpoint = resume_point(tmp_path, case)
    options = arguments(case)
    if case["resume"] == "restore":
        options["restore_callback_states_from_checkpoint"] = True
    out = tmp_path / "run"
    result = run(out, case["policy"], resume_from_checkpoint=checkpoint, **options)
    check(result, case, out, resumed=checkpoint is not None)
    # The instance the user holds is the one in the Trainer, and holds the report.
    from stepsync import StepSyncCallback

    ours = [cb for cb in result.trainer.callback_handler.callbacks if isinstance(cb, StepSyncCallback)]
    assert ours == [result.callback]
    if case["resume"] == "without":
        _, trainer, engine = result.recording.checks[0]
        assert result.callback.report.inherited_drift == trainer - engine
    if case["best"]:
        check_best_model(result)
    if case["again"]:
        train_again(result, case, out)


def train_again(result, case, out):
    """A second trainer.train() on the same Trainer: checked like any run where upstream lets it run."""
    first_report = result.callback.report
    result.recording.__init__()
    try:
        result.trainer.train()
    except AttributeError as exc:
        # transformers + accelerate cannot train a DeepSpeed Trainer twice (engine wrapper gone), with or
        # without stepsync: test_a_second_train_fails_upstream_without_stepsync. stepsync saw the start only.
        assert "backward" in str(exc)
        report = result.callback.report
        assert first_report.finished and report is not first_report and not report.finished
        _, trainer, engine = result.recording.checks[0]
        if trainer != engine:  # the reused engine kept its count: said so, with what to do
            assert report.events[0].cause.name == "INHERITED" and "build a new Trainer" in report.events[0].remedy
        return
    check(result, case, out, resumed=False)


@needs_stack
@pytest.mark.integration
@on_pairwise_stacks
def test_a_second_train_fails_upstream_without_stepsync(tmp_path):
    first = run(tmp_path, None, epochs=1)
    assert first.error is None
    with pytest.raises(AttributeError, match="backward"):
        first.trainer.train()


@needs_stack
@pytest.mark.integration
@on_pairwise_stacks
def test_of_two_stepsync_callbacks_one_acts_and_the_other_says_why_once(tmp_path, caplog):
    """A library adds StepSyncCallback('warn'); the user adds StepSyncCallback('sync') too."""
    import logging

    from stepsync import StepSyncCallback
    from harness.runs import run_tiny

    library, user = StepSyncCallback("warn", console=False), StepSyncCallback("sync", console=False)
    with caplog.at_level(logging.INFO, logger="stepsync"):
        result = run_tiny(str(tmp_path), samples=N, gas=G, epochs=3, callback=user, extra_callbacks=[library],
                          save_strategy="steps", save_steps=4)
    messages = [r.getMessage() for r in caplog.records if r.name == "stepsync"]
    assert result.error is None
    assert sum("stays silent" in m for m in messages) == 1
    assert sum(m.startswith("stepsync: forecast:") for m in messages) == 1
    assert sum("Trainer counted" in m for m in messages) == 1
    assert library.report is user.report and user.report.policy.value == "sync"
    assert user.report.forecast_mismatches == [] and user.report.drift == 0
    assert [(r.trainer_steps, r.engine_steps) for r in user.report.epochs] == result.recording.epoch_ends
    from stepsync.core.record import load_record

    record = load_record(str(tmp_path / "checkpoint-4"))
    assert (record.policy, record.trainer_steps, record.engine_steps) == ("sync", 4, 4)


@needs_stack
@pytest.mark.integration
@pytest.mark.skipif(STACK not in ("drifting", "aligned"), reason="asserts transformers 5.x's plan (ceil)")
@pytest.mark.parametrize("policy", ["realign", "drop_last"])
def test_a_remedy_that_makes_fewer_updates_still_ends_like_a_normal_run(tmp_path, policy):
    """The Trainer's end of training (last save, last evaluation, a full progress bar) waits for max_steps."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import ProgressCallback

    bars = []

    class BarSpy(TrainerCallback):  # added after the Trainer's ProgressCallback: reads its bar after each update
        def on_step_end(self, args, state, control, **kwargs):
            progress = next(cb for cb in self.handler.callbacks if isinstance(cb, ProgressCallback))
            bars.append((progress.training_bar.n, progress.training_bar.total))

    def add_spy(trainer):
        spy = BarSpy()
        spy.handler = trainer.callback_handler
        trainer.add_callback(spy)

    result = run(tmp_path, policy, epochs=3, save_strategy="steps", save_steps=4, eval_strategy="steps",
                 eval_steps=4, eval_samples=2, disable_tqdm=False, on_trainer=add_spy)
    report, state = result.callback.report, result.trainer.state
    assert result.error is None
    expected = {"realign": 7 if DRIFTS else 9, "drop_last": 6}[policy]  # N=5, G=2, 3 epochs; planned 9
    assert (state.global_step, result.engine.global_steps, report.planned_steps) == (expected, expected, 9)
    assert report.missed_updates == 9 - expected
    assert bars[-1] == (expected, expected)  # the bar ends full
    assert (tmp_path / f"checkpoint-{expected}").is_dir()
    assert any("eval_loss" in r and r["step"] == expected for r in state.log_history)
    if expected < 9:
        assert state.max_steps == expected
        assert sum("max_steps is lowered to" in note for note in report.notes) == 1
    else:
        assert state.max_steps == 9


@needs_stack
@pytest.mark.integration
@on_pairwise_stacks
@pytest.mark.parametrize("policy, n, g, says", [
    ("sync", 5, 2, "does nothing here"), ("realign", 5, 2, "does nothing here"), ("drop_last", 6, 2, "drops nothing")])
def test_every_remedy_says_once_when_it_does_nothing(tmp_path, policy, n, g, says):
    from stepsync import StepSyncCallback
    from harness.runs import run_tiny

    callback = StepSyncCallback(policy, console=False)
    result = run_tiny(str(tmp_path), samples=n, gas=g, epochs=2, callback=callback)
    notes = [note for note in callback.report.notes if says in note]
    assert result.error is None
    if policy == "drop_last" or not DRIFTS:
        assert len(notes) == 1, callback.report.notes
    else:  # the drifting stack: sync and realign act
        assert notes == []


@needs_stack
@pytest.mark.integration
@pytest.mark.parametrize("policy", ["warn", "sync", "realign", "drop_last"])
def test_adopting_stepsync_on_a_resumed_job_keeps_saving(tmp_path, monkeypatch, policy):
    """The most common way to start: add StepSyncCallback to a job that resumes a checkpoint made without it.

    Runs on every stack (transformers >= 4.41 indexes each stateful callback's entry at every save)."""
    # transformers < 4.46 loads DeepSpeed checkpoints in a way torch 2.13's weights_only default refuses.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    first = run(tmp_path / "first", None, save_strategy="steps", save_steps=2)
    assert first.error is None
    resumed = run(tmp_path / "run", policy, save_strategy="steps", save_steps=2,
                  resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
    report, rec = resumed.callback.report, resumed.recording
    assert resumed.error is None, repr(resumed.error)
    assert report.active and report.finished
    _, trainer, engine = rec.checks[0]
    assert report.inherited_drift == trainer - engine
    assert (report.trainer_steps, report.engine_steps) == (resumed.trainer.state.global_step, rec.engine_steps[-1])
    saved = [name for name in os.listdir(tmp_path / "run") if name.startswith("checkpoint-")]
    assert saved and f"checkpoint-{resumed.trainer.state.global_step}" in saved


def test_the_callback_says_a_slow_op_build_before_train_builds_the_engine(tmp_path, caplog):
    """A DeepSpeed config with DeepSpeed's own AdamW: said at the Trainer's init, before train() builds the engine
    (and compiles the op); the Trainer is not trained here."""
    import logging

    from transformers import Trainer

    from stepsync import StepSyncCallback
    from stepsync.tools.tiny_run import TinyDataset, cpu_distributed_env, deepspeed_config, tiny_model, training_args

    cpu_distributed_env()
    config = deepspeed_config(0)
    config["optimizer"]["params"] = {k: v for k, v in config["optimizer"]["params"].items() if k != "torch_adam"}
    extensions = tmp_path / "no-ops-built"
    extensions.mkdir()
    previous = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions)
    try:
        with caplog.at_level(logging.WARNING, logger="stepsync"):
            Trainer(model=tiny_model(), args=training_args(str(tmp_path), 2, deepspeed=config),
                    train_dataset=TinyDataset(3), callbacks=[StepSyncCallback(console=False)])
    finally:
        if previous is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR")
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = previous
    said = [r.getMessage() for r in caplog.records if "will compile" in r.getMessage()]
    assert len(said) == 1 and "its fused_adam op for this config's \"AdamW\" optimizer" in said[0]
    assert '"torch_adam": true' in said[0]
