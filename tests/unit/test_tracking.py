"""The findings a tracker gets (stepsync/core/tracking.py) and how stepsync writes to trackers
(stepsync/engine/trackers.py): the table in docs/trackers.md is the code's, every metric the code logs is in it, each
finding's value is the report's, texts go once, alerts once per kind, and a tracker's fault never reaches the run.
The real trackers, read back with their own readers, are in tests/integration/test_trackers.py."""
import logging
import os
import re

import pytest

from stepsync.core.choices import Policy
from stepsync.core.errors import StepSyncConfigError
from stepsync.core.events import NonFiniteUpdate, RanksApart
from stepsync.core.forecast import RunPlan, forecast
from stepsync.core.frameworks import known_frameworks
from stepsync.core.report import SyncReport
from stepsync.core.tracking import FINDINGS, METRICS, finding_metrics, forecast_text, run_metrics, summary_text
from stepsync.core.versions import Stack, behaviour_of
from stepsync.engine.trackers import (AcceleratorTrackers, CallableTracker, MLflowRun, TensorBoardWriter, Tracker,
                                      Tracking, WandbRun, tracker_of, trackers_of)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def docs_table():
    with open(os.path.join(ROOT, "docs", "trackers.md")) as handle:
        rows = re.findall(r"^\| `(stepsync/[a-z_]+)` \| (.+) \| (.+) \|$", handle.read(), re.M)
    return [tuple(row) for row in rows]


def test_the_docs_table_is_the_code_s():
    assert docs_table() == [(m.name, m.means, m.moves) for m in METRICS]
    assert len({m.name for m in METRICS}) == len(METRICS)


def test_every_metric_the_code_names_is_in_the_table():
    named = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "stepsync")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as handle:
                    named |= set(re.findall(r'"(stepsync/[a-z_]+)"', handle.read()))
    texts = {"stepsync/forecast", "stepsync/summary"}
    assert named - texts == {m.name for m in METRICS}
    assert {key for framework in known_frameworks() for key in framework.metric_keys} <= {m.name for m in METRICS}


def report(**fields):
    return SyncReport(Policy.WARN, **fields)


def test_a_clean_report_adds_nothing_to_the_logs():
    assert finding_metrics(report()) == {}
    assert run_metrics(report(trainer_steps=4, engine_steps=3), 4) == {
        "stepsync/trainer_steps": 4, "stepsync/engine_steps": 3, "stepsync/drift": 1}


def test_each_finding_is_the_report_s_value():
    found = report(engine_skipped=2, lost_micro_batches=3, updates_unsynced=1, windows_dropped=4,
                   dropped_micro_batches={1: 1, 2: 1}, unapplied_micro_batches=1, weight_faults=["a"],
                   update_flaws=["b", "c"], corrections=5, clip_in_force=0.0, g_in_force=4,
                   non_finite=NonFiniteUpdate(1, 4, 2), ranks_apart=RanksApart(2, 1, 0, None, "train begin", 2))
    assert finding_metrics(found) == {
        "stepsync/updates_skipped": 2, "stepsync/micro_batches_lost": 3, "stepsync/updates_unsynced": 1,
        "stepsync/windows_dropped": 4, "stepsync/micro_batches_dropped": 2, "stepsync/micro_batches_unapplied": 1,
        "stepsync/update_flaws": 3, "stepsync/corrections": 5, "stepsync/non_finite_at_update": 2,
        "stepsync/ranks_apart_at_update": 0, "stepsync/gradient_clipping": 0.0,
        "stepsync/gradient_accumulation_steps": 4}
    assert set(finding_metrics(found)) <= {m.name for m in FINDINGS}


ALONE = [("engine_skipped", 1, "stepsync/updates_skipped"), ("lost_micro_batches", 2, "stepsync/micro_batches_lost"),
         ("updates_unsynced", 1, "stepsync/updates_unsynced"), ("windows_dropped", 1, "stepsync/windows_dropped"),
         ("dropped_micro_batches", {1: 3}, "stepsync/micro_batches_dropped"),
         ("unapplied_micro_batches", 1, "stepsync/micro_batches_unapplied"),
         ("weight_faults", ["a"], "stepsync/update_flaws"), ("update_flaws", ["a"], "stepsync/update_flaws"),
         ("corrections", 1, "stepsync/corrections"), ("non_finite", NonFiniteUpdate(1, 2, 3),
                                                      "stepsync/non_finite_at_update"),
         ("ranks_apart", RanksApart(1, 0, 0, None, "train begin", 2), "stepsync/ranks_apart_at_update"),
         ("clip_in_force", 0.0, "stepsync/gradient_clipping"),
         ("g_in_force", 2, "stepsync/gradient_accumulation_steps")]


@pytest.mark.parametrize("field, value, metric", ALONE)
def test_each_finding_alone_is_logged(field, value, metric):
    """finding_metrics answers a report without findings before building anything: each finding alone passes."""
    assert metric in finding_metrics(report(**{field: value}))


def test_the_forecast_as_text_has_each_epoch_and_the_verdict():
    predicted = forecast(RunPlan(7, 2, 2), behaviour_of(Stack("5.24.0", "1.7.0", "0.19.8")))  # the drifting stack
    text = forecast_text(predicted).splitlines()
    assert text[0] == "stepsync forecast: N=7 micro-batches/epoch, G=2, policy 'warn'"
    assert text[1].split() == ["epoch", "Trainer", "steps", "engine", "steps", "drift"]
    assert [row.split() for row in text[2:4]] == [["1", "4", "3", "+1"], ["2", "8", "7", "+1"]]
    assert text[4] == predicted.verdict()


def test_the_summary_as_text_is_the_report_s_own():
    done = report(trainer_steps=8, engine_steps=7)
    assert summary_text(done) == str(done)


class Recorded(Tracker):
    def __init__(self, fails=False):
        self.calls, self.fails = [], fails

    def metrics(self, values, step):
        self.calls.append(("metrics", dict(values), step))

    def text(self, name, text, step):
        if self.fails:
            raise OSError("disk full")
        self.calls.append(("text", name, text, step))

    def alert(self, title, text):
        self.calls.append(("alert", title, text))


def test_texts_go_once_and_alerts_once_per_kind_under_64_characters():
    kept = Recorded()
    tracking = Tracking([kept])
    tracking.text("stepsync/forecast", "a", 0)
    tracking.text("stepsync/forecast", "again", 3)
    tracking.alert("drift (partial window at an epoch end)", "words")
    tracking.alert("drift (partial window at an epoch end)", "words again")
    long = "x" * 80
    tracking.alert(long, "long words")
    assert kept.calls == [("text", "stepsync/forecast", "a", 0),
                          ("alert", "stepsync: drift (partial window at an epoch end)", "words"),
                          ("alert", "stepsync: " + "x" * 50 + "...", "long words")]
    assert all(len(call[1]) < 64 for call in kept.calls if call[0] == "alert")


def test_a_failing_tracker_is_dropped_with_one_warning_and_the_others_go_on(caplog):
    failing, kept = Recorded(fails=True), Recorded()
    tracking = Tracking([failing, kept])
    with caplog.at_level(logging.WARNING, logger="stepsync"):
        tracking.text("stepsync/forecast", "a", 0)
        tracking.text("stepsync/summary", "b", 4)
    assert tracking.trackers == [kept]
    assert [call[1] for call in kept.calls] == ["stepsync/forecast", "stepsync/summary"]
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1 and "stopped sending stepsync's stepsync/forecast to Recorded" in said[0]


class Writer:  # the calls of torch.utils.tensorboard.SummaryWriter that stepsync makes
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, step):
        self.calls.append(("scalar", tag, value, step))

    def add_text(self, tag, text, step):
        self.calls.append(("text", tag, text, step))

    def flush(self):
        self.calls.append(("flush",))


def test_tensorboard_gets_scalars_and_a_text_that_keeps_its_columns():
    writer = Writer()
    tracker = tracker_of(writer)
    assert isinstance(tracker, TensorBoardWriter)
    tracker.metrics({"stepsync/drift": 1}, 4)
    tracker.text("stepsync/summary", "a  b\nc  d", 4)
    assert writer.calls == [("scalar", "stepsync/drift", 1, 4), ("text", "stepsync/summary", "    a  b\n    c  d", 4),
                            ("flush",)]


def test_each_tracker_is_known_by_its_own_calls():
    class Mlflow:  # the module's calls
        def active_run(self): ...
        def log_metrics(self, metrics, step=None): ...
        def log_text(self, text, artifact_file): ...

    class Client:  # MlflowClient's
        def log_metric(self, run_id, key, value, step=None): ...
        def log_text(self, run_id, text, artifact_file): ...

    class Run:  # a wandb run's
        summary: dict = {}
        def log(self, data): ...
        def alert(self, title, text, level=None): ...

    class Accelerator:
        trackers: list = []
        def log(self, values, step=None): ...
        def init_trackers(self, name): ...

    assert isinstance(tracker_of(Mlflow()), MLflowRun) and tracker_of(Mlflow()).run_id is None
    assert tracker_of((Client(), "run-1")).run_id == "run-1"
    assert isinstance(tracker_of(Run()), WandbRun)
    assert isinstance(tracker_of(Accelerator()), AcceleratorTrackers)
    assert isinstance(tracker_of(print), CallableTracker)
    assert [type(t) for t in trackers_of([Writer(), Run()])] == [TensorBoardWriter, WandbRun]
    assert trackers_of(None) == []
    with pytest.raises(StepSyncConfigError, match=r"an MLflow client needs its run: pass \(client, run_id\)"):
        tracker_of(Client())
    with pytest.raises(StepSyncConfigError, match="stepsync takes a torch.utils.tensorboard SummaryWriter"):
        tracker_of(42)


def test_mlflow_without_an_active_run_gets_nothing_rather_than_a_run_of_its_own():
    class Mlflow:  # the module's calls, its run ended
        calls = []

        def active_run(self):
            return None

        def log_metrics(self, metrics, step=None):
            self.calls.append("metrics")

        def log_text(self, text, artifact_file):
            self.calls.append("text")

    module = Mlflow()
    tracker = tracker_of(module)
    tracker.metrics({"stepsync/drift": 1}, 4)
    tracker.text("stepsync/summary", "done", 4)
    assert module.calls == []


def test_a_callable_gets_metrics_and_texts_by_name():
    got = []
    tracker = tracker_of(lambda values, step: got.append((values, step)))
    tracker.metrics({"stepsync/drift": 1}, 4)
    tracker.text("stepsync/summary", "done", 8)
    assert got == [({"stepsync/drift": 1}, 4), ({"stepsync/summary": "done"}, 8)]


def test_a_text_said_before_the_framework_opens_its_tracker_waits_for_it():
    class Accelerator:
        def __init__(self):
            self.trackers = []

        def log(self, values, step=None): ...
        def init_trackers(self, name): ...

    class TensorBoardTracker:
        name = "tensorboard"

        def __init__(self):
            self.writer = Writer()

    accelerator = Accelerator()
    tracker = tracker_of(accelerator)
    tracker.text("stepsync/forecast", "f", 0)
    tracker.catch_up()
    opened = TensorBoardTracker()
    accelerator.trackers.append(opened)
    tracker.catch_up()
    tracker.catch_up()
    assert opened.writer.calls == [("text", "stepsync/forecast", "    f", 0), ("flush",)]


def test_an_accelerate_loop_handed_a_tracker_is_told_where_its_findings_go():
    import stepsync

    class Accelerator:  # neither an engine nor a sharded or replicated model
        trackers: list = []

    with pytest.raises(StepSyncConfigError, match=r"an accelerate loop's findings go to the trackers its Accelerator "
                                                  r"initialised \(accelerator.init_trackers\); leave tracker= out"):
        stepsync.watch(Accelerator(), tracker=print)
