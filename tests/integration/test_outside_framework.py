"""A sixth framework, written here and not in stepsync: a toy trainer whose loop drives DeepSpeed's engine itself
(``backward()`` and ``step()`` after every micro-batch, as DeepSpeed-Chat's loop does) and counts its own windows
per epoch, told to stepsync by one descriptor (:class:`~stepsync.core.frameworks.Framework`) and one callback built
on the watch skeleton (:class:`~stepsync.engine.watch.FrameworkWatch`). Without a line of stepsync changed it gets
the forecast, the checks at every micro-batch and epoch end, the report, the policies and ``stepsync check
--framework toy``; each is held against what the toy loop and the engine did, recorded by the loop itself (the
engine's count after every micro-batch, and each update's samples read from the weights)."""
from dataclasses import dataclass, field
from typing import Any, List

import pytest

from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]


def toy_framework():
    """The descriptor: who counts, how (its windows restart at each epoch; it plans ceil(N / G) per epoch), how the
    engine updates under it (its own counter), and the policies it cannot have."""
    from stepsync.core.choices import Policy
    from stepsync.core.frameworks import EngineBoundary, Framework, PlannedSteps, Refusal, TrainerRule

    return Framework(
        name="the toy trainer", who="toy trainer", counter="toy global_step", whose_g="the DeepSpeed config's",
        key="toy", counts_by=TrainerRule.EPOCH_END, plans_by=PlannedSteps.CEIL,
        engine_stepped=EngineBoundary.MICRO_COUNTER,
        engine_reason="the toy trainer calls engine.step() after every micro-batch: the engine updates at every G-th "
                      "by its own counter",
        remedy="use ToyCallback(policy='sync')", packages=("deepspeed",),
        refused=(Refusal("follows_the_engine", "cannot set the toy trainer's count", (Policy.SYNC,)),
                 Refusal("ends_epochs_early", "cannot end the toy trainer's epochs early", (Policy.SYNC,))))


TOY = toy_framework()


def toy_callback_class():
    """The adapter: the skeleton gives it the policy's parsing, the report, the installed releases and the run; it
    adds only where the toy trainer's hooks are and what they tell the run."""
    from stepsync.core.plan import RunPlan
    from stepsync.engine.faults import guarded
    from stepsync.engine.lifecycle import RunStart, close_run
    from stepsync.engine.policies import loop_action_for
    from stepsync.engine.watch import FrameworkWatch

    class ToyCallback(FrameworkWatch):
        framework = TOY

        def __init__(self, policy: str = "warn") -> None:
            self._watch(policy, console=False)

        @guarded(steering=True, needs_run=False)
        def on_train_begin(self, trainer) -> None:
            behaviour = self._installed()
            if behaviour is None:
                return
            n, g = len(trainer.rows), trainer.engine.gradient_accumulation_steps()
            self._open(RunStart(TOY, self.policy, trainer.engine, behaviour, n, g, self.output,
                                plan=RunPlan(n, g, trainer.epochs), action=loop_action_for(self.policy)))

        @guarded(steering=True)
        def on_epoch_begin(self, run, trainer) -> None:
            run.begin_epoch()

        @guarded(steering=True)
        def on_micro_batch_begin(self, run, trainer, ends_window: bool) -> None:
            run.before_micro_batch(ends_window)

        @guarded(steering=True)
        def on_micro_batch_end(self, run, trainer, updated: bool) -> None:
            run.after_micro_batch(updated, trainer.global_step)

        @guarded(steering=True)
        def on_epoch_end(self, run, trainer) -> None:
            run.end_epoch(trainer.global_step)

        @guarded(steering=True, needs_run=False)
        def on_train_end(self, trainer) -> None:
            close_run(self.report, self._run, trainer.global_step)

    return ToyCallback


@dataclass
class ToyTrainer:
    """The toy framework: one weight per sample, each micro-batch one sample's one-hot row, plain SGD at lr 1, so each
    update's samples are read from the weights. Its window closes at every G-th micro-batch of an epoch and at the
    epoch's end; it records the engine's count after every micro-batch and at each epoch's end."""

    samples: int
    gas: int
    epochs: int
    callbacks: List[Any] = field(default_factory=list)
    global_step: int = 0
    engine_steps: List[int] = field(default_factory=list)
    epoch_ends: List[int] = field(default_factory=list)
    updates: List[List[int]] = field(default_factory=list)
    error: Any = None

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def fit(self) -> "ToyTrainer":
        from stepsync.core.errors import StepSyncError
        from stepsync.tools.tiny_run import cpu_distributed_env

        cpu_distributed_env()
        import deepspeed
        import torch

        model = torch.nn.Linear(self.samples, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": self.gas,
                  "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True}
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                               config=config)
        self.rows = torch.eye(self.samples)
        last = self.engine.module.weight.detach().clone().flatten()
        try:
            self._call("on_train_begin")
            for _ in range(self.epochs):
                self._call("on_epoch_begin")
                for step in range(self.samples):
                    ends = (step + 1) % self.gas == 0 or step + 1 == self.samples
                    self._call("on_micro_batch_begin", ends)
                    self.engine.backward(self.engine(self.rows[step:step + 1]).sum())
                    self.engine.step()
                    self.global_step += int(ends)
                    self.engine_steps.append(self.engine.global_steps)
                    now = self.engine.module.weight.detach().clone().flatten()
                    if not torch.equal(now, last):
                        self.updates.append([i for i, moved in enumerate((now - last).tolist()) if abs(moved) > 1e-9])
                    last = now
                    self._call("on_micro_batch_end", ends)
                self.epoch_ends.append(self.engine.global_steps)
                self._call("on_epoch_end")
        except StepSyncError as exc:
            self.error = exc
        self._call("on_train_end")
        self.engine.destroy()
        return self


def test_a_framework_written_outside_stepsync_gets_the_forecast_the_checks_and_the_report():
    """7 micro-batches per epoch, G=3, 2 epochs: the toy trainer counts windows of 3, 3, 1 per epoch (6 updates);
    the engine makes 4, its windows across the epoch's end, and leaves 2 micro-batches unapplied."""
    from stepsync.core.events import Cause

    callback = toy_callback_class()()
    toy = ToyTrainer(7, 3, 2, [callback]).fit()
    plain = ToyTrainer(7, 3, 2).fit()
    report = callback.report
    assert report.framework is TOY and report.active and report.finished
    assert (toy.engine_steps, toy.updates) == (plain.engine_steps, plain.updates)  # warn changes nothing
    assert plain.updates == [[0, 1, 2], [3, 4, 5], [0, 1, 6], [2, 3, 4]]
    assert (report.trainer_steps, report.engine_steps) == (toy.global_step, plain.engine_steps[-1]) == (6, 4)
    assert [(e.epoch, e.micro_batch, e.drift, e.cause, e.changes, e.last) for e in report.events] == [
        (1, 7, 1, Cause.PARTIAL_WINDOW, 2, (2, 7, 6, 4))]
    assert [(row.trainer_steps, row.engine_steps) for row in report.epochs] == [(3, 2), (6, 4)]
    assert [row.engine_steps for row in report.forecast.epochs] == plain.epoch_ends
    assert report.forecast_mismatches == []
    assert report.unapplied_micro_batches == 14 - 3 * len(plain.updates) == 2
    text = str(report)
    assert "toy trainer" in text and "use ToyCallback(policy='sync')" in text


def test_its_policies_act_through_the_skeleton():
    """raise stops before the first micro-batch, where the forecast already shows the drift; sync makes the engine
    update at the toy trainer's own windows; a policy its descriptor refuses is refused naming what to use."""
    from stepsync.core.errors import StepDriftError

    ToyCallback = toy_callback_class()
    stopped = ToyTrainer(7, 3, 2, [ToyCallback("raise")]).fit()
    assert isinstance(stopped.error, StepDriftError) and stopped.engine_steps == [] and stopped.updates == []
    assert str(stopped.error).startswith("the forecast: affected: the toy trainer counts 6 updates, the engine makes 4")
    synced = ToyTrainer(7, 3, 2, [ToyCallback("sync")]).fit()
    report = synced.callbacks[0].report
    assert synced.updates == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2], [3, 4, 5], [6]]
    assert synced.epoch_ends == [3, 6] and (report.trainer_steps, report.engine_steps, report.drift) == (6, 6, 0)
    assert report.events == [] and report.forecast_mismatches == []
    with pytest.raises(ValueError, match=r"policy 'realign' cannot set the toy trainer's count: use policy='sync'"):
        ToyCallback("realign")


def test_check_forecasts_it_once_registered(monkeypatch):
    """``stepsync check --framework toy`` forecasts what the toy trainer and the engine did, before any training;
    an unregistered key is refused naming the known ones."""
    import json

    from harness.cli import stepsync
    from stepsync.core import frameworks
    from stepsync.core.frameworks import register

    monkeypatch.setattr(frameworks, "_REGISTERED", [])  # known to this test only
    assert stepsync("check", "--framework", "toy", "--micro-batches-per-epoch", "7").returncode == 2
    register(TOY)
    assert register(TOY) is TOY  # again: nothing changes
    with pytest.raises(ValueError, match="already known as 'toy'"):
        register(toy_framework())
    run = ToyTrainer(7, 3, 2).fit()
    proc = stepsync("check", "--framework", "toy", "--micro-batches-per-epoch", "7", "--gas", "3", "--epochs", "2",
                    "--json")
    forecast = json.loads(proc.stdout)
    assert proc.returncode == 1
    assert [epoch["engine_steps"] for epoch in forecast["epochs"]] == run.epoch_ends
    assert forecast["trainer_steps"] == forecast["planned_steps"] == run.global_step == 6
    assert forecast["engine_steps"] == len(run.updates) == 4
    assert forecast["unapplied_micro_batches"] == 2
