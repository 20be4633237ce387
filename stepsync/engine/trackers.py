"""The trackers a run's findings reach: TensorBoard's ``SummaryWriter``, MLflow (the module, on its active run, or
``(MlflowClient, run_id)``), a W&B run, accelerate's ``Accelerator`` (each tracker it initialised), or a callable
``tracker(values, step)``. Each is reached through its own public calls and recognised by them: none is imported
here. A tracker that fails is dropped with one warning; it never ends the run."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..core.errors import StepSyncConfigError
from ..display.output import logger

ACCEPTED = ("a torch.utils.tensorboard SummaryWriter, the mlflow module (on its active run) or (MlflowClient, "
            "run_id), a wandb run, an accelerate Accelerator, a callable tracker(values, step), or a list of them")


class Tracker:
    """One tracker as stepsync writes to it: metrics at a step, a text once, an alert where it has them."""

    def metrics(self, values: Dict[str, float], step: int) -> None:
        raise NotImplementedError

    def text(self, name: str, text: str, step: int) -> None:
        """Where the tracker takes no text, the text stays in the report and the terminal."""

    def alert(self, title: str, text: str) -> None:
        """Where the tracker cannot alert, nothing."""

    def catch_up(self) -> None:
        """Send what was held until the tracker opened (where it opens after stepsync's start)."""


class TensorBoardWriter(Tracker):
    """A ``SummaryWriter``: scalars, and texts in its text plugin (as code, so that the columns hold)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def metrics(self, values: Dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def text(self, name: str, text: str, step: int) -> None:
        self.writer.add_text(name, "\n".join("    " + line for line in text.splitlines()), step)
        self.writer.flush()


class MLflowRun(Tracker):
    """MLflow: the ``mlflow`` module (its active run), or a client with the id of its run. Texts are artifacts
    ``stepsync/forecast.txt`` and ``stepsync/summary.txt``."""

    def __init__(self, client: Any, run_id: Optional[str] = None) -> None:
        self.client, self.run_id = client, run_id

    def _ended(self) -> bool:
        # the module would start a run of its own for a call made after the user's ended: none is made
        return self.run_id is None and self.client.active_run() is None

    def metrics(self, values: Dict[str, float], step: int) -> None:
        if self._ended():
            return
        if self.run_id is None:
            self.client.log_metrics(dict(values), step=step)
        else:
            for name, value in values.items():
                self.client.log_metric(self.run_id, name, value, step=step)

    def text(self, name: str, text: str, step: int) -> None:
        if self._ended():
            return
        if self.run_id is None:
            self.client.log_text(text, f"{name}.txt")
        else:
            self.client.log_text(self.run_id, text, f"{name}.txt")


class WandbRun(Tracker):
    """A W&B run: metrics in its history, texts in its summary, alerts through ``run.alert``."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def metrics(self, values: Dict[str, float], step: int) -> None:
        self.run.log(dict(values))  # W&B's own step: the framework's count is among the values

    def text(self, name: str, text: str, step: int) -> None:
        self.run.summary[name] = text

    def alert(self, title: str, text: str) -> None:
        self.run.alert(title=title, text=text, level="WARN")


class OpenedBy(Tracker):
    """The trackers a framework opened, read as they are used (it may open them after stepsync's start): texts and
    alerts through each one's own object; a text said before any is open waits for one (:meth:`catch_up`). The
    framework's own logging carries the metrics."""

    def __init__(self) -> None:
        self.pending: List[Tuple[str, str, int]] = []

    def opened(self) -> List[Tracker]:
        raise NotImplementedError

    def metrics(self, values: Dict[str, float], step: int) -> None:
        """The framework's own logging carries them."""

    def text(self, name: str, text: str, step: int) -> None:
        self.pending.append((name, text, step))
        self.catch_up()

    def catch_up(self) -> None:
        trackers = self.opened() if self.pending else []
        if trackers:
            pending, self.pending = self.pending, []
            for tracker in trackers:
                for name, text, step in pending:
                    tracker.text(name, text, step)

    def alert(self, title: str, text: str) -> None:
        for tracker in self.opened():
            tracker.alert(title, text)


class AcceleratorTrackers(OpenedBy):
    """Every tracker an ``Accelerator`` initialised (``init_trackers`` may come after stepsync's start); metrics,
    where they go from stepsync, through ``accelerator.log``."""

    def __init__(self, accelerator: Any) -> None:
        super().__init__()
        self.accelerator = accelerator

    def metrics(self, values: Dict[str, float], step: int) -> None:
        if getattr(self.accelerator, "trackers", None):
            self.accelerator.log(dict(values), step=step)

    def opened(self) -> List[Tracker]:
        found: List[Tracker] = []
        for tracker in getattr(self.accelerator, "trackers", None) or ():
            name = getattr(tracker, "name", "")
            if name == "tensorboard" and getattr(tracker, "writer", None) is not None:
                found.append(TensorBoardWriter(tracker.writer))
            elif name == "wandb" and getattr(tracker, "run", None) is not None:
                found.append(WandbRun(tracker.run))
            elif name == "mlflow":
                import mlflow  # the accelerator's MLflow tracker logs through the module, on its active run

                found.append(MLflowRun(mlflow))
        return found


class CallableTracker(Tracker):
    """``tracker(values, step)``: metrics as numbers; a text as ``{name: text}``."""

    def __init__(self, function: Callable[[Dict[str, Any], int], Any]) -> None:
        self.function = function

    def metrics(self, values: Dict[str, float], step: int) -> None:
        self.function(dict(values), step)

    def text(self, name: str, text: str, step: int) -> None:
        self.function({name: text}, step)


def tracker_of(given: Any) -> Tracker:
    """The adapter of one tracker the user handed stepsync, recognised by its own calls."""
    if isinstance(given, Tracker):
        return given
    if isinstance(given, tuple) and len(given) == 2 and hasattr(given[0], "log_metric") and isinstance(given[1], str):
        return MLflowRun(*given)
    if hasattr(given, "trackers") and hasattr(given, "log") and hasattr(given, "init_trackers"):
        return AcceleratorTrackers(given)
    if hasattr(given, "add_scalar") and hasattr(given, "add_text"):
        return TensorBoardWriter(given)
    if hasattr(given, "alert") and hasattr(given, "summary") and hasattr(given, "log"):
        return WandbRun(given)
    if hasattr(given, "log_metrics") and hasattr(given, "log_text") and hasattr(given, "active_run"):
        return MLflowRun(given)
    if hasattr(given, "log_metric") and hasattr(given, "log_text"):
        raise StepSyncConfigError(f"tracker={given!r}: an MLflow client needs its run: pass (client, run_id)")
    if callable(given):
        return CallableTracker(given)
    raise StepSyncConfigError(f"tracker={given!r}: stepsync takes {ACCEPTED}")


def trackers_of(given: Any) -> List[Tracker]:
    """The adapters of ``given``: None, one tracker, or a list or tuple of them."""
    if given is None:
        return []
    if isinstance(given, list) or (isinstance(given, tuple) and not (len(given) == 2 and isinstance(given[1], str))):
        return [tracker_of(each) for each in given]
    return [tracker_of(given)]


class Tracking:
    """The trackers of one run, as its voice and its adapter use them: each text sent once, each kind of finding
    alerted once, a failing tracker dropped with one warning.

    Attributes:
        sends_metrics: the run's metrics go to the trackers from here, at each finding, each epoch end and the end
            (a loop with no logging steps of its own); else the framework's own logs carry them.
        sends_last_metrics: they go from here once, at the end, after the framework's last log (Lightning logs
            only where it counts an update, and not after the last micro-batch).
    """

    __slots__ = ("trackers", "sent", "alerted", "sends_metrics", "sends_last_metrics")

    def __init__(self, trackers: Iterable[Tracker] = (), sends_metrics: bool = False) -> None:
        self.trackers = list(trackers)
        self.sent: set = set()
        self.alerted: set = set()
        self.sends_metrics = sends_metrics
        self.sends_last_metrics = sends_metrics

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, call: Callable[[Tracker], None], what: str) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # a tracker's fault ends its tracking, never the run
                self.trackers.remove(tracker)
                logger.warning("stopped sending stepsync's %s to %s: %r; the report and the terminal still have "
                               "them", what, type(tracker).__name__, exc)

    def metrics(self, values: Dict[str, float], step: int) -> None:
        self._each(lambda tracker: tracker.metrics(values, step), "metrics")

    def catch_up(self) -> None:
        if self.trackers:
            self._each(lambda tracker: tracker.catch_up(), "texts")

    def text(self, name: str, text: str, step: int) -> None:
        if name not in self.sent:
            self.sent.add(name)
            self._each(lambda tracker: tracker.text(name, text, step), name)

    def alert(self, kind: str, text: str) -> None:
        if kind not in self.alerted:
            self.alerted.add(kind)
            title = f"stepsync: {kind}"
            title = title if len(title) < 64 else title[:60] + "..."  # W&B takes titles under 64 characters
            self._each(lambda tracker: tracker.alert(title, text), "alert")
