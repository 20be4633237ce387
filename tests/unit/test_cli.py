"""The command line: parsing and output in this process, the entry point itself in a child process."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from harness.cli import stepsync, stepsync_process
from harness.paths import REPO


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


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("args, fix", [
    (["--samples", "3", "--gas", "0"], "--gas: 0 must be >= 1"),
    (["--samples", "-3", "--gas", "2"], "must be >= 1"),
    (["--samples", "3", "--micro-batches-per-epoch", "3", "--gas", "2"], "not allowed with argument"),
    (["--samples", "3", "--gas", "2", "--policy", "nope"], "Possible choices are"),
    (["--samples", "3", "--gas", "2", "--accelerate", "x.y"], "cannot read the version"),
    (["--samples", "3", "--gas", "2", "--epochs", "0"], "--epochs must be > 0"),
    (["--samples", "3", "--gas", "2", "--epochs", "-1"], "--epochs must be > 0"),
    (["--samples", "3", "--gas", "2", "--max-steps", "0"], "--max-steps: 0 must be >= 1"),
    (["--samples", "3"], "gradient_accumulation_steps is not given: pass --gas"),
    (["--gas", "2"], "pass --samples or --micro-batches-per-epoch"),
    (["--samples", "1", "--batch-size", "2", "--gas", "2", "--drop-last"], "lower the batch size"),
    (["--samples", "3", "--training-args", "/nonexistent/args.json"], "does not exist"),
    (["--samples", "3", "--gas", "2", "--deepspeed-config", "/nonexistent/ds.json"], "does not exist"),
])
def test_bad_input_exits_2_naming_the_fix(args, fix):
    proc = stepsync("check", *args)
    assert proc.returncode == 2
    assert fix in proc.stderr and "Traceback" not in proc.stderr


def test_check_imports_neither_torch_nor_deepspeed():
    code = ("import sys; from stepsync.tools.cli import main; main(['check','--samples','3','--gas','2','--json']);"
            "print('torch' in sys.modules, 'deepspeed' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip().endswith("False False")


def test_help_shows_an_example():
    for args in (["--help"], ["check", "--help"], ["inspect", "--help"], ["demo", "--help"]):
        proc = stepsync(*args)
        assert proc.returncode == 0 and "example: stepsync" in proc.stdout


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_check_reads_training_args_and_deepspeed_config(tmp_path):
    args = write(tmp_path, "args.json", json.dumps({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                                                     "num_train_epochs": 2.0, "max_steps": -1, "deepspeed": "ds.json",
                                                     "dataloader_drop_last": False, "learning_rate": 1e-3}))
    write(tmp_path, "ds.json", json.dumps({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 8,
                                           "gradient_accumulation_steps": "auto"}))
    # 12 samples on 8 / (2 x 2) = 2 ranks: 6 per rank, 3 micro-batches of 2 -> 3 per epoch.
    proc = stepsync("check", "--samples", "12", "--training-args", args, "--transformers", "5.24.0",
                    "--accelerate", "1.7.0", "--json")
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["inputs"] == {"micro_batches_per_epoch": 3, "batch_size": 2, "world_size": 2, "drop_last": False,
                              "world_size_inferred": True}
    assert (data["trainer_steps"], data["engine_steps"]) == (4, 3)
    # A flag overrides the file: --epochs 1 -> 2 Trainer updates, 1 engine update.
    proc = stepsync("check", "--samples", "12", "--training-args", args, "--epochs", "1", "--transformers", "5.24.0",
                    "--accelerate", "1.7.0", "--json")
    assert (json.loads(proc.stdout)["trainer_steps"], json.loads(proc.stdout)["engine_steps"]) == (2, 1)


def test_deepspeed_config_alone_gives_g(tmp_path):
    ds = write(tmp_path, "ds.json", json.dumps({"gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 1}))
    proc = stepsync("check", "--samples", "3", "--epochs", "2", "--deepspeed-config", ds, "--accelerate", "1.7.0",
                    "--transformers", "5.24.0", "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["drift"] == 1


@pytest.mark.parametrize("deepspeed, g, faulty", [("0.18.4", 3, True), ("0.18.9", 4, True), ("0.19.0", 3, False),
                                                   ("0.18.4", 2, False), ("0.17.4", 3, False)])
def test_check_names_the_micro_batches_a_release_drops_under_zero2_with_offload(tmp_path, deepspeed, g, faulty):
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}
    ds = write(tmp_path, "ds.json", json.dumps(config))
    proc = stepsync("check", "--samples", str(4 * g), "--gas", str(g), "--epochs", "1", "--deepspeed-config", ds,
                    "--transformers", "5.24.0", "--accelerate", "1.16.0", "--deepspeed", deepspeed, "--json")
    said = [note for note in json.loads(proc.stdout)["notes"] if "offloaded to the CPU" in note]
    assert proc.returncode == (1 if faulty else 0) and len(said) == faulty
    if faulty:  # the micro-batches between the first and the last of each window, as probed
        assert f"micro-batch(es) {list(range(2, g))} of every window of {g}" in said[0] and "0.19.0" in said[0]


@pytest.mark.parametrize("deepspeed, world, immediate, said, code", [
    ("0.18.9", None, False, "on several data-parallel ranks: DeepSpeed 0.18.9", 0),  # the ranks are not known
    ("0.18.9", "2", False, "- DeepSpeed 0.18.9", 1),
    ("0.18.5", "4", False, "- DeepSpeed 0.18.5", 1),
    ("0.18.9", "1", False, None, 0),  # one rank: nothing to average
    ("0.18.9", "2", True, None, 0),  # bf16.immediate_grad_update avoids it
    ("0.19.0", "2", False, None, 0),
])
def test_check_names_the_bf16_optimizer_leaving_the_last_micro_batch_out_of_the_average(tmp_path, deepspeed, world,
                                                                                       immediate, said, code):
    config = {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 4,
              "train_micro_batch_size_per_gpu": 1, "data_types": {"grad_accum_dtype": "fp32"},
              "bf16": {"enabled": True, **({"immediate_grad_update": True} if immediate else {})}}
    ds = write(tmp_path, "ds.json", json.dumps(config))
    proc = stepsync("check", "--samples", "64", "--epochs", "1", "--deepspeed-config", ds, "--transformers", "5.24.0",
                    "--accelerate", "1.16.0", "--deepspeed", deepspeed, *(["--world-size", world] if world else []))
    text = " ".join(proc.stdout.split())
    assert proc.returncode == code, proc.stdout + proc.stderr
    if said is None:
        assert "after the average across ranks" not in text
    else:
        assert said + " with ZeRO-1 in bf16 and an fp32 gradient accumulation" in text
        assert "micro-batch(es) [4] of every window of 4" in text and '"immediate_grad_update": true' in text


@pytest.mark.parametrize("deepspeed, framework, said", [
    ("0.18.3", "trainer", ["the Trainer's loss, already divided by G, by G again",
                           "where the model's loss is computed from another tensor"]),
    ("0.18.4", "trainer", []),  # the Trainer's scale_wrt_gas=False is honoured from 0.18.4
    ("0.18.4", "lightning", ["where the model's loss is computed from another tensor"]),
    ("0.19.6", "lightning", []),
])
def test_check_names_the_output_hook_faults_for_the_frameworks_call(tmp_path, deepspeed, framework, said):
    config = {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": "auto",
              "train_micro_batch_size_per_gpu": "auto"}
    ds = write(tmp_path, "ds.json", json.dumps(config))
    extra = ["--framework", "lightning", "--lightning", "2.6.6"] if framework == "lightning" else [
        "--transformers", "5.24.0", "--accelerate", "1.16.0"]
    proc = stepsync("check", "--samples", "8", "--gas", "2", "--epochs", "1", "--deepspeed-config", ds,
                    "--deepspeed", deepspeed, *extra, "--json")
    notes = [note for note in json.loads(proc.stdout)["notes"] if "DeepSpeed " + deepspeed + " divides" in note]
    assert len(notes) == len(said) and all(any(s in note for note in notes) for s in said), notes
    if framework == "trainer":  # a fault that needs the model's output is said, not counted (no model is run)
        assert proc.returncode == (1 if deepspeed == "0.18.3" else 0)


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("args_json, ds_json, fix", [
    ("{not json", None, "is not valid JSON"),
    ("[1, 2]", None, "must hold a JSON object"),
    ('{"gradient_accumulation_steps": 0}', None, "gradient_accumulation_steps=0 in"),
    ('{"gradient_accumulation_steps": "two"}', None, "must be a whole number"),
    ('{"gradient_accumulation_steps": 2, "num_train_epochs": 0}', None, "num_train_epochs must be > 0"),
    ('{"gradient_accumulation_steps": 2, "dataloader_drop_last": "yes"}', None, "must be true or false"),
    ('{"gradient_accumulation_steps": 2}', '{"gradient_accumulation_steps": 4}',
     "- ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=2\nset each to \"auto\""),
    ('{"gradient_accumulation_steps": 2}', '{"train_batch_size": 3}', "is not a multiple of"),
    ('{"gradient_accumulation_steps": 2}', '{"train_batch_size": "many"}', "must be a whole number"),
    ('{"gradient_accumulation_steps": 2, "deepspeed": "missing.json"}', None, "does not exist"),
])
def test_bad_files_exit_2_naming_the_fix(tmp_path, args_json, ds_json, fix):
    cli = ["check", "--samples", "3", "--training-args", write(tmp_path, "args.json", args_json)]
    if ds_json is not None:
        cli += ["--deepspeed-config", write(tmp_path, "ds.json", ds_json)]
    proc = stepsync(*cli)
    assert proc.returncode == 2, proc.stdout
    assert fix in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.installed
def test_python_m_and_the_console_script_are_the_same():
    import shutil

    script = shutil.which("stepsync", path=os.path.dirname(sys.executable))
    assert script is not None
    args = ["check", "--samples", "3", "--gas", "2", "--epochs", "2", "--accelerate", "1.7.0", "--json"]
    via_script = subprocess.run([script, *args], capture_output=True, text=True)
    via_module = stepsync(*args)
    assert (via_script.returncode, via_script.stdout) == (via_module.returncode, via_module.stdout) and via_script.stdout


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("where, fix", [("missing", "does not exist"), ("file", "is not a directory"),
                                        ("empty", "no checkpoint-N folders")])
def test_inspect_bad_paths_exit_2(tmp_path, where, fix):
    path = tmp_path / where
    if where == "file":
        path.write_text("x")
    elif where == "empty":
        path.mkdir()
    proc = stepsync("inspect", str(path))
    assert proc.returncode == 2 and fix in proc.stderr and "Traceback" not in proc.stderr


def test_check_forecasts_a_lightning_configuration():
    proc = stepsync("check", "--framework", "lightning", "--lightning", "2.6.6", "--deepspeed", "0.19.8",
                    "--samples", "3", "--gas", "2", "--epochs", "2", "--zero-stage", "0", "--json")
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["trainer_steps"], data["engine_steps"], data["drift"]) == (2, 3, -1)
    assert data["micro_batch_weight"] == 0.25 and data["wiped_micro_batches"] == 2 and data["straddling"] == [2]
    assert data["stack"]["framework"] == "Lightning" and data["stack"]["lightning"] == "2.6.6"
    synced = stepsync("check", "--framework", "lightning", "--lightning", "2.6.6", "--samples", "3", "--gas", "2",
                      "--epochs", "2", "--zero-stage", "0", "--policy", "sync", "--json")
    assert synced.returncode == 0 and json.loads(synced.stdout)["micro_batch_weight"] == 0.5


@pytest.mark.reliability("bad_input")
def test_check_refuses_realign_for_lightning_with_the_reason():
    proc = stepsync("check", "--framework", "lightning", "--samples", "3", "--gas", "2", "--policy", "realign")
    assert proc.returncode == 2 and "use --policy sync or --policy drop_last" in proc.stderr


@pytest.mark.reliability("bad_input")
@pytest.mark.skipif(importlib.util.find_spec("lightning") is not None, reason="names what a stack without it misses")
def test_the_lightning_demo_without_lightning_names_the_install():
    proc = stepsync("demo", "--framework", "lightning")
    assert proc.returncode == 2 and f"pip install '{REPO}[lightning]'" in proc.stderr  # the clone it runs from


def test_check_of_a_lightning_configuration_imports_neither_lightning_nor_torch():
    code = ("import sys, contextlib, io\nfrom stepsync.tools.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['check', '--framework', 'lightning', '--samples', '3', '--gas', '2', '--json'])\n"
            "import stepsync\nprint(sorted(m for m in ('lightning', 'torch', 'deepspeed', 'transformers') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize("read_first", [10, 0])
def test_a_closed_pipe_ends_quietly_with_the_verdicts_status(read_first):
    """`stepsync check ... --json | head -c 10`: the reader goes away after some output or before any; no traceback,
    and the exit status is still the verdict's (1: this configuration drifts), never a status that depends on when
    the reader left."""
    proc = subprocess.Popen([sys.executable, "-m", "stepsync", "check", "--samples", "7", "--gas", "3", "--epochs",
                             "20000", "--transformers", "5.24.0", "--accelerate", "1.7.0", "--deepspeed", "0.19.8",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(read_first)
    proc.stdout.close()  # as `head -c 10` does
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and stderr == ""


def test_inspect_through_head_exits_with_its_verdict_every_time(tmp_path):
    """The same folder, read five times by `head -c 0` (a reader that leaves at once): the status is inspect's
    verdict (1: a drifted checkpoint) each time, whether the reader left before or after the output was written."""
    from test_newcomer import fake_output_dir

    out = fake_output_dir(tmp_path, [(2, 1), (4, 3)])
    line = f"{sys.executable} -m stepsync inspect {out} --json | head -c 0; echo ${{PIPESTATUS[0]}}"
    statuses = [subprocess.run(["bash", "-c", line], capture_output=True, text=True).stdout.strip() for _ in range(5)]
    assert statuses == ["1"] * 5


@pytest.mark.reliability("bad_input")
def test_a_deepspeed_config_given_as_training_args_is_named_for_what_it_is(tmp_path):
    ds = write(tmp_path, "ds.json", json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                                 "gradient_accumulation_steps": "auto",
                                                 "zero_optimization": {"stage": 2}}))
    proc = stepsync("check", "--samples", "8", "--training-args", ds)
    assert proc.returncode == 2 and "is a DeepSpeed config" in proc.stderr and "--deepspeed-config" in proc.stderr
    assert "must be a whole number" not in proc.stderr


@pytest.mark.reliability("bad_input")
def test_a_lightning_version_without_the_lightning_framework_is_refused():
    proc = stepsync("check", "--samples", "3", "--gas", "2", "--lightning", "2.6.6")
    assert proc.returncode == 2 and "add --framework lightning" in proc.stderr


@pytest.mark.reliability("bad_input")
def test_the_lightning_demo_refuses_a_policy_lightning_cannot_have():
    proc = stepsync("demo", "--framework", "lightning", "--policy", "realign")
    assert proc.returncode == 2 and "use --policy sync or --policy drop_last" in proc.stderr


def test_only_stepsyncs_own_errors_are_bad_input(monkeypatch, tmp_path, capsys):
    """Exit 2 with one line is for what the user can fix (a StepSyncError); any other error is a bug, shown as one."""
    from stepsync.core.errors import AuditInputError
    from stepsync.tools import cli

    def bug(args):
        raise ValueError("a bug inside stepsync")

    monkeypatch.setattr(cli, "run_inspect", bug)
    assert cli.main(["inspect", str(tmp_path)]) == 3  # a status no verdict has: never "affected"
    said = capsys.readouterr().err
    assert "Traceback" in said and "ValueError: a bug inside stepsync" in said
    assert said.strip().endswith("failed (a bug in stepsync, not in your run): the traceback above says where")

    def refused(args):
        raise AuditInputError("not an output folder: pass the one the Trainer wrote")

    monkeypatch.setattr(cli, "run_inspect", refused)
    assert cli.main(["inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "stepsync: error: not an output folder: pass the one the Trainer wrote"


def test_check_of_a_loop_says_what_the_loop_decides_and_nothing_else():
    """--framework fabric: the engine never steps (no 'partial window' it leaves open), the weight depends on the
    DeepSpeed config (a caveat, not a claim); --framework accelerate: transformers decides nothing (no note on it)."""
    fabric = stepsync("check", "--micro-batches-per-epoch", "5", "--gas", "2", "--epochs", "3", "--framework",
                      "fabric", "--deepspeed", "0.19.8", "--json")
    data = json.loads(fabric.stdout)
    assert fabric.returncode == 1 and (data["trainer_steps"], data["engine_steps"]) == (6, 0)
    assert "never calls engine.step()" in data["verdict"] and "partial window" not in data["verdict"]
    assert "1/4" not in data["verdict"] and any("1/G^2" in note for note in data["notes"])
    assert not any(note.startswith(("transformers", "accelerate")) for note in data["notes"])
    loop = stepsync("check", "--micro-batches-per-epoch", "5", "--gas", "2", "--epochs", "3", "--framework",
                    "accelerate", "--accelerate", "1.7.0", "--deepspeed", "0.19.8", "--json")
    data = json.loads(loop.stdout)
    assert loop.returncode == 1 and [(e["trainer_steps"], e["engine_steps"]) for e in data["epochs"]] == [
        (3, 2), (6, 5), (9, 7)]
    assert not any(note.startswith("transformers") for note in data["notes"])


def test_check_names_trls_grpo_scale_from_a_grpo_config(tmp_path, monkeypatch, capsys):
    """A GRPOConfig's JSON with a dapo loss over a generation of 4 micro-batches and G=2: TRL 1.9.0 (as the installed
    release) makes every update half the window's token mean (probes/trl_grpo.json); 1.14.2 does not."""
    from stepsync.tools import cli

    args = write(tmp_path, "grpo.json", json.dumps({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                                                     "num_train_epochs": 1.0, "max_steps": -1, "loss_type": "dapo",
                                                     "steps_per_generation": 4}))
    for trl, code in (("1.9.0", 1), ("1.14.2", 0)):
        monkeypatch.setattr(cli, "installed_version", lambda name, trl=trl: trl if name == "trl" else None)
        assert cli.main(["check", "--samples", "8", "--training-args", args, "--transformers", "5.24.0",
                         "--accelerate", "1.16.0", "--json"]) == code
        notes = json.loads(capsys.readouterr().out)["notes"]
        said = [note for note in notes if "TRL" in note]
        assert len(said) == (code == 1)
        assert not said or "every update is 0.5x the token mean over its window" in said[0]


@pytest.mark.parametrize("given, meant", [("--grad-accum", "--gas"), ("--sample", "--samples"),
                                          ("--epoch", "--epochs"), ("--gradient_accumulation_steps", "--gas"),
                                          ("--deepspeed-confg", "--deepspeed-config")])
def test_a_flag_is_never_taken_by_its_prefix_and_an_unknown_one_is_answered(given, meant, capsys):
    from stepsync.tools import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["check", "--micro-batches-per-epoch", "3", given, "2"])
    assert stop.value.code == 2
    said = capsys.readouterr().err.strip()
    assert said.endswith(f"unrecognized arguments: {given} 2 (did you mean {meant}?)"), said


def test_verify_takes_checks_flag_name_for_the_deepspeed_config(tmp_path, capsys):
    from stepsync.tools import cli

    parsed = cli.build_parser().parse_args(["verify", "--deepspeed-config", "ds.json", "--gas", "2"])
    assert parsed.deepspeed == "ds.json"
    assert cli.build_parser().parse_args(["verify", "--deepspeed", "ds.json", "--gas", "2"]).deepspeed == "ds.json"
    help_text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["demo"].format_help().split())
    assert "without stepsync" not in help_text and "policy 'warn': stepsync only watches" in help_text


def test_the_readmes_commands_for_a_users_files_run_as_written(tmp_path, monkeypatch):
    """README.md's "Am I affected?" block, line by line, on files a user has (a TrainingArguments JSON, a DeepSpeed
    config, a Trainer's output folder): exit 0 or 1, never 2. verify, which trains a window, needs torch and
    DeepSpeed: without them it says so (exit 2), and the stacks run it (tests/integration/test_verify.py)."""
    import importlib.util
    import re

    from harness.stack import write_torch_archive

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = open(os.path.join(root, "README.md")).read()
    block = readme[readme.index("## Am I affected?"):]
    block = block[block.index("```bash") + 7:block.index("```", block.index("```bash") + 7)]
    lines = [re.sub(r"\s+#.*$", "", line).split() for line in block.strip().splitlines()]
    assert [line[1] for line in lines] == ["check", "check", "verify", "inspect"]
    write(tmp_path, "args.json", json.dumps({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4,
                                             "num_train_epochs": 3.0, "max_steps": -1, "deepspeed": "ds_config.json"}))
    write(tmp_path, "ds_config.json", json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                                  "gradient_accumulation_steps": "auto",
                                                  "zero_optimization": {"stage": 0}}))
    saved = tmp_path / "runs" / "my-job" / "checkpoint-2"
    (saved / "global_step2").mkdir(parents=True)
    (saved / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (saved / "latest").write_text("global_step2")
    write_torch_archive(saved / "global_step2" / "mp_rank_00_model_states.pt",
                        {"dp_world_size": 2, "ds_config": {"zero_optimization": {"stage": 0}}})
    trains = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("deepspeed") is not None
    monkeypatch.chdir(tmp_path)  # the lines name files relative to where the user stands
    for line in lines:
        proc = (stepsync_process(*line[1:], cwd=str(tmp_path), timeout=300) if line[1] == "verify" and trains
                else stepsync(*line[1:]))
        if line[1] == "verify" and not trains:
            assert proc.returncode == 2 and "stepsync verify runs DeepSpeed: it needs" in proc.stderr
            continue
        assert proc.returncode in (0, 1), (line, proc.stderr[-2000:])


@pytest.mark.reliability("bad_input")
@pytest.mark.parametrize("flag, content, said", [
    # trainer_state.json holds train_batch_size too: it was once taken for a DeepSpeed config
    ("--training-args", {"global_step": 6, "log_history": [], "train_batch_size": 2, "best_model_checkpoint": None},
     "is a Trainer's state (trainer_state.json, saved in every checkpoint-N)"),
    ("--deepspeed-config", {"output_dir": "out", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
     "is TrainingArguments: pass it as --training-args"),
    ("--training-args", {"per_device_train_batch_size": 2, "gradient_accumulation_step": 2},
     "gradient_accumulation_step in {path} is not a setting: did you mean gradient_accumulation_steps?"),
    ("--deepspeed-config", {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_step": 2},
     "gradient_accumulation_step in {path} is not a setting: did you mean gradient_accumulation_steps?"),
])
def test_a_file_of_another_kind_or_a_misspelt_key_is_named(tmp_path, flag, content, said):
    path = write(tmp_path, "given.json", json.dumps(content))
    proc = stepsync("check", "--samples", "8", "--gas", "2", flag, path)
    assert proc.returncode == 2 and said.format(path=path) in proc.stderr, proc.stderr


@pytest.mark.reliability("bad_input")
def test_the_trainers_binary_arguments_file_is_named_with_the_fix(tmp_path):
    path = tmp_path / "training_args.bin"
    path.write_bytes(b"PK\x03\x04\x80\x02binary pickle")
    proc = stepsync("check", "--samples", "8", "--training-args", str(path))
    assert proc.returncode == 2 and "is a binary file, not JSON" in proc.stderr
    assert "trainer.args.to_json_string()" in proc.stderr and "codec" not in proc.stderr


@pytest.mark.reliability("bad_input")
def test_verify_refuses_what_check_refuses(tmp_path):
    """A config whose own G contradicts --gas, and TrainingArguments given as the DeepSpeed config: both commands
    refuse them with the same words, before anything runs (no torch needed)."""
    own_g = write(tmp_path, "ds.json", json.dumps({"gradient_accumulation_steps": 4}))
    args = write(tmp_path, "args.json", json.dumps({"output_dir": "out", "per_device_train_batch_size": 2}))
    from stepsync.tools.verify import measuring_config
    from stepsync.core.errors import VerifyInputError

    with pytest.raises(VerifyInputError, match=r"sets gradient_accumulation_steps=4 but --gas says 2: the Trainer "
                                               r"refuses that mismatch; set gradient_accumulation_steps to \"auto\""):
        measuring_config(json.loads(open(own_g).read()), 2)
    checked = stepsync("check", "--samples", "8", "--gas", "2", "--deepspeed-config", own_g)
    assert checked.returncode == 2 and "sets gradient_accumulation_steps=4 but" in checked.stderr
    for command in (["check", "--samples", "8", "--gas", "2"], ["verify", "--gas", "2"]):
        proc = stepsync(*command, "--deepspeed-config", args)
        assert proc.returncode == 2 and "is TrainingArguments: pass it as --training-args" in proc.stderr, proc.stderr


def test_verify_of_an_fsdp2_loop_refuses_what_it_cannot_measure_before_anything_runs(tmp_path):
    """--framework fsdp measures FSDP2's window on one rank with the dtypes given; what does not fit is refused with
    the flag to change (no torch needed), and the dtype flags are refused for DeepSpeed, whose config sets them."""
    config = write(tmp_path, "ds.json", json.dumps({"gradient_accumulation_steps": 2}))
    cases = {
        ("--framework", "fsdp"): "--framework fsdp needs --gas G: the micro-batches per optimizer.step() your loop "
                                 "means",
        ("--framework", "fsdp", "--gas", "2", "--deepspeed-config", config): "--deepspeed-config: --framework fsdp "
        "measures FSDP2's window on one rank, with no DeepSpeed or Trainer file; leave it out",
        ("--framework", "fsdp", "--gas", "2", "--world-size", "2"): "--world-size: --framework fsdp measures",
        ("--framework", "ddp", "--gas", "2"): "stepsync verify measures a DeepSpeed engine or FSDP2's fully_shard; "
                                              "your DDP loop sums a window's gradients in its weights' dtype",
        ("--deepspeed-config", config, "--gas", "2", "--param-dtype", "bfloat16"): "--weights-dtype, --param-dtype, "
        "--reduce-dtype and --grad-dtype describe an FSDP2 model: use them with --framework fsdp",
    }
    for flags, said in cases.items():
        proc = stepsync("verify", *flags)
        assert proc.returncode == 2 and proc.stdout == "", (flags, proc)
        assert proc.stderr.startswith(f"stepsync: error: {said}"), (flags, proc.stderr)
    assert stepsync("verify", "--framework", "fsdp", "--gas", "2", "--param-dtype", "bf16").returncode == 2


def test_a_slow_op_build_is_said_before_it_starts(tmp_path):
    """An Adam/AdamW optimizer in the DeepSpeed config makes DeepSpeed compile fused_adam (cpu_adam where the
    optimizer is offloaded) when the engine is built; "torch_adam", a prebuilt op or one compiled before say
    nothing."""
    from stepsync.engine.deepspeed import slow_op_build

    adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    said = slow_op_build(adam, {}, [str(tmp_path)])
    assert said.startswith("DeepSpeed will compile its fused_adam op for this config's \"AdamW\" optimizer")
    assert '"torch_adam": true' in said
    offloaded = {**adam, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert "its cpu_adam op" in slow_op_build(offloaded, {}, [str(tmp_path)])
    assert slow_op_build({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, {}, []) == ""
    assert slow_op_build({"optimizer": {"type": "SGD"}}, {}, []) == ""
    assert slow_op_build({}, {}, []) == "" and slow_op_build(None, {}, []) == ""
    assert slow_op_build(adam, {"fused_adam": True}, []) == ""
    built = tmp_path / "py311_cpu" / "fused_adam"
    built.mkdir(parents=True)
    (built / "fused_adam.so").write_bytes(b"")
    assert slow_op_build(adam, {}, [str(tmp_path)]) == ""
    # compiled by another environment: torch's build file names that environment's torch, and this one builds again
    (built / "build.ninja").write_text("cflags = -isystem /other/env/site-packages/torch/include\n")
    assert slow_op_build(adam, {}, [str(tmp_path)], "/other/env/site-packages/torch") == ""
    assert "a build serves the environment that made it" in slow_op_build(adam, {}, [str(tmp_path)], "/this/torch")


def test_check_says_the_build_a_config_will_make(tmp_path):
    ds = write(tmp_path, "ds.json", json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    proc = stepsync("check", "--samples", "4", "--deepspeed-config", ds, "--json",
                    env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "HOME": str(tmp_path)})
    assert proc.returncode in (0, 1), proc.stderr
    assert any("DeepSpeed will compile its fused_adam op" in note for note in json.loads(proc.stdout)["notes"])


@pytest.mark.reliability("bad_input")
def test_a_resume_folder_that_does_not_exist_is_named_and_json_gets_its_error_as_json(tmp_path):
    missing = str(tmp_path / "checkpoint-9")
    proc = stepsync("check", "--samples", "8", "--gas", "2", "--resume-from", missing, "--json")
    assert proc.returncode == 2
    assert f"--resume-from {missing!r} does not exist: pass the checkpoint-N folder to resume" in proc.stderr
    said = json.loads(proc.stdout)
    assert said["exit_status"] == 2 and "does not exist" in said["error"]


def test_the_readmes_exit_statuses_are_every_status_the_command_line_ends_with():
    import re

    from stepsync.tools import cli

    readme = open(os.path.join(REPO, "README.md")).read()
    table = readme[readme.index("| exit status | meaning |"):].split("\n\n", 1)[0]
    documented = sorted(int(n) for n in re.findall(r"^\| (\d+) \|", table, re.M))
    ends = sorted(value for name, value in vars(cli).items() if name.startswith("EXIT_"))
    assert documented == ends == [0, 1, 2, 3, 130]


def flags_of(command):
    from stepsync.tools import cli

    parser = cli.build_parser()._subparsers._group_actions[0].choices[command]
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.reliability("bad_input")
def test_check_refuses_what_the_trainer_refuses_naming_each_key_and_both_values(tmp_path):
    """TrainingArguments with bf16=false and lr 5e-05, a DeepSpeed config with bf16 on and lr 1e-3: the Trainer
    refuses to start (tests/integration/test_trainer_refusals.py holds the words against it); check did say
    'aligned'."""
    args = write(tmp_path, "args.json", json.dumps({"output_dir": "out", "per_device_train_batch_size": 1,
                                                    "gradient_accumulation_steps": 2, "num_train_epochs": 2,
                                                    "bf16": False, "learning_rate": 5e-05}))
    ds = write(tmp_path, "ds.json", json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 0},
                                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    for transformers in ("5.24.0", "4.57.6"):
        proc = stepsync("check", "--samples", "13", "--epochs", "2", "--training-args", args, "--deepspeed-config",
                        ds, "--transformers", transformers, "--accelerate", "1.16.0", "--deepspeed", "0.19.8")
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout
        assert "the Trainer refuses to start with these DeepSpeed config values, which contradict the " \
               f"TrainingArguments in {args}:" in proc.stderr
        assert "- ds optimizer.params.lr=0.001 vs hf learning_rate=5e-05\n" in proc.stderr
        assert "- ds bf16.enabled=True vs hf bf16|bf16_full_eval=False\n" in proc.stderr


def test_the_trainers_auto_values_are_filled_before_the_weight_rows_are_read(tmp_path):
    """bf16 "auto" with TrainingArguments bf16=true is a bf16 run: DeepSpeed 0.18.9's bf16 optimizer fault (ZeRO-1,
    fp32 accumulation, two ranks) is named as for a config that says bf16 itself."""
    args = write(tmp_path, "args.json", json.dumps({"output_dir": "out", "per_device_train_batch_size": 1,
                                                    "gradient_accumulation_steps": 2, "bf16": True}))
    ds = write(tmp_path, "ds.json", json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 1},
                                                "data_types": {"grad_accum_dtype": "fp32"}}))
    proc = stepsync("check", "--samples", "8", "--world-size", "2", "--training-args", args, "--deepspeed-config",
                    ds, "--transformers", "5.24.0", "--accelerate", "1.16.0", "--deepspeed", "0.18.9", "--json")
    assert proc.returncode == 1 and any("0.18.9" in note and "bf16" in note for note in json.loads(proc.stdout)["notes"])


@pytest.mark.reliability("bad_input")
def test_verify_takes_checks_file_flags_and_every_hint_names_a_flag_it_has(tmp_path):
    args = write(tmp_path, "args.json", json.dumps({"output_dir": "out", "per_device_train_batch_size": 1,
                                                    "gradient_accumulation_steps": 4}))
    ds = write(tmp_path, "ds.json", json.dumps({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}))
    assert {"--training-args", "--deepspeed-config"} <= flags_of("verify") & flags_of("check")
    said = []
    for line in (["--deepspeed-config", args, "--gas", "4"], ["--training-args", args],
                 ["--training-args", args, "--deepspeed-config", ds], ["--deepspeed-config", ds]):
        proc = stepsync("verify", *line)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        said.append(proc.stderr)
    assert "is TrainingArguments: pass it as --training-args" in said[0]
    assert "names no DeepSpeed config: pass your DeepSpeed config as --deepspeed-config FILE" in said[1]
    assert "- ds bf16.enabled=True vs hf bf16|bf16_full_eval=False" in said[2]
    assert "gradient_accumulation_steps is not given: pass --gas" in said[3]
    import re

    named = {flag for text in said for flag in re.findall(r"(--[a-z][a-z-]+)", text)}
    assert named and named <= flags_of("verify"), named - flags_of("verify")


def test_verify_reads_g_from_the_training_arguments(tmp_path):
    """Without --gas, the TrainingArguments' G (4): verify goes as far as this environment lets it (torch is
    needed to train) with nothing refused."""
    args = write(tmp_path, "args.json", json.dumps({"output_dir": "out", "per_device_train_batch_size": 1,
                                                    "gradient_accumulation_steps": 4}))
    ds = write(tmp_path, "ds.json", json.dumps({"zero_optimization": {"stage": 0},
                                                "gradient_accumulation_steps": "auto"}))
    from stepsync.tools import cli

    parsed = cli.build_parser().parse_args(["verify", "--training-args", args, "--deepspeed-config", ds])
    assert parsed.gas is None and parsed.framework is None
    if importlib.util.find_spec("torch") is None:
        proc = stepsync("verify", "--training-args", args, "--deepspeed-config", ds)
        assert proc.returncode == 2 and "stepsync verify runs DeepSpeed: it needs" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args", [
    ["--samples", "8", "--gas", "2", "--accelerate", "1.16.0"],
    ["--samples", "3", "--gas", "2", "--epochs", "2", "--accelerate", "1.7.0"],
    ["--samples", "8", "--world-size", "2", "--accelerate", "1.16.0", "--deepspeed", "0.18.9", "--deepspeed-config",
     "BF16_ZERO1"],
    ["--samples", "8", "--world-size", "2", "--accelerate", "1.16.0", "--deepspeed", "0.19.8", "--deepspeed-config",
     "BF16_ZERO1"],
])
def test_the_printed_verdict_agrees_with_the_exit_status(tmp_path, args):
    """A weight fault that is certain makes check exit 1: the verdict line then says 'affected' too (it said
    'aligned' above the fault)."""
    ds = write(tmp_path, "ds.json", json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                                "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                                                "data_types": {"grad_accum_dtype": "fp32"}}))
    args = [ds if arg == "BF16_ZERO1" else arg for arg in args]
    proc = stepsync("check", "--transformers", "5.24.0", *args)
    data = json.loads(stepsync("check", "--transformers", "5.24.0", *args, "--json").stdout)
    assert proc.returncode in (0, 1) and data["verdict"].split(":")[0] == ("aligned", "affected")[proc.returncode]
    assert ("affected: " in proc.stdout) == (proc.returncode == 1) != ("aligned: " in proc.stdout), proc.stdout


@pytest.mark.parametrize("framework", ["fsdp", "ddp"])
def test_a_torch_loops_forecast_names_torch_not_the_trainers_releases(framework):
    """A torch-native loop's count is decided by torch alone: the forecast's caption names torch, as installed here."""
    proc = stepsync("check", "--framework", framework, "--micro-batches-per-epoch", "5", "--gas", "2", "--epochs", "2")
    installed = importlib.util.find_spec("torch") is not None
    assert proc.returncode == 0, proc.stderr
    assert ("torch not installed here" in proc.stdout) is not installed and "transformers" not in proc.stdout
