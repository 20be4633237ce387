"""Two ranks with torchrun, bf16, a non-finite loss on one rank only: DeepSpeed skips the update on both, and
every rank reports the same skip and stops at the same update under raise."""
import os

import pytest
from packaging.version import Version

from harness.stack import needs_stack
from harness.paths import entry_script

pytestmark = [needs_stack, pytest.mark.integration, pytest.mark.twoproc]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from importlib.metadata import version

    if Version(version("deepspeed")) < Version("0.19.3"):
        pytest.skip("this DeepSpeed does not check bf16 gradients for overflow on ZeRO 1-3")
    from harness.runs import two_ranks

    script = entry_script("skip_ranks.py")
    return two_ranks(script, tmp_path_factory.mktemp("skips"))[:2]


@pytest.mark.parametrize("case", ["warn-0", "warn-2"])
def test_every_rank_reports_the_skip_that_one_rank_caused(ranks, case):
    first, second = ranks[0][case], ranks[1][case]
    assert first == second  # the same counters, the same skip, on both ranks
    assert first["engine"] == [2, 1] and first["skipped"] == [[1, 4, 2]] and first["applied"] == 1
    assert first["error"] is None and first["micro_batches"] == 4


def test_raise_stops_every_rank_at_the_same_update(ranks):
    first, second = ranks[0]["raise-2"], ranks[1]["raise-2"]
    assert first == second
    assert first["error"] == "UpdateSkippedError" and first["engine"] == [2, 1] and first["micro_batches"] == 3
