"""The weight faults' rows against the stored probes (stepsync/core/weight_probes.json, made by `stepsync verify`'s
measurement on every release listed): each row predicts exactly the micro-batches every probe found wrong, and
nothing where a probe found the update right."""
import pytest
from hypothesis import given, strategies as st

from stepsync.core.weights import FAULTS, Accumulation, probes, weight_faults

ROWS = [row for row in probes() if "cannot_run" not in row]


def setting(row):
    """A probe's configuration, as weight_faults() takes it after the DeepSpeed release."""
    return (row["stage"], row["offload"] != "none", row["precision"], row["g"], row.get("call", "engine"),
            row.get("outputs", "loss") == "loss+logits", row.get("accelerate"), row.get("world_size", 1),
            Accumulation(row.get("grad_accum_dtype") == "fp32", row.get("immediate_grad_update", False)))


def predicted(row):
    wrong = set()
    for fault in weight_faults(row["deepspeed"], *setting(row)):
        wrong |= set(fault.wrong_micro_batches(row["g"]))
    return sorted(wrong)


def test_the_probes_cover_every_release_the_rows_name():
    measured = {row["deepspeed"] for row in ROWS}
    for fault in FAULTS:
        assert {fault.first_measured, fault.last_measured, fault.fixed_in} <= measured
        assert fault.right_before is None or fault.right_before in measured
    assert len(ROWS) >= 300


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['deepspeed']}-z{r['stage']}-{r['offload']}-"
                                                     f"{r['precision']}-g{r['g']}-{r.get('call', 'engine')}-"
                                                     f"{r.get('outputs', 'loss')}")
def test_every_probe_is_what_the_rows_predict(row):
    assert predicted(row) == row["wrong"]


def others_show(fault, row):
    """Another fault shows on this probe's configuration (it would make the window wrong on its own)."""
    return any(other.shows(row["deepspeed"], *setting(row)) for other in FAULTS if other is not fault)


def test_each_fault_is_bounded_by_a_probe_that_trains_right():
    for fault in FAULTS:
        for release in filter(None, (fault.right_before, fault.fixed_in)):
            same = [r for r in ROWS if r["deepspeed"] == release and fault.shows(fault.first_measured, *setting(r))
                    and not others_show(fault, r)]
            assert same and all(r["wrong"] == [] for r in same)


@given(g=st.integers(1, 64))
def test_the_wrong_micro_batches_of_a_window_against_a_brute_force_window(g):
    """Each fault's rule, against the window written out micro-batch by micro-batch."""
    for fault in FAULTS:
        kept = {"offload-keeps-first-and-last": lambda k: k in (1, g),
                "zero2-keeps-the-last": lambda k: k == g,
                "bf16-zero0-divided": lambda k: False, "trainer-loss-divided-again": lambda k: False,
                "outputs-divided-again": lambda k: False, "trainer-outputs-divided-again": lambda k: False,
                "accelerate-no-sync-undivided": lambda k: k == g,
                "bf16-optimizer-last-unaveraged": lambda k: k < g,
                "bf16-zero1-fp32-accumulation-divided": lambda k: False}[fault.name]
        assert fault.wrong_micro_batches(g) == [k for k in range(1, g + 1) if not kept(k)]


def test_the_message_names_the_micro_batches_the_fix_and_the_way_round():
    fault = weight_faults("0.18.4", 2, True, "fp32", 4)[0]
    text = fault.message("0.18.4", 4)
    assert "micro-batch(es) [2, 3] of every window of 4" in text and "0.19.0" in text and "ZeRO-1 or ZeRO-3" in text
    assert weight_faults("0.19.0", 2, True, "fp32", 4) == [] and weight_faults("0.18.4", 2, True, "fp32", 2) == []


def test_the_output_faults_need_the_logits_and_the_call_that_shows_them():
    assert [f.name for f in weight_faults("0.18.4", 0, False, "fp32", 2, "engine", True)] == ["outputs-divided-again"]
    assert weight_faults("0.18.4", 0, False, "fp32", 2, "engine", False) == []
    assert weight_faults("0.18.4", 0, False, "fp32", 2, "trainer", True) == []  # scale_wrt_gas=False is honoured
    assert weight_faults("0.18.4", 3, False, "fp32", 2, "engine", True) == []  # ZeRO-3 wraps the outputs
    assert weight_faults("0.19.6", 0, False, "fp32", 2, "engine", True) == []
    assert [f.name for f in weight_faults("0.18.3", 3, False, "fp32", 2, "trainer", True)] == [
        "trainer-loss-divided-again"]
    assert {f.name for f in weight_faults("0.18.3", 1, False, "fp32", 2, "trainer", None)} == {
        "trainer-loss-divided-again", "trainer-outputs-divided-again"}
    assert all(f.repairable for f in weight_faults("0.18.3", 1, False, "fp32", 2, "trainer", True))


def test_the_no_sync_fault_needs_accelerate_1_8_to_1_12_and_two_ranks():
    def names(deepspeed, accelerate, world, stage=1, call="accelerate"):
        return [f.name for f in weight_faults(deepspeed, stage, False, "fp32", 3, call, False, accelerate, world)]

    assert names("0.18.2", "1.8.0", 2) == names("0.16.2", "1.12.0", 4) == ["accelerate-no-sync-undivided"]
    assert names("0.18.2", "1.8.0", 1) == names("0.18.2", "1.13.0", 2) == names("0.18.2", "1.7.0", 2) == []
    assert names("0.18.3", "1.8.0", 2) == names("0.15.4", "1.8.0", 2) == names("0.18.2", None, 2) == []
    assert names("0.18.2", "1.8.0", 2, call="engine") == names("0.18.2", "1.8.0", 2, call="trainer") == []
    assert weight_faults("0.18.2", 1, False, "fp32", 3, "accelerate", False, "1.8.0", 2)[0].wrong_micro_batches(3) \
        == [1, 2]


def test_several_backwards_per_step_by_release_is_what_the_probes_measured():
    """probes/raw_loop.json (K=4 backward() calls, then step(), the config's G=1, ZeRO 1 and 2): every release's
    rows agree with several_backwards."""
    import json
    import os

    from stepsync.core.weights import SeveralBackwards, several_backwards

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = json.load(open(os.path.join(root, "probes", "raw_loop.json")))
    seen = {"1.0, 1.0, 1.0, 1.0": SeveralBackwards.KEEPS_ALL, "0.0, 0.0, 0.0, 1.0": SeveralBackwards.REPLACES}
    checked = set()
    for row in rows:
        if row["mode"] != "plain" or row["stage"] not in (1, 2):
            continue
        found = (SeveralBackwards.FAILS if row.get("error", "").startswith("TypeError") else
                 seen[", ".join(str(abs(share)) for share in row["shares"])])
        assert several_backwards(row["deepspeed"]) is found, row
        checked.add(row["deepspeed"])
    assert len(checked) >= 11 and {"0.17.5", "0.17.6", "0.18.2", "0.18.3"} <= checked


def test_the_bf16_optimizer_faults_need_zero1_in_bf16_with_an_fp32_accumulation():
    fp32, immediate = Accumulation(fp32=True), Accumulation(fp32=True, immediate_update=True)

    def names(deepspeed, world=2, accumulation=fp32, stage=1, offload=False, precision="bf16", g=4, call="trainer"):
        return [f.name for f in weight_faults(deepspeed, stage, offload, precision, g, call, False, "1.16.0", world,
                                              accumulation)]

    assert names("0.18.5") == names("0.18.9", 8) == names("0.18.7", g=1) == ["bf16-optimizer-last-unaveraged"]
    assert names("0.18.9", world=1) == names("0.18.9", accumulation=immediate) == names("0.19.0") == []
    assert names("0.18.9", accumulation=Accumulation()) == names("0.18.9", stage=2) == []
    assert names("0.18.9", offload=True) == names("0.18.9", precision="fp32") == []  # DeepSpeed's ZeRO optimizer
    assert names("0.18.3", world=1, call="engine") == names("0.18.4", accumulation=immediate) == [
        "bf16-zero1-fp32-accumulation-divided"]
    assert names("0.18.2") == names("0.18.4", accumulation=Accumulation()) == []
    fault = weight_faults("0.18.9", 1, False, "bf16", 4, world_size=2, accumulation=fp32)[0]
    assert fault.wrong_micro_batches(4) == [4] and fault.wrong_micro_batches(1) == [1] and not fault.repairable


@pytest.mark.parametrize("config, found", [
    ({"data_types": {"grad_accum_dtype": "fp32"}}, Accumulation(True, False)),
    ({"data_types": {"grad_accum_dtype": "torch.float32"}, "bf16": {"immediate_grad_update": True}},
     Accumulation(True, True)),
    ({"data_types": {"grad_accum_dtype": "bf16"}, "bfloat16": {"immediate_grad_update": True}},
     Accumulation(False, True)),
    ({"data_types": "fp32", "bf16": {"immediate_grad_update": "true"}}, Accumulation()),  # not what DeepSpeed reads
    ({}, Accumulation()),
])
def test_the_accumulation_as_a_deepspeed_config_asks_it(config, found):
    assert Accumulation.from_config(config) == found
