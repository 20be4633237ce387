"""stepsync.core.releases: each framework's release table read from its packages, and its own loop's facts laid on
it; stepsync.core.frameworks.register: a framework described outside stepsync, known wherever one is named."""
import pytest

from harness.cli import stepsync
from stepsync.core import frameworks
from stepsync.core.frameworks import (
    ACCELERATE_LOOP,
    DEEPSPEED_LOOP,
    FABRIC_LOOP,
    FRAMEWORKS,
    LIGHTNING,
    TRAINER,
    BackwardCall,
    EngineBoundary,
    Framework,
    PlannedSteps,
    TrainerRule,
    framework_called,
    known_frameworks,
    register,
)
from stepsync.core.lightning_versions import LightningStack, lightning_behaviour_of
from stepsync.core.releases import behaviour_at, installed_versions
from stepsync.core.versions import Stack, behaviour_of


def test_each_framework_reads_its_own_release_table():
    versions = {"transformers": "4.45.2", "accelerate": "1.7.0", "deepspeed": "0.16.2", "lightning": "2.4.0"}
    assert behaviour_at(TRAINER, versions) == behaviour_of(Stack("4.45.2", "1.7.0", "0.16.2"))
    assert behaviour_at(LIGHTNING, versions) == lightning_behaviour_of(LightningStack("2.4.0", "0.16.2"))
    fabric = behaviour_at(FABRIC_LOOP, versions)
    assert (fabric.stack, fabric.engine_boundary, fabric.trainer_rule) == (
        LightningStack("2.4.0", "0.16.2"), EngineBoundary.NEVER_STEPPED, TrainerRule.WHOLE_WINDOWS)


def test_a_loop_is_not_read_by_the_trainers_releases():
    """An accelerate loop on transformers 4.24 (whose Trainer stepped the engine itself): the engine's boundary is
    accelerate's, and no word of transformers, which the loop does not run."""
    loop = behaviour_at(ACCELERATE_LOOP, {"transformers": "4.24.0", "accelerate": "0.15.0", "deepspeed": "0.14.5"})
    assert loop.engine_boundary is EngineBoundary.MICRO_COUNTER
    assert loop.engine_reason.startswith("accelerate 0.15.0: ")
    assert not [caveat for caveat in loop.caveats if "transformers" in caveat]
    assert behaviour_at(TRAINER, {"transformers": "4.24.0"}).engine_reason.startswith("transformers 4.24.0: ")
    assert behaviour_at(DEEPSPEED_LOOP, {}).stack.deepspeed == "newest"


def test_installed_versions_read_a_package_under_the_name_it_was_also_published_as():
    found = installed_versions(("lightning", "deepspeed", "no-such-package"))
    assert set(found) == {"lightning", "deepspeed", "no-such-package"} and found["no-such-package"] is None


def test_backward_is_called_as_each_framework_calls_it():
    calls = []

    class Engine:
        def backward(self, loss, **kwargs):
            calls.append((loss, kwargs))

    class Loss:  # a torch-native loop's: loss.backward(), no engine
        def backward(self):
            calls.append(("loss.backward()", {}))

    for call in BackwardCall:
        call.backward(Engine(), 12.0 if call.through_an_engine else Loss(), 4)
    TRAINER.backward_call.backward(Engine(), 12.0, 4, items_counted=True)
    assert calls == [(12.0, {}), (12.0, {}), (3.0, {"scale_wrt_gas": False}), (3.0, {}),
                     ("loss.backward()", {}), ("loss.backward()", {}), (12.0, {"scale_wrt_gas": False})]


@pytest.fixture
def registry(monkeypatch):
    """The frameworks registered in one test are gone after it."""
    monkeypatch.setattr(frameworks, "_REGISTERED", [])


def test_a_registered_framework_is_known_wherever_one_is_named(registry):
    toy = Framework(name="the toy trainer", who="toy trainer", counter="toy global_step", whose_g="its", key="toy",
                    packages=("deepspeed",), counts_by=TrainerRule.EPOCH_END, plans_by=PlannedSteps.CEIL,
                    engine_stepped=EngineBoundary.MICRO_COUNTER)
    refused = stepsync("check", "--framework", "toy", "--micro-batches-per-epoch", "7")
    assert refused.returncode == 2 and "invalid choice: 'toy'" in refused.stderr
    assert register(toy) is toy and register(toy) is toy
    assert known_frameworks() == (*FRAMEWORKS, toy) and framework_called("toy") is toy
    with pytest.raises(ValueError, match=r"^a framework is already known as 'trainer' \(the Trainer\): give the toy "
                                         r"trainer another key$"):
        register(Framework(name="the toy trainer", who="", counter="", whose_g="", key="trainer"))
    proc = stepsync("check", "--framework", "toy", "--micro-batches-per-epoch", "7", "--gas", "3", "--epochs", "2")
    assert proc.returncode == 1 and "the toy trainer counts 6 updates" in proc.stdout
