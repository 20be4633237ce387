"""Faults injected into stepsync's view of a real engine (never into DeepSpeed itself): the run stays real."""
import logging


class FaultyEngine:
    """The real engine as stepsync sees it, with the pieces named in ``fail`` failing once ``broken`` is set:
    ``"raise"`` (reading it raises) or ``"missing"`` (it is not there at all)."""

    def __init__(self, engine, fail):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_fail", fail)
        object.__setattr__(self, "broken", False)

    def __getattr__(self, name):
        if self.broken and name in self._fail:
            raise RuntimeError(f"injected failure reading {name}")
        if name == "hidden" or name in self._fail and self._fail[name] == "missing":
            raise AttributeError(name)
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        if name == "broken":
            object.__setattr__(self, name, value)
        else:
            setattr(self._engine, name, value)


def stepsync_errors(caplog):
    """What stepsync logged at ERROR and above."""
    return [r for r in caplog.records if r.name == "stepsync" and r.levelno >= logging.ERROR]


def breaking_at(monkeypatch, module, finder, fail, breaks_at):
    """Let ``module.finder`` (how an adapter finds its engine) hand stepsync a FaultyEngine; returns the loop's
    ``before_micro_batch`` callback that breaks it before the (1-based) micro-batch ``breaks_at``."""
    seen = {}
    real_find = getattr(module, finder)

    def find(*args):
        seen["engine"] = FaultyEngine(real_find(*args), fail)
        return seen["engine"]

    def before_micro_batch(index):
        if index == breaks_at:
            seen["engine"].broken = True

    monkeypatch.setattr(module, finder, find)
    return before_micro_batch
