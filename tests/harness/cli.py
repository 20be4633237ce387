"""The command line as a user runs it: a child process."""
import subprocess
import sys


def stepsync(*args, **options):
    """``python -m stepsync ARGS`` in a child process (stdout and stderr captured as text)."""
    options.setdefault("timeout", 120)
    return subprocess.run([sys.executable, "-m", "stepsync", *args], capture_output=True, text=True, **options)


def forecast_epochs(framework, micro_batches, gas, epochs, policy="warn"):
    """``stepsync check --framework FRAMEWORK --json`` for the installed releases: each epoch's (the framework's
    count, the engine's count) as forecast."""
    import json

    proc = stepsync("check", "--framework", framework, "--micro-batches-per-epoch", str(micro_batches), "--gas",
                    str(gas), "--epochs", str(epochs), "--policy", policy, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return [(epoch["trainer_steps"], epoch["engine_steps"]) for epoch in json.loads(proc.stdout)["epochs"]]
