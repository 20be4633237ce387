"""Two ranks with torchrun, fp32, a non-finite loss on rank 1 only, on a DeepSpeed that applies it (0.18.4 on
every ZeRO stage): the NaN reaches every rank's weights through the gradients' reduction, and every rank names the
same update and stops at it under raise (ZeRO-3 agrees on its partitions through one all-reduce)."""
import os

import pytest

from harness.stack import needs_stack
from harness.paths import entry_script

pytestmark = [needs_stack, pytest.mark.integration, pytest.mark.twoproc]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from harness.nonfinite import deepspeed_skips

    if deepspeed_skips(2, bf16=False):
        pytest.skip("this DeepSpeed skips an fp32 update whose gradients are not finite on ZeRO 1-3 "
                    "(tests/multiprocess/test_skips_on_two_ranks.py covers the skip)")
    from harness.runs import two_ranks

    script = entry_script("nonfinite_ranks.py")
    return two_ranks(script, tmp_path_factory.mktemp("nonfinite"))[:2]


@pytest.mark.parametrize("case", ["warn-2", "warn-3"])
def test_every_rank_names_the_update_one_rank_made_non_finite(ranks, case):
    first, second = ranks[0][case], ranks[1][case]
    assert first == second  # the same counters, the same update named, on both ranks
    assert first["engine"] == [2, 0] and not first["weights_finite"]  # applied, not skipped: the truth
    assert first["non_finite"] == [1, 4, 2] and first["error"] is None and first["micro_batches"] == 4


def test_raise_stops_every_rank_at_the_same_update(ranks):
    first, second = ranks[0]["raise-3"], ranks[1]["raise-3"]
    assert first == second
    assert first["error"] == "NonFiniteUpdateError" and first["engine"] == [2, 0] and first["micro_batches"] == 3
