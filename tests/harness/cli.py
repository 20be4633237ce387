"""The command line as a user runs it: in this process for parsing and output (fast), or a child process for the
entry point itself and for the commands that train (verify, demo)."""
import contextlib
import io
import os
import subprocess
import sys
from typing import Dict, Optional


def stepsync(*args, columns: Optional[int] = None, env: Optional[Dict[str, str]] = None):
    """``stepsync ARGS`` run in this process, as ``python -m stepsync ARGS`` with its output read by a pipe: a
    ``CompletedProcess`` with the exit status and stdout and stderr as text. ``columns`` sets COLUMNS (a log's
    width); ``env`` adds variables for the call. A verify or demo that trains runs in :func:`stepsync_process`."""
    from stepsync.tools.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    changed = dict(env or {}, **({"COLUMNS": str(columns), "TERM": "dumb"} if columns else {}))
    before = {name: os.environ.get(name) for name in changed}
    os.environ.update(changed)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as end:  # argparse: --help, --version and a usage error
                code = end.code if isinstance(end.code, int) else (0 if end.code is None else 2)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(["stepsync", *args], code, stdout.getvalue(), stderr.getvalue())


def cut_lines(text: str):
    """Lines rich cut (an ellipsis), or that run past 80 columns where they could have wrapped (a word or path longer
    than a line stands alone on its own; a table as wide as its words need is not cut)."""
    return [line for line in text.splitlines()
            if "…" in line or len(line) > 80 and " " in line.strip() and "  " not in line.strip()]


def stepsync_process(*args, **options):
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
