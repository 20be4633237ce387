"""A newcomer's first hour: install, find the command line, read output that fits a log, trust check."""
import importlib.util
import io
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from harness.stack import write_torch_archive
from harness.cli import cut_lines, stepsync
from harness.paths import REPO

ROOT = REPO


def test_version_names_stepsync_and_the_stack():
    proc = stepsync("--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith("stepsync ") and "transformers " in proc.stdout and "deepspeed " in proc.stdout


def test_help_is_plain_text():
    proc = stepsync("--help")
    assert proc.returncode == 0 and "``" not in proc.stdout
    for command in ("check", "inspect", "demo"):
        assert f"  {command} " in proc.stdout


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("version", ["4.10.0", "4.23.1"])
def test_check_refuses_a_release_below_the_measured_range(version):
    proc = stepsync("check", "--samples", "3", "--gas", "2", "--transformers", version)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "older than 4.24.0" in proc.stderr and "supported: 4.24.0 to 5.25.0" in proc.stderr


def test_measured_means_probed_and_inferred_is_said():
    measured = json.loads(stepsync("check", "--samples", "3", "--gas", "2", "--transformers", "5.24.0",
                                   "--accelerate", "1.7.0", "--deepspeed", "0.19.8", "--json").stdout)
    assert measured["stack"]["measured"] is True and measured["stack"]["caveats"] == []
    newer = stepsync("check", "--samples", "3", "--gas", "2", "--transformers", "9.0.0", "--accelerate", "1.7.0",
                     "--deepspeed", "0.19.8", "--json")
    assert json.loads(newer.stdout)["stack"]["measured"] is False
    human = stepsync("check", "--samples", "3", "--gas", "2", "--transformers", "9.0.0", "--accelerate", "1.7.0",
                     "--deepspeed", "0.19.8")
    assert "inferred from release notes, not measured" in " ".join(human.stdout.split())


def test_training_args_without_a_deepspeed_config_are_said_to_be_assumed(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"gradient_accumulation_steps": 2, "num_train_epochs": 2,
                                "per_device_train_batch_size": 1}))
    proc = stepsync("check", "--samples", "3", "--training-args", str(args), "--transformers", "5.24.0",
                    "--accelerate", "1.7.0", "--deepspeed", "0.19.8", "--json")
    notes = json.loads(proc.stdout)["notes"]
    assert any("names no DeepSpeed config" in n and "accelerate's DeepSpeed plugin" in n for n in notes)


def test_an_inferred_world_size_is_shown(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "gradient_accumulation_steps": 8,
                              "train_micro_batch_size_per_gpu": 1}))
    proc = stepsync("check", "--samples", "12", "--deepspeed-config", str(ds), "--transformers", "5.24.0",
                    "--accelerate", "1.7.0", "--deepspeed", "0.19.8", "--json")
    data = json.loads(proc.stdout)
    assert data["inputs"]["world_size"] == 2 and data["inputs"]["world_size_inferred"] is True
    assert any("world size 2 inferred from train_batch_size=16" in n for n in data["notes"])
    human = stepsync("check", "--samples", "12", "--deepspeed-config", str(ds), "--transformers", "5.24.0",
                     "--accelerate", "1.7.0", "--deepspeed", "0.19.8")
    assert "world size 2 inferred" in " ".join(human.stdout.split())


def test_check_says_when_the_trainer_ends_early():
    """transformers 4.51.3, 5 micro-batches, G=2, 3 epochs: planned 6, counts 3 per epoch (measured)."""
    proc = stepsync("check", "--samples", "5", "--gas", "2", "--epochs", "3", "--transformers", "4.51.3",
                    "--accelerate", "1.8.0", "--deepspeed", "0.16.9")
    assert proc.returncode == 1  # aligned counts, but the run stops after 2 of its 3 epochs
    assert "the Trainer will stop after 2 of 3 epochs: it plans 2 update(s) per epoch" in " ".join(proc.stdout.split())



@pytest.mark.parametrize("args", [
    ["check", "--samples", "10", "--batch-size", "2", "--gas", "3", "--epochs", "3", "--transformers", "4.51.3",
     "--accelerate", "1.6.0", "--deepspeed", "0.16.9", "--policy", "drop_last"],
    ["check", "--samples", "3", "--gas", "2", "--epochs", "2", "--transformers", "9.0.0", "--accelerate", "1.7.0"],
])
def test_check_fits_80_columns_in_a_pipe(args):
    proc = stepsync(*args, columns=80)
    assert proc.stdout and cut_lines(proc.stdout) == []


def fake_output_dir(tmp_path, steps):
    """Checkpoint folders as the Trainer and DeepSpeed write them (only the files inspect reads)."""
    for trainer, engine in steps:
        folder = tmp_path / f"checkpoint-{trainer}"
        (folder / f"global_step{engine}").mkdir(parents=True)
        write_torch_archive(folder / f"global_step{engine}" / "mp_rank_00_model_states.pt", {"dp_world_size": 1})
        (folder / "latest").write_text(f"global_step{engine}")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": trainer}))
    return tmp_path


def test_inspect_fits_80_columns_in_a_pipe(tmp_path):
    out = fake_output_dir(tmp_path / "a-rather-long-output-directory-name", [(2, 1), (4, 3), (800, 799)])
    proc = stepsync("inspect", str(out), columns=80)
    assert proc.returncode == 1 and cut_lines(proc.stdout) == []
    assert str(out) in proc.stdout.split()  # the path whole, never folded
    flat = " ".join(proc.stdout.split())
    assert "no checkpoint is safe to resume from: each one carries drift or missing files into a resume" in flat


def test_inspect_of_one_checkpoint_audits_that_checkpoint_only(tmp_path):
    out = fake_output_dir(tmp_path, [(2, 2), (4, 3)])
    data = json.loads(stepsync("inspect", str(out / "checkpoint-2"), "--json").stdout)
    assert [c["name"] for c in data["checkpoints"]] == ["checkpoint-2"] and data["ok"]
    whole = json.loads(stepsync("inspect", str(out), "--json").stdout)
    assert [c["name"] for c in whole["checkpoints"]] == ["checkpoint-2", "checkpoint-4"] and not whole["ok"]


def test_the_package_lists_its_callback():
    import stepsync

    assert "StepSyncCallback" in dir(stepsync) and "StepSyncCallback" in stepsync.__all__


def test_a_report_prints_readably():
    from rich.console import Console

    from stepsync import Policy, SyncReport
    from stepsync.core.events import Cause, DriftEvent
    from stepsync.core.report import EpochCount
    from stepsync.display.render import summary_view

    event = DriftEvent(1, 3, 2, 1, 0, Cause.PARTIAL_WINDOW, "use StepSyncCallback(policy='sync')", "step_end")
    report = SyncReport(Policy.WARN, active=True, trainer_steps=4, engine_steps=3, planned_steps=4, events=[event],
                        epochs=[EpochCount(1, 3, 2, 1), EpochCount(2, 3, 4, 3)], finished=True)
    text = str(report)
    assert text.splitlines()[0] == "stepsync report (policy 'warn'): Trainer 4 updates, engine 3 (drift +1)"
    assert "schedule: planned 4, made 3 (1 not made)" in text and "trained: 2 epoch(s), 6 micro-batch(es)" in text
    assert len(text) < 600 and "SyncReport(" not in text
    buffer = io.StringIO()
    Console(file=buffer, width=80).print(summary_view(report))
    assert "stepsync summary" in buffer.getvalue() and cut_lines(buffer.getvalue()) == []


def test_a_drift_message_says_where_in_words():
    from stepsync.core.events import Cause, DriftEvent

    event = DriftEvent(1, 3, 2, 1, 0, Cause.PARTIAL_WINDOW, "use StepSyncCallback(policy='sync')", "step_end")
    assert event.message().startswith("step drift +1 at epoch 1, micro-batch 3 (at an update): ")
    assert event.to_dict()["where"] == "step_end"  # the records keep the short name


def test_drop_last_says_what_it_left_per_epoch_in_words():
    from rich.console import Console

    from stepsync import Policy, SyncReport
    from stepsync.display.render import summary_view

    report = SyncReport(Policy.DROP_LAST, active=True, dropped_micro_batches={2: 1, 1: 1}, finished=True)
    buffer = io.StringIO()
    Console(file=buffer, width=120).print(summary_view(report))
    assert "drop_last left 2 micro-batch(es) untrained: 1 in epoch 1, 1 in epoch 2" in buffer.getvalue()
    assert "{" not in buffer.getvalue()


def test_logging_and_the_console_say_a_message_once_per_destination():
    """A view is drawn only where no logging handler already writes the same message."""
    from stepsync.display.output import logging_reaches

    logger = logging.Logger("stepsync-alone", logging.INFO)  # no parent: nothing configured
    assert logging_reaches(sys.stderr, logger, logging.WARNING)  # Python's last resort prints warnings there
    assert not logging_reaches(sys.stderr, logger, logging.INFO)
    logger.addHandler(logging.StreamHandler(io.StringIO()))
    assert not logging_reaches(sys.stderr, logger, logging.WARNING)  # the log goes to a file: draw on the terminal
    logger.addHandler(logging.StreamHandler(sys.stderr))
    assert logging_reaches(sys.stderr, logger, logging.INFO)  # basicConfig-like: the log line is enough
    quiet = logging.Logger("stepsync-quiet", logging.ERROR)
    quiet.addHandler(logging.StreamHandler(sys.stderr))
    assert not logging_reaches(sys.stderr, quiet, logging.WARNING)  # filtered out: the view is the only copy


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_one_terminal_is_one_screen_for_stdout_stderr_and_rich():
    from rich.console import Console
    from rich.logging import RichHandler

    from stepsync.display.output import logging_reaches

    stdout, stderr = Terminal(), Terminal()
    logger = logging.Logger("stepsync-examples", logging.INFO)
    logger.addHandler(logging.StreamHandler(stdout))  # transformers' example scripts
    assert logging_reaches(stderr, logger, logging.INFO)  # the same screen: the line is enough
    assert not logging_reaches(io.StringIO(), logger, logging.INFO)  # the console draws into a file: draw
    rich_logger = logging.Logger("stepsync-rich", logging.INFO)
    rich_logger.addHandler(RichHandler(console=Console(file=stdout)))
    assert logging_reaches(stderr, rich_logger, logging.INFO)
    piped = logging.Logger("stepsync-piped", logging.INFO)
    piped.addHandler(logging.StreamHandler(io.StringIO()))  # a log file, not the screen
    assert not logging_reaches(stderr, piped, logging.INFO)


def light_venv(tmp_path):
    """A fresh environment with stepsync installed as a user would, without the training packages."""
    venv = tmp_path / "light"
    uv = shutil.which("uv")
    if uv:
        subprocess.run([uv, "venv", "-q", "-p", sys.executable, str(venv)], check=True)
        install = [uv, "pip", "install", "-q", "-p", str(venv / "bin" / "python"), ROOT]
    else:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        install = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", ROOT]
    done = subprocess.run(install, capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.skip(f"no package index reachable for the light install: {done.stderr[-300:]}")
    return venv / "bin"


@pytest.mark.integration
def test_the_light_install_runs_check_and_inspect_and_names_the_rest(tmp_path):
    bin_dir = light_venv(tmp_path)
    modules = subprocess.run([str(bin_dir / "python"), "-c", "import importlib.util as u; print([m for m in "
                              "('torch', 'transformers', 'deepspeed') if u.find_spec(m)])"],
                             capture_output=True, text=True).stdout.strip()
    assert modules == "[]"
    check = subprocess.run([str(bin_dir / "stepsync"), "check", "--samples", "3", "--gas", "2", "--epochs", "2",
                            "--accelerate", "1.7.0", "--json"], capture_output=True, text=True)
    data = json.loads(check.stdout)
    assert check.returncode == 1 and (data["trainer_steps"], data["engine_steps"]) == (4, 3)
    assert any("transformers is not installed here" in note for note in data["notes"])
    out = fake_output_dir(tmp_path / "out", [(2, 2)])
    assert subprocess.run([str(bin_dir / "stepsync"), "inspect", str(out)], capture_output=True).returncode == 0
    demo = subprocess.run([str(bin_dir / "stepsync"), "demo"], capture_output=True, text=True)
    assert demo.returncode == 2 and f"pip install '{ROOT}[trainer]'" in demo.stderr  # where it was installed from
    callback = subprocess.run([str(bin_dir / "python"), "-c", "import stepsync; stepsync.StepSyncCallback"],
                              capture_output=True, text=True)
    assert callback.returncode == 1 and f"pip install '{ROOT}[trainer]'" in callback.stderr


def test_running_from_a_clone_without_installing_names_the_install_command(tmp_path):
    """`python3 -m stepsync` with no dependency at all: a message and exit 2, never exit 1 ('drifts')."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "stepsync", "check", "--samples", "3", "--gas", "2"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "a package stepsync needs is missing" in proc.stderr and f"pip install '{ROOT}'" in proc.stderr


def test_a_huge_number_of_epochs_is_summarised_not_printed_whole():
    """100,000 epochs: the table shows the first and last ten (it printed every row, 97 s and 611 MB, before)."""
    args = ["check", "--samples", "7", "--gas", "3", "--epochs", "100000", "--accelerate", "1.7.0"]
    proc = stepsync(*args, columns=80)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1 and len(lines) < 60
    assert "99980 epochs between not shown (--json has every one)" in " ".join(proc.stdout.split())
    assert any(line.split()[:2] == ["100000", "7"] for line in lines if line.strip())
    data = json.loads(stepsync(*args, "--json").stdout)
    assert len(data["epochs"]) == 100000


@pytest.mark.installed
def test_a_script_beside_the_clone_imports_the_installed_package(tmp_path):
    """The README's clone line leaves a folder beside the user's script: named stepsync, it would shadow the installed
    package (`cannot import name 'StepSyncCallback' from 'stepsync' (unknown location)`)."""
    import re

    line = next(line for line in open(os.path.join(ROOT, "README.md"))
                if line.startswith("git clone <this repository>") and "pip install" in line)
    folder = re.match(r"git clone <this repository> (\S+) && pip install \./(\S+)", line)
    assert folder and folder.group(1) == folder.group(2)
    (tmp_path / folder.group(1)).mkdir()
    (tmp_path / folder.group(1) / "setup.cfg").write_text("")  # the clone's root: no __init__.py, as in git
    script = tmp_path / "train.py"
    script.write_text("import stepsync\nprint(stepsync.Policy.SYNC.value)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # stepsync as the stack installed it
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "sync", proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("lightning") is not None, reason="names what a stack without it misses")
def test_stepsync_lightning_without_lightning_names_the_install():
    proc = subprocess.run([sys.executable, "-c", "from stepsync.lightning import StepSyncCallback"],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "ModuleNotFoundError" not in proc.stderr.splitlines()[-1]
    assert "stepsync.lightning needs Lightning, torch and DeepSpeed" in proc.stderr
    assert f"pip install '{ROOT}[lightning]'" in proc.stderr


def test_the_set_up_reads_its_stacks_with_the_standard_library_alone():
    """scripts/envs.py runs on a new machine's python3 (no packaging, no rich) and imports nothing of stepsync
    before the stack that has stepsync's dependencies exists: ``-S`` leaves out every installed package."""
    code = ("import runpy, sys\n"
            "for argv in (['pins', 'drifting'], ['tests', 't457'], ['stack', '--list']):\n"
            "    sys.argv = ['envs.py', *argv]\n"
            "    try:\n"
            "        runpy.run_path('scripts/envs.py', run_name='__main__')\n"
            "    except SystemExit as end:\n"
            "        assert not end.code, (argv, end.code)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('stepsync', 'packaging', 'rich')))\n")
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("transformers 5.24.0, accelerate 1.7.0") and "drifting" in lines[2]
    assert lines[-1] == "[]"


def test_the_readme_says_what_a_compiled_op_serves_as_measured():
    """The README's sentence on TORCH_EXTENSIONS_DIR is the one stepsync says before a build, and the one
    tests/integration/test_op_builds.py measures."""
    from stepsync.engine.deepspeed import ONE_BUILD

    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    assert f"In `TORCH_EXTENSIONS_DIR`, {ONE_BUILD}" in readme and "once per `TORCH_EXTENSIONS_DIR`" not in readme


def test_every_torch_hint_is_the_readmes_torch_line():
    """The README spells out the CPU index as a command; stepsync's own hints give the same command."""
    from stepsync.core.install import TORCH_INSTALL, training_install_hint

    readme = open(os.path.join(ROOT, "README.md")).read()
    line = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert f"\n  {line}\n" in readme and TORCH_INSTALL.startswith(line)
    assert training_install_hint("trainer").startswith(line) and f"'{ROOT}[trainer]'" in training_install_hint("trainer")
    proc = stepsync("demo")  # the fast loop has no training packages: the hint is printed
    if importlib.util.find_spec("torch") is None:
        assert proc.returncode == 2 and line in proc.stderr
