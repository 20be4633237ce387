"""``stepsync verify`` on the real DeepSpeed of the stack: each micro-batch's weight in one window, solved from the
parameters, against the same window trained without DeepSpeed (plain torch, the loss averaged over the window);
what the engine did with a non-finite loss, against its own counters; exit codes through the real command line."""
import json
import subprocess
import sys

import pytest
from packaging.version import Version

from harness.nonfinite import deepspeed_skips
from harness.stack import needs_stack

pytestmark = [needs_stack, pytest.mark.integration]


def without_deepspeed(g):
    """Each micro-batch's share of the update of the same window in plain torch: the loss averaged over G."""
    import torch

    from stepsync.tools.verify import LOSS_SCALE

    w = torch.nn.Parameter(torch.zeros(g))
    optimizer = torch.optim.SGD([w], lr=1.0)
    for k in range(g):
        x = torch.zeros(g)
        x[k] = 1
        (LOSS_SCALE * (w * x).sum() / g).backward()
    optimizer.step()
    return [float(-v) / LOSS_SCALE for v in w.detach()]


def verify(tmp_path, config, g, *flags):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "stepsync", "verify", "--deepspeed", str(path), "--gas", str(g),
                           *flags], capture_output=True, text=True, timeout=300)
    return done


def offloaded(stage):
    return {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}


def deepspeed():
    from importlib.metadata import version

    return version("deepspeed")


def default_clip():
    """DeepSpeed's clip where the config sets none: 1.0 from 0.19.3, none before (as probed)."""
    from packaging.version import Version

    return 1.0 if Version(deepspeed()) >= Version("0.19.3") else 0.0


@pytest.mark.parametrize("stage, offload, g, framework", [
    (0, False, 2, "deepspeed"), (2, False, 3, "trainer"), (2, True, 3, "deepspeed"), (3, True, 2, "trainer"),
    (1, False, 2, "accelerate")])
def test_each_micro_batchs_weight_is_measured_against_the_run_without_deepspeed(tmp_path, stage, offload, g,
                                                                                framework):
    config = offloaded(stage) if offload else {"zero_optimization": {"stage": stage}}
    done = verify(tmp_path, config, g, "--json", "--framework", framework)
    verdict = json.loads(done.stdout)
    right = without_deepspeed(g)
    assert right == pytest.approx([1 / g] * g)
    from stepsync.core.weights import weight_faults

    wrong_any = set()
    for outputs, key in (("loss", "weights"), ("loss+logits", "weights_with_logits")):
        wrong = [k for k, (w, r) in enumerate(zip(verdict[key], right), 1) if abs(w - r) > 1e-4 * r]
        assert verdict["wrong_" + key.replace("weights", "micro_batches")] == wrong
        # what the rows say of this stack, for the framework's call and this output
        faults = weight_faults(deepspeed(), stage, offload, "fp32", g, "trainer" if framework == "trainer" else
                               "engine", outputs == "loss+logits")
        assert wrong == sorted({k for fault in faults for k in fault.wrong_micro_batches(g)})
        wrong_any |= set(wrong)
    assert verdict["right"] == (not wrong_any) and done.returncode == (0 if verdict["right"] else 1)
    # What the engine did with a non-finite loss, as its own counters and weights showed it.
    assert verdict["non_finite"] == ("skipped" if deepspeed_skips(stage, bf16=False) else "applied")
    assert verdict["clip"] == default_clip()  # the config sets none; read from the engine itself


def test_lightnings_call_weighs_each_micro_batch_1_over_g_squared(tmp_path):
    """Lightning's closure divides the loss by G and the engine divides it again: measured, and exit 1."""
    done = verify(tmp_path, {"zero_optimization": {"stage": 3}}, 2, "--json", "--framework", "lightning")
    verdict = json.loads(done.stdout)
    assert verdict["weights"] == pytest.approx([0.25, 0.25], rel=1e-4) and done.returncode == 1


def test_the_verdict_in_words_and_the_clip_in_force(tmp_path):
    from stepsync.core.weights import weight_faults

    done = verify(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}, 2, "--framework",
                  "trainer")
    right = not weight_faults(deepspeed(), 2, False, "fp32", 2, "trainer", None)
    assert done.returncode == (0 if right else 1), done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("DeepSpeed ") and "ZeRO-2, offload none, fp32, G=2" in lines[0]
    assert "backward called as the Trainer calls it" in lines[0] and "the model returns the loss with its logits:" \
        in lines
    assert ("every micro-batch weighs 1/G: the update is right" in done.stdout) == right
    assert "clip norm in force: 0.5" in done.stdout


@pytest.mark.parametrize("config, why", [
    ({"zero_optimization": {"stage": 7}}, "cannot train this config"),
    ([1, 2], "must hold a JSON object"),
])
def test_a_config_it_cannot_run_exits_2_with_why(tmp_path, config, why):
    done = verify(tmp_path, config, 2)
    assert done.returncode == 2 and why in done.stderr and "Traceback" not in done.stderr


def test_on_two_ranks_each_ranks_window_is_measured_against_the_run_without_deepspeed(tmp_path):
    """--world-size 2: rank r trains samples r*G .. r*G+G-1; each sample's share (times the ranks) against the same
    window of both ranks' samples in plain torch, the loss averaged over the window and the ranks."""
    from stepsync.core.weights import weight_faults

    g = 3
    done = verify(tmp_path, {"zero_optimization": {"stage": 1}}, g, "--world-size", "2", "--json")
    if Version("0.18.7") <= Version(deepspeed()) < Version("0.19.0"):  # all_gather_into_tensor over gloo, as probed
        assert done.returncode == 2 and "Output 0 of Split is a view" in done.stderr
        assert "upgrade DeepSpeed to 0.19.0 or later" in done.stderr and "Traceback" not in done.stderr
        return
    verdict = json.loads(done.stdout)
    truth = [share * 2 for share in without_deepspeed(2 * g)]  # plain torch averages over 2G: times the ranks
    assert verdict["world_size"] == 2 and len(verdict["weights"]) == 2 * g
    assert verdict["weights"] == pytest.approx(truth, rel=1e-4)
    assert verdict["non_finite"] in ("skipped", "applied", "moved on", "stopped")
    assert "2 local processes (gloo)" in " ".join(verdict["notes"])
    assert done.returncode == (0 if verdict["right"] else 1)
    assert verdict["right"] == (not weight_faults(deepspeed(), 1, False, "fp32", g, "engine", None, world_size=2))


def test_deepspeeds_own_output_never_reaches_the_verdict_unless_asked(tmp_path):
    """DeepSpeed prints its logs and memory reports (to stdout): verify's output is its verdict alone; --verbose
    shows DeepSpeed's, on stderr."""
    config = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    for flags in ((), ("--world-size", "2")):
        quiet = verify(tmp_path, config, 2, "--json", *flags)
        assert quiet.returncode in (0, 1, 2), quiet.stderr
        assert "[INFO]" not in quiet.stdout + quiet.stderr and "[WARNING]" not in quiet.stdout + quiet.stderr
        if quiet.returncode != 2:
            assert len(quiet.stdout.splitlines()) == 1 and json.loads(quiet.stdout)["g"] == 2
            assert quiet.stderr == ""
    loud = verify(tmp_path, config, 2, "--verbose")
    assert "DeepSpeed" in loud.stdout.splitlines()[0] or loud.returncode == 2
    assert "[INFO]" in loud.stderr or "[WARNING]" in loud.stderr


def test_a_missing_file_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "stepsync", "verify", "--deepspeed", str(tmp_path / "none.json"),
                           "--gas", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "does not exist" in done.stderr


@pytest.mark.parametrize("framework", ["accelerate", "trainer"])
def test_each_tokens_weight_equals_the_real_frameworks_run(tmp_path, framework):
    """verify's token window (3, 9, 17, 33 trained tokens) names the rule, the ratio and the scale the real
    framework's run showed on the same counts (tests/integration/test_token_weights.py's runs, held against the
    weights there)."""
    from packaging.version import Version

    from harness.stack import INSTALLED
    from harness.token_runs import run_accelerate_tokens, run_trainer_tokens

    if framework == "trainer" and INSTALLED.transformers != "newest" and \
            Version(INSTALLED.transformers) < Version("4.47"):
        pytest.skip("verify makes the Trainer's call as transformers 4.47 and later make it")
    done = verify(tmp_path, {"zero_optimization": {"stage": 0}}, 4, "--framework", framework, "--json")
    assert done.returncode in (0, 1), done.stderr[-2000:]  # 1: the release's own micro-batch faults, said apart
    windows = json.loads(done.stdout)["tokens"]
    if framework == "accelerate":
        runs = [run_accelerate_tokens([3, 9, 17, 33], 4, loss=loss) for loss in ("examples", "recipe")]
    else:
        runs = [run_trainer_tokens(str(tmp_path / model), [3, 9, 17, 33], 4, model=model)
                for model in ("transformers", "ignores")]
    assert len(windows) == len(runs) == 2
    for window, run in zip(windows, runs):
        named = run.report.token_weighting
        assert window["found"] == named.found.value and window["tokens"] == [3, 9, 17, 33]
        assert window["ratio"] == pytest.approx(named.ratio, rel=1e-3)
        assert window["total"] == pytest.approx(named.total, rel=0.1)  # the Trainer's count of num_items_in_batch
    assert [w["found"] for w in windows] == (["micro_batch_mean", "token_mean"] if framework == "accelerate"
                                             else ["token_mean", "micro_batch_mean"])
    # Each micro-batch's own mean: a token weighs N / (G n_i) times a token mean's weight, G times that where the
    # Trainer sums the means (the model ignores num_items_in_batch).
    # (DeepSpeed 0.18.3 - 0.19.5 divide all of it by G once more at the logits: its sum says by how much.)
    own = windows[0 if framework == "accelerate" else 1]
    averaged_over = 4 if framework == "accelerate" else 1
    scale = own["total"] / (4 / averaged_over)
    assert own["per_token_times_n"] == pytest.approx([62 / count / averaged_over * scale for count in (3, 9, 17, 33)],
                                                     rel=1e-3)
