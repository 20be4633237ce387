"""What the watches do to a user's loop objects: wrapped methods given back exactly, lengths that may not exist,
and the policies an adapter refuses."""
import pytest

from stepsync.core.choices import Policy
from stepsync.core.errors import StepSyncConfigError
from stepsync.core.frameworks import ACCELERATE_LOOP, FABRIC_LOOP, FRAMEWORKS, LIGHTNING, TRAINER
from stepsync.engine.loop_objects import InstancePatches, length_of


class Loop:
    def backward(self):
        return "class"


def test_a_wrapped_method_is_taken_off_so_the_class_method_shows_through():
    loop, patches = Loop(), InstancePatches()
    patches.set(loop, "backward", lambda: "wrapped")
    assert loop.backward() == "wrapped"
    patches.restore()
    assert "backward" not in vars(loop) and loop.backward() == "class"


def test_another_wrapper_set_before_is_given_back_and_a_second_restore_changes_nothing():
    loop, patches = Loop(), InstancePatches()
    loop.backward = earlier = lambda: "earlier wrapper"
    patches.set(loop, "backward", lambda: "first")
    patches.set(loop, "backward", lambda: "second")
    patches.restore()
    assert vars(loop)["backward"] is earlier
    patches.restore()
    assert vars(loop)["backward"] is earlier


def test_a_length_is_read_only_where_there_is_one():
    assert [length_of([1, 2, 3]), length_of([]), length_of(None), length_of(iter([1]))] == [3, 0, None, None]


def test_a_refused_policy_raises_its_reason_and_others_parse():
    with pytest.raises(StepSyncConfigError, match="^policy 'realign' cannot change your loop's own counter: use "
                                                  "policy='sync', or keep policy 'warn' and adopt "
                                                  "watch.report.engine_steps$"):
        ACCELERATE_LOOP.parse_policy("realign")
    assert ACCELERATE_LOOP.parse_policy("Raise") is Policy.RAISE
    assert LIGHTNING.parse_policy("Drop-Last") is Policy.DROP_LAST
    with pytest.raises(StepSyncConfigError, match="use --policy sync or --policy drop_last$"):
        LIGHTNING.parse_policy("realign", as_flag=True)
    with pytest.raises(ValueError, match="Possible choices are"):
        FABRIC_LOOP.parse_policy("resync")


def test_every_framework_is_described_once_and_the_trainer_refuses_nothing():
    assert len({f.key for f in FRAMEWORKS}) == len(FRAMEWORKS) == 7
    assert TRAINER.refused == () and all(TRAINER.parse_policy(p) is p for p in Policy)
    for framework in FRAMEWORKS:  # a refusal always names what to use instead, and never a refused policy
        refused = {policy for policy in Policy if framework.refusal_of(policy) is not None}
        for refusal in framework.refused:
            assert refusal.instead and not set(refusal.instead) & refused, (framework.name, refusal.does)
            assert [policy for policy in Policy if refusal.refuses(policy)], refusal.does  # it refuses one
