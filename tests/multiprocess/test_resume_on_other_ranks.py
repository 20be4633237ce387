"""Resumes on another number of ranks (torchrun on 127.0.0.1, gloo; ZeRO-0): what stepsync says the Trainer will
skip and train twice equals, epoch by epoch, what the samples each rank trained show (recorded by the Trainer's own
training_step); the fix it names trains every sample once; raise stops every rank before any micro-batch; a rank
left waiting fails the test instead of hanging CI."""
import json
import os
import subprocess
import sys

import pytest
from harness.runs import child_env, torchrun_phase
from harness.samples import said, skipped_and_repeated
from harness.stack import STACK, needs_stack
from harness.paths import entry_script

# The Trainer's resume arithmetic is transformers' alone: one 5.24 stack runs these (about 5 minutes of torchrun).
pytestmark = [needs_stack, pytest.mark.skipif(STACK not in ("", "drifting"), reason="run on the drifting stack")]
SCRIPT = entry_script("relayout_runs.py")


def launch(out, name, world, samples, gas, epochs, policy="warn", checkpoint=None, stage=0, universal=False,
           drop_last=False):
    """One phase on ``world`` ranks (``stage`` "none": without DeepSpeed); each rank's record."""
    out.mkdir(parents=True, exist_ok=True)
    args = [samples, gas, epochs, policy] + ([checkpoint] if checkpoint else [])
    return torchrun_phase(SCRIPT, out, name, world, args, STEPSYNC_ZERO_STAGE=str(stage),
                          STEPSYNC_LOAD_UNIVERSAL="1" if universal else "0", STEPSYNC_DROP_LAST="1" if drop_last else "0")


def truth(saved, resumed, checkpoint_step, samples, epochs, alongside=None):
    return skipped_and_repeated(saved, resumed, checkpoint_step, samples, epochs, alongside)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("relayout")
    return out, {"one": launch(out, "one", 1, 12, 4, 3), "two": launch(out, "two", 2, 10, 3, 3)}


@pytest.mark.parametrize("name, world, gas, base, samples, step, expected", [
    # 12 samples, G=4, saved on 1 rank; on 2 ranks an epoch is 2 updates, not 3.
    ("one-to-two-at-an-epoch-end", 2, 4, "one", 12, 6, ({3: 12}, {})),
    ("one-to-two-inside-an-epoch", 2, 4, "one", 12, 4, ({2: 8}, {})),
    # 10 samples, G=3, saved on 2 ranks; on 1 rank an epoch is 4 updates, not 2.
    ("two-to-one-at-an-epoch-end", 1, 3, "two", 10, 4, ({}, {2: 10})),
    ("two-to-one-inside-an-epoch", 1, 3, "two", 10, 3, ({}, {1: 1, 2: 6})),
    # Controls: the same layout, and the fix stepsync names (the global batch kept).
    ("one-to-one", 1, 4, "one", 12, 4, ({}, {})),
    ("two-to-two", 2, 3, "two", 10, 3, ({}, {})),
    ("one-to-two-with-the-fix", 2, 2, "one", 12, 4, ({}, {})),
    ("two-to-one-with-the-fix", 1, 6, "two", 10, 3, ({}, {})),
])
def test_what_stepsync_says_the_resume_does_is_what_it_trains(saved, name, world, gas, base, samples, step, expected):
    out, runs = saved
    resumed = launch(out, name, world, samples, gas, 3, checkpoint=str(out / base / f"checkpoint-{step}"))
    assert all(rank["error"] is None for rank in resumed)
    assert truth(runs[base], resumed, step, samples, 3) == expected
    assert all(said(rank) == expected for rank in resumed)  # every rank says the same, counted over all ranks
    if expected != ({}, {}):
        report = resumed[0]["report"]
        assert report["resume_shift"]["fixes"]
        totals = [sum(expected[0].values()), sum(expected[1].values())]
        assert resumed[0]["logged"] and all(logged == totals for logged in resumed[0]["logged"])


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """Datasets that do not divide among two ranks: accelerate completes the last round with the first samples of
    the epoch's order again, so a padded slot trains a sample twice, or one a skip passed over."""
    out = tmp_path_factory.mktemp("relayout-odd")
    return out, {"thirteen": launch(out, "thirteen", 1, 13, 4, 3), "eleven": launch(out, "eleven", 1, 11, 2, 3),
                 "thirteen-on-two": launch(out, "thirteen-on-two", 2, 13, 3, 3)}


@pytest.mark.parametrize("name, world, gas, base, samples, step, expected", [
    # 13 samples, 1 -> 2 ranks: 8 slots of epoch 2 skipped, one of them a copy of a sample the padding trains.
    ("thirteen-to-two", 2, 4, "thirteen", 13, 3, ({1: 1, 2: 7}, {})),
    # 11 samples, 1 -> 2 ranks: the padded slot trains again a sample trained before the save.
    ("eleven-to-two", 2, 2, "eleven", 11, 2, ({1: 4}, {1: 1})),
    # 13 samples saved on 2 ranks (padded), resumed on 1.
    ("thirteen-to-one", 1, 3, "thirteen-on-two", 13, 4, ({}, {1: 1, 2: 6})),
])
def test_a_dataset_the_ranks_do_not_divide_is_counted_by_sample(odd, name, world, gas, base, samples, step, expected):
    out, runs = odd
    resumed = launch(out, name, world, samples, gas, 3, checkpoint=str(out / base / f"checkpoint-{step}"))
    assert all(rank["error"] is None for rank in resumed)
    assert truth(runs[base], resumed, step, samples, 3) == expected
    assert all(said(rank) == expected for rank in resumed)


@pytest.fixture(scope="module")
def dropped(tmp_path_factory):
    """dataloader_drop_last on 13 samples: one rank trains all 13 of an epoch, two ranks 12 (the last round is
    incomplete, so dropped). Each whole run says which samples its layout trains in every epoch."""
    out = tmp_path_factory.mktemp("relayout-drop-last")
    return out, {"one": launch(out, "one", 1, 13, 4, 3, drop_last=True),
                 "two": launch(out, "two", 2, 13, 3, 3, drop_last=True)}


@pytest.mark.parametrize("name, world, gas, base, other, step, expected", [
    ("one-to-two", 2, 4, "one", "two", 3, ({2: 8}, {})),  # of the 12 samples both layouts train in an epoch
    ("two-to-one", 1, 3, "two", "one", 3, ({}, {1: 3, 2: 6})),
])
def test_a_dataloader_that_drops_its_tail_is_counted_over_what_both_layouts_train(dropped, name, world, gas, base,
                                                                                 other, step, expected):
    out, runs = dropped
    resumed = launch(out, name, world, 13, gas, 3, checkpoint=str(out / base / f"checkpoint-{step}"), drop_last=True)
    assert all(rank["error"] is None for rank in resumed)
    assert truth(runs[base], resumed, step, 13, 3, alongside=runs[other]) == expected
    assert all(said(rank) == expected for rank in resumed)


def test_a_fix_is_named_and_raise_stops_every_rank_before_any_micro_batch(saved):
    out, _ = saved
    stopped = launch(out, "raise", 2, 12, 4, 3, policy="raise", checkpoint=str(out / "one" / "checkpoint-4"))
    for rank in stopped:
        assert rank["error"] == "StepSyncConfigError" and rank["trained"] == []
        assert "resume with gradient_accumulation_steps=2" in rank["error_message"]


def stepsync_cli(*args):
    from harness.cli import stepsync_process

    return stepsync_process(*args, env=child_env())


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    """A ZeRO-2 run saved on one rank, and a universal copy of its checkpoint-4 made with DeepSpeed's own tool."""
    out = tmp_path_factory.mktemp("relayout-zero2")
    saved = launch(out, "z2", 1, 12, 4, 3, stage=2)
    copy = out / "z2" / "checkpoint-4"
    inspected = json.loads(stepsync_cli("inspect", str(copy), "--world-size", "2", "--quick", "--json").stdout)
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           "global_step4", "--output_folder", "global_step4_universal", "--inject_missing_state"],
                          cwd=copy, capture_output=True, text=True, timeout=600, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return out, saved, inspected


def test_inspect_foresees_deepspeeds_refusal_and_names_the_conversion(zero2):
    out, _, inspected = zero2
    before = inspected["resume_on"][0]
    folder = out / "z2" / "checkpoint-4" / "global_step4"
    assert not before["works"] and "partitioned over 1 rank(s)" in before["refused"]
    assert f"--input_folder {folder} --output_folder {folder}_universal --inject_missing_state" in before["refused"]
    after = json.loads(stepsync_cli("inspect", str(folder.parent), "--world-size", "2", "--gas", "2", "--quick",
                                    "--json").stdout)["resume_on"][0]
    assert after["works"] and after["refused"] is None and "load_universal" in after["notes"][0]


@pytest.mark.parametrize("gas, expected", [(4, ({2: 8}, {})), (2, ({}, {}))])
def test_a_universal_copy_of_zero2_resumes_on_two_ranks_with_the_data_said(zero2, gas, expected):
    out, saved, _ = zero2
    resumed = launch(out, f"z2-on-two-g{gas}", 2, 12, gas, 3, checkpoint=str(out / "z2" / "checkpoint-4"), stage=2,
                     universal=True)
    assert all(rank["error"] is None for rank in resumed)
    assert truth(saved, resumed, 4, 12, 3) == expected
    assert all(said(rank) == expected for rank in resumed)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """The same runs saved without stepsync: no record in any checkpoint."""
    out = tmp_path_factory.mktemp("relayout-bare")
    return out, {"one": launch(out, "one", 1, 12, 4, 3, policy="none"),
                 "two": launch(out, "two", 2, 10, 3, 3, policy="none")}


@pytest.mark.parametrize("name, world, gas, base, samples, step, expected", [
    ("one-to-two-at-an-epoch-end", 2, 4, "one", 12, 6, ({3: 12}, {})),
    ("two-to-one-inside-an-epoch", 1, 3, "two", 10, 3, ({}, {1: 1, 2: 6})),
    ("one-to-two-with-the-fix", 2, 2, "one", 12, 4, ({}, {})),  # G changed: read from the checkpoint, not assumed
])
def test_a_checkpoint_saved_without_stepsync_is_read_from_its_files(bare, name, world, gas, base, samples, step,
                                                                    expected):
    """No record: the saved layout comes from the checkpoint's files (rng_state files, trainer_state.json), and
    what stepsync says equals what every rank trained, as with a record."""
    out, runs = bare
    resumed = launch(out, name, world, samples, gas, 3, checkpoint=str(out / base / f"checkpoint-{step}"))
    assert all(rank["error"] is None for rank in resumed)
    assert truth(runs[base], resumed, step, samples, 3) == expected
    assert all(said(rank) == expected for rank in resumed)
    if expected != ({}, {}):
        shift = resumed[0]["report"]["resume_shift"]
        assert "rng_state files" in shift["read_from_files"] and "G from its max_steps and epoch" in \
            shift["read_from_files"]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """The same runs without DeepSpeed (DDP on gloo, or one process), saved with stepsync and without it."""
    out = tmp_path_factory.mktemp("relayout-ddp")
    return out, {policy: {"one": launch(out / policy, "one", 1, 12, 4, 3, policy=policy, stage="none"),
                          "two": launch(out / policy, "two", 2, 10, 3, 3, policy=policy, stage="none")}
                 for policy in ("warn", "none")}


def test_a_run_without_deepspeed_is_watched_and_says_its_updates(ddp):
    """The saving runs: every update the Trainer counted is an optimizer step, and the report says so."""
    _, runs = ddp
    for name, updates in (("one", 9), ("two", 6)):  # 3 epochs of ceil(12/4) and of ceil(5/3) updates
        for rank in runs["warn"][name]:
            report = rank["report"]
            assert (report["active"], report["updater"], report["trainer_steps"], report["engine_steps"]) == \
                (True, "optimizer", updates, updates)
            assert report["events"] == [] and report["notes"][0].startswith("no DeepSpeed:")


@pytest.mark.parametrize("saved_with", ["warn", "none"])
@pytest.mark.parametrize("name, world, gas, base, samples, step, expected", [
    ("one-to-two-at-an-epoch-end", 2, 4, "one", 12, 6, ({3: 12}, {})),
    ("two-to-one-inside-an-epoch", 1, 3, "two", 10, 3, ({}, {1: 1, 2: 6})),
    ("one-to-two-with-the-fix", 2, 2, "one", 12, 4, ({}, {})),
])
def test_a_resume_without_deepspeed_is_said_as_it_trains(ddp, saved_with, name, world, gas, base, samples, step,
                                                         expected):
    """DDP: what stepsync says the resume skips and trains twice equals what every rank trained, from the record
    stepsync saved and from the files of a checkpoint saved without it."""
    out, runs = ddp
    folder = out / saved_with
    resumed = launch(folder, f"{name}-resumed", world, samples, gas, 3,
                     checkpoint=str(folder / base / f"checkpoint-{step}"), stage="none")
    assert all(rank["error"] is None for rank in resumed)
    assert truth(runs[saved_with][base], resumed, step, samples, 3) == expected
    assert all(said(rank) == expected for rank in resumed)
    assert all(rank["report"]["updater"] == "optimizer" for rank in resumed)


def test_raise_stops_a_ddp_resume_on_every_rank_before_any_micro_batch(ddp):
    out, _ = ddp
    checkpoint = out / "none" / "one" / "checkpoint-4"  # saved without stepsync: read from its files
    stopped = launch(out / "none", "raise", 2, 12, 4, 3, policy="raise", checkpoint=str(checkpoint), stage="none")
    for rank in stopped:
        assert rank["error"] == "StepSyncConfigError" and rank["trained"] == []
        assert "resume with gradient_accumulation_steps=2" in rank["error_message"]


@pytest.mark.parametrize("base, step, world, gas, expected", [
    ("one", 6, 2, None, ({3: 12}, {})),
    ("two", 3, 1, None, ({}, {1: 1, 2: 6})),
    ("one", 4, 2, 2, ({}, {})),
])
def test_inspect_reads_a_checkpoint_saved_without_stepsync_as_the_callback_does(ddp, base, step, world, gas, expected):
    """`stepsync inspect --world-size W --examples N`: the layout read from the files, the same samples said as the
    resumes above trained."""
    out, _ = ddp
    folder = out / "none" / base / f"checkpoint-{step}"
    samples = 12 if base == "one" else 10
    args = ["inspect", str(folder), "--world-size", str(world), "--examples", str(samples), "--quick", "--json"]
    resume = json.loads(stepsync_cli(*args, *(["--gas", str(gas)] if gas else [])).stdout)["resume_on"][0]
    shift = resume["shift"]
    said_here = ({}, {}) if shift is None else ({int(k): v for k, v in shift["skipped"].items()},
                                                {int(k): v for k, v in shift["repeated"].items()})
    assert said_here == expected and resume["works"] == (expected == ({}, {}))
    if shift is not None:
        assert "rng_state files" in shift["read_from_files"]
    without = json.loads(stepsync_cli("inspect", str(folder), "--world-size", str(world), "--quick", "--json").stdout)
    assert "give --examples N" in without["resume_on"][0]["notes"][0]


def test_resume_settings_convert_a_partitioned_checkpoint_once_and_name_the_layout(zero2, tmp_path):
    """A ZeRO-2 checkpoint saved on 1 rank, for 2: refused with the conversion named, or converted when asked (by
    DeepSpeed's own ds_to_universal), with the G that keeps the global batch and lands."""
    import shutil

    import stepsync
    from stepsync.core.errors import StepSyncConfigError

    out, _, _ = zero2
    copy = tmp_path / "checkpoint-4"
    shutil.copytree(out / "z2" / "checkpoint-4", copy, ignore=shutil.ignore_patterns("*_universal"))
    with pytest.raises(StepSyncConfigError, match="ds_to_universal"):
        stepsync.resume_settings(str(copy), 2, 1, 4)
    settings = stepsync.resume_settings(str(copy), 2, 1, 4, convert=True)
    assert settings.load_universal and settings.training_arguments()["gradient_accumulation_steps"] == 2
    assert (copy / "global_step4_universal" / "stepsync_converted").is_file()
    again = stepsync.resume_settings(str(copy), 2, 1, 4, convert=True)  # converted once: found, not redone
    assert again.load_universal and not any("converted" in note for note in again.notes)
