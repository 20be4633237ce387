"""The command line through its real entry point (a subprocess)."""
import json
import subprocess
import sys

import pytest


def stepsync(*args):
    return subprocess.run([sys.executable, "-m", "stepsync", *args], capture_output=True, text=True, timeout=120)


def test_check_seed_case_drifts_on_accelerate_17():
    proc = stepsync("check", "--samples", "3", "--gas", "2", "--epochs", "2", "--transformers", "5.24.0",
                    "--accelerate", "1.7.0", "--deepspeed", "0.19.8", "--json")
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["trainer_steps"], data["engine_steps"], data["drift"]) == (4, 3, 1)
    assert [(e["trainer_steps"], e["engine_steps"]) for e in data["epochs"]] == [(2, 1), (4, 3)]


def test_check_aligned_stack_exits_0():
    proc = stepsync("check", "--samples", "3", "--gas", "2", "--epochs", "2", "--transformers", "5.24.0",
                    "--accelerate", "1.16.0", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["drift"] == 0


def test_check_policy_sync_forecasts_no_drift():
    proc = stepsync("check", "--samples", "3", "--gas", "2", "--epochs", "2", "--accelerate", "1.7.0",
                    "--transformers", "5.24.0", "--policy", "sync", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["engine_steps"] == 4


@pytest.mark.parametrize("args, fix", [
    (["--samples", "3", "--gas", "0"], "--gas: 0 must be >= 1"),
    (["--samples", "-3", "--gas", "2"], "must be >= 1"),
    (["--samples", "3", "--micro-batches-per-epoch", "3", "--gas", "2"], "not allowed with argument"),
    (["--samples", "3", "--gas", "2", "--policy", "nope"], "Possible choices are"),
    (["--samples", "3", "--gas", "2", "--accelerate", "x.y"], "cannot read the version"),
    (["--samples", "3", "--gas", "2", "--epochs", "0"], "--epochs must be > 0"),
])
def test_bad_input_exits_2_naming_the_fix(args, fix):
    proc = stepsync("check", *args)
    assert proc.returncode == 2
    assert fix in proc.stderr and "Traceback" not in proc.stderr


def test_check_imports_neither_torch_nor_deepspeed():
    code = ("import sys; from stepsync.cli import main; main(['check','--samples','3','--gas','2','--json']);"
            "print('torch' in sys.modules, 'deepspeed' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip().endswith("False False")


def test_help_shows_an_example():
    for args in (["--help"], ["check", "--help"], ["demo", "--help"]):
        proc = stepsync(*args)
        assert proc.returncode == 0 and "example: stepsync" in proc.stdout
