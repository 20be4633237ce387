"""What the watches do to a user's loop objects: wrapped methods given back exactly, lengths that may not exist,
and the policies an adapter refuses."""
import pytest

from stepsync.core.choices import Policy
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
    refused = {Policy.REALIGN: "not here: use policy='sync'"}
    with pytest.raises(ValueError, match="^not here: use policy='sync'$"):
        Policy.parse("realign", refused=refused)
    assert Policy.parse("Drop-Last", refused=refused) is Policy.DROP_LAST
    with pytest.raises(ValueError, match="Possible choices are"):
        Policy.parse("resync", refused=refused)
