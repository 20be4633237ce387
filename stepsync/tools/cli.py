"""The ``stepsync`` command line: check, inspect, verify and demo. Exit codes: 0 aligned, 1 drift, 2 bad input."""
from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import traceback
from typing import List, Optional

from rich.console import Console

from .._version import __version__
from ..core.choices import Policy
from ..core.errors import ConfigInputError, StepSyncError
from ..core.forecast import forecast
from ..core.frameworks import DEEPSPEED_LOOP, LIGHTNING, TRAINER, framework_called, known_frameworks
from ..core.install import install_hint, training_install_hint
from ..core.plan import RunPlan
from ..core.record import TRAINER_STATE, load_record, read_json
from ..core.relayout import Layout
from ..core.releases import behaviour_at
from ..core.tokens import trl_generation_scale
from ..core.versions import assumed_release, installed_version
from ..display.render import audit_view, forecast_view, print_view
from ..engine.deepspeed import op_builds_of
from .arguments import policy_name, positive_epochs, positive_int
from .audit import audit_output_dir
from .config import (
    read_files,
    resolve,
    versions_for,
    weight_faults_of,
)
from .demo import run_demo
from .fsdp_measurement import add_dtype_flags, refuse_dtype_flags, verify_sharded_command
from .resume_audit import planned_here, resume_on
from .verify import measuring_config, verify_command

EXIT_ALIGNED, EXIT_DRIFTS, EXIT_BAD_INPUT, EXIT_BUG, EXIT_INTERRUPTED = 0, 1, 2, 3, 130  # 130: Ctrl-C (SIGINT)
POLICIES = ", ".join(p.value for p in Policy)
DESCRIPTION = """Keep transformers' Trainer and the DeepSpeed engine agreeing on the optimizer step count.

commands:
  check     forecast a configuration without training (light: needs neither torch nor DeepSpeed)
  inspect   audit the checkpoints of a Trainer output directory (light)
  verify    measure what the installed DeepSpeed does with your config: each micro-batch's weight in one
            real window, a non-finite loss, the clip norm in force (needs torch and deepspeed)
  demo      a real Trainer + DeepSpeed run on CPU, live (needs the training packages)

exit status: 0 aligned or consistent, 1 drift, an early end or a mismatch, 2 bad input, 3 a bug in stepsync
(its traceback is printed), 130 interrupted (Ctrl-C). A reader that closes the pipe early (| head) changes none."""
INSTALL_TRAINING = (f"{training_install_hint('trainer')} (or: bash scripts/demo.sh, which builds its own "
                    "environment)")


# Names users bring from other tools, and the flag that means the same here.
SAME_AS = {"--grad-accum": "--gas", "--gradient-accumulation-steps": "--gas", "--gradient_accumulation_steps": "--gas",
           "--accumulate-grad-batches": "--gas", "--num-train-epochs": "--epochs", "--num_train_epochs": "--epochs",
           "--per-device-train-batch-size": "--batch-size", "--per_device_train_batch_size": "--batch-size",
           "--num-processes": "--world-size", "--nproc-per-node": "--world-size", "--deepspeed": "--deepspeed-config"}


class Parser(argparse.ArgumentParser):
    """argparse without prefixes (``--sample`` is not ``--samples``), and an unknown flag answered with the one it
    likely means."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            parsers = [self, *(choice for group in (self._subparsers._group_actions if self._subparsers else ())
                               for choice in getattr(group, "choices", {}).values())]
            known = [flag for parser in parsers for action in parser._actions for flag in action.option_strings]
            for given in message.split(":", 1)[1].split():
                name = given.split("=", 1)[0]
                if not name.startswith("--"):
                    continue
                meant = SAME_AS.get(name) if SAME_AS.get(name) in known else None
                meant = meant or next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.75)), None)
                if meant:
                    message += f" (did you mean {meant}?)"
                    break
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="stepsync", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: stepsync check --samples 3 --gas 2 --epochs 2 --accelerate 1.7.0")
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    check = commands.add_parser(
        "check", help="forecast a configuration without training",
        description="Forecast both counters per epoch; exit 0 when aligned, 1 when it drifts or the Trainer "
                    "ends before the epochs asked for, 2 on bad input.",
        epilog="example: stepsync check --samples 3 --batch-size 1 --gas 2 --epochs 2 --accelerate 1.7.0 --json\n"
               "example: stepsync check --samples 1000 --training-args args.json --deepspeed-config ds.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    size = check.add_mutually_exclusive_group()
    size.add_argument("--samples", type=positive_int, help="training set length")
    size.add_argument("--micro-batches-per-epoch", dest="micro_batches", type=positive_int,
                      help="len(train_dataloader) on one rank")
    check.add_argument("--batch-size", type=positive_int, help="per-device batch size (default 1)")
    check.add_argument("--world-size", type=positive_int, help="number of ranks (default 1)")
    check.add_argument("--gas", type=positive_int, help="gradient_accumulation_steps")
    check.add_argument("--epochs", type=positive_epochs, help="num_train_epochs (default 1)")
    check.add_argument("--max-steps", type=positive_int, help="max_steps (overrides --epochs)")
    check.add_argument("--drop-last", action="store_true", default=None, help="dataloader_drop_last=True")
    check.add_argument("--policy", type=policy_name, default=Policy.WARN, help=f"one of {POLICIES}")
    check.add_argument("--training-args", metavar="FILE", help="a TrainingArguments JSON (args.to_json_string())")
    check.add_argument("--deepspeed-config", metavar="FILE",
                       help="DeepSpeed's JSON ('auto' resolved as the Trainer does)")
    for package in ("transformers", "accelerate", "deepspeed"):
        check.add_argument(f"--{package}", default=None, help=f"{package} version (default: installed, else newest)")
    check.add_argument("--framework", choices=[framework.key for framework in known_frameworks()], default=TRAINER.key,
                       help="who counts the updates: transformers' Trainer (default), PyTorch Lightning, an "
                            "accelerate loop (accumulate()), or a Fabric loop (no_backward_sync)")
    check.add_argument("--lightning", default=None, help="lightning version (default: installed, else the newest "
                                                         "probed), with --framework lightning")
    check.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                       help="DeepSpeed's ZeRO stage (default: the --deepspeed-config's, else unknown): whether "
                            "Lightning's zero_grad clears what the engine still accumulates")
    check.add_argument("--resume-from", metavar="CHECKPOINT", default=None,
                       help="a checkpoint-N folder saved with stepsync: forecast the resume of it on this "
                            "configuration's layout (--world-size, --batch-size, --gas): the samples the Trainer "
                            "would skip or train twice")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    inspect = commands.add_parser(
        "inspect", help="audit the checkpoints of a Trainer output directory",
        description="Compare every checkpoint-N with DeepSpeed's tag and stepsync's record, and check that every "
                    "DeepSpeed file a resume reads is there and whole; exit 1 on any mismatch or broken checkpoint, "
                    "2 when the path is not an output directory.",
        epilog="example: stepsync inspect runs/my-job --json\nexample: stepsync inspect runs/my-job/checkpoint-800",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    inspect.add_argument("output_dir", help="the Trainer's output_dir (every checkpoint in it), or one checkpoint-N "
                                            "folder (that checkpoint only)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--framework", choices=[framework.key for framework in known_frameworks()], default=None,
                         help="the framework that saved the checkpoints (default: told by the folders): trainer "
                              "(checkpoint-N) or accelerate (accelerator.save_state); a folder the other saved is "
                              "refused")
    inspect.add_argument("--quick", action="store_true",
                         help="check each DeepSpeed file's structure, not every tensor's checksum (which reads "
                              "every byte of the checkpoint)")
    inspect.add_argument("--world-size", type=positive_int, default=None,
                         help="say whether each checkpoint resumes on this many data-parallel ranks: DeepSpeed's "
                              "refusal and its fix, and the samples the Trainer would skip or train twice")
    inspect.add_argument("--batch-size", type=positive_int, default=None,
                         help="with --world-size: the resume's per-device batch (default: as saved)")
    inspect.add_argument("--gas", type=positive_int, default=None,
                         help="with --world-size: the resume's gradient_accumulation_steps (default: as saved)")
    inspect.add_argument("--examples", type=positive_int, default=None,
                         help="with --world-size, for checkpoints saved without stepsync: the training set's length "
                              "(the layout is then read from their files)")
    verify = commands.add_parser(
        "verify", help="measure what the installed DeepSpeed does with your config",
        description="One real window through an engine built from your config: each micro-batch's weight in "
                    "the update, a non-finite loss, the clip in force. Exit 0: every weight is 1/G; 1: one is "
                    "not; 2: a config it cannot run.",
        epilog="example: stepsync verify --deepspeed-config ds_config.json --gas 4 --json\n"
               "example: stepsync verify --deepspeed-config ds_config.json --gas 4 --world-size 2\n"
               "example: stepsync verify --framework fsdp --gas 4 --param-dtype bfloat16 --reduce-dtype float32",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("--deepspeed-config", "--deepspeed", dest="deepspeed", metavar="FILE",
                        help="your DeepSpeed JSON config (check's flag name; --deepspeed works too); optional where "
                             "--training-args names it")
    verify.add_argument("--training-args", metavar="FILE",
                        help="your TrainingArguments JSON (args.to_json_string()), as check reads it: its G, the "
                             "DeepSpeed config it names, and the 'auto' values the Trainer fills from it")
    verify.add_argument("--gas", type=positive_int,
                        help="gradient_accumulation_steps (default: the --training-args', else the config's own)")
    verify.add_argument("--framework", choices=[framework.key for framework in known_frameworks()], default=None,
                        help="call backward as this framework does (default: the Trainer with --training-args, "
                             "else a plain DeepSpeed loop)")
    verify.add_argument("--world-size", type=positive_int, default=1,
                        help="measure on this many local processes (gloo): what only several ranks show")
    add_dtype_flags(verify)
    verify.add_argument("--verbose", action="store_true", help="show DeepSpeed's own output (on stderr)")
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    demo = commands.add_parser(
        "demo", help="a real Trainer + DeepSpeed run on CPU, live",
        description="A tiny GPT-2 built from a config, trained by the real Trainer and DeepSpeed on CPU.",
        epilog="example: stepsync demo --compare\nexample: stepsync demo --policy realign --samples 5 --gas 2",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--policy", type=policy_name, default=Policy.WARN, help=f"one of {POLICIES}")
    demo.add_argument("--compare", action="store_true",
                      help="the run as it is (policy 'warn': stepsync only watches) and with 'sync', side by side")
    demo.add_argument("--samples", type=positive_int, default=3, help="micro-batches per epoch (default 3)")
    demo.add_argument("--gas", type=positive_int, default=2, help="gradient_accumulation_steps (default 2)")
    demo.add_argument("--epochs", type=positive_int, default=2, help="epochs (default 2)")
    demo.add_argument("--framework", choices=tuple(DEMOS), default="trainer",
                      help="the Trainer (default) or PyTorch Lightning (warn, then sync; its own process)")
    return parser


def run_check(args) -> int:
    framework = framework_called(args.framework)
    framework.parse_policy(args.policy, as_flag=True)
    if args.lightning and "lightning" not in framework.packages:
        raise ConfigInputError(f"--lightning {args.lightning} describes a Lightning run: add --framework lightning "
                               "(or fabric)")
    flags = {"samples": args.samples, "micro_batches": args.micro_batches, "batch_size": args.batch_size,
             "world_size": args.world_size, "gas": args.gas, "epochs": args.epochs, "max_steps": args.max_steps,
             "drop_last": args.drop_last}
    assumed: List[str] = []
    versions = versions_for({p: getattr(args, p) for p in ("transformers", "accelerate", "deepspeed", "lightning")},
                            assumed, framework.packages)
    files = read_files(args.training_args, args.deepspeed_config, flags, versions["transformers"])
    deepspeed = files.deepspeed
    inputs = resolve(flags, files.training, files.agreeing)
    notes = list(inputs.notes)
    if args.training_args and deepspeed is None:
        notes.append(f"{args.training_args} names no DeepSpeed config: the forecast assumes the run uses DeepSpeed; "
                     "if it is launched with accelerate's DeepSpeed plugin, pass --deepspeed-config with the "
                     "plugin's config file")
    notes += assumed
    stated = args.world_size is not None or inputs.world_size_inferred
    faults, certain = weight_faults_of(deepspeed, versions["deepspeed"], inputs.gradient_accumulation_steps,
                                       framework.backward_call, inputs.world_size if stated else None)
    notes += faults
    notes += op_builds_of(deepspeed, deepspeed is not None and os.environ.get("DS_ACCELERATOR") == "cpu")
    if files.arguments is not None:  # a TRL config's GRPO loss, against the installed TRL
        scaled = trl_generation_scale(installed_version("trl"), files.arguments.get("loss_type"),
                                      files.arguments.get("steps_per_generation"), inputs.gradient_accumulation_steps)
        notes += [scaled] if scaled else []
        certain = certain or bool(scaled)
    stage = args.zero_stage if args.zero_stage is not None else ((deepspeed or {}).get("zero_optimization") or {}).get(
        "stage")
    behaviour = behaviour_at(framework, versions)
    plan = RunPlan(inputs.micro_batches_per_epoch, inputs.gradient_accumulation_steps, inputs.num_train_epochs,
                   inputs.max_steps, examples_per_epoch=inputs.samples,
                   zero_stage=stage if isinstance(stage, int) else None)
    result = forecast(plan, behaviour, args.policy)
    files.refuse_what_the_trainer_refuses(inputs.world_size if stated else None, result.planned_steps)
    notes += list(result.behaviour.caveats)
    if args.resume_from:
        result.resume_shift = resume_of(args.resume_from, inputs, behaviour)
        notes.append(result.resume_shift.message() if result.resume_shift is not None else
                     f"a resume of {args.resume_from} keeps its layout: it lands where the run stood")
    said = result.verdict()
    if certain and said.startswith("aligned: "):  # the counts agree, the updates do not: the verdict says both
        said = (f"affected: {said[len('aligned: '):]}, but the updates themselves are wrong in this configuration "
                "(the notes below say how, and the fix)")
    if args.json:
        data = result.to_dict()
        data["verdict"] = said
        data["inputs"] = {"micro_batches_per_epoch": inputs.micro_batches_per_epoch, "batch_size": inputs.batch_size,
                          "world_size": inputs.world_size, "world_size_inferred": inputs.world_size_inferred,
                          "drop_last": inputs.drop_last}
        data["notes"] = notes
        print(json.dumps(data))
    else:
        print_view(Console(), forecast_view(result, notes, said))
    return EXIT_ALIGNED if result.sound and not certain else EXIT_DRIFTS


def resume_of(folder: str, inputs, behaviour):
    """The shift of resuming checkpoint ``folder`` on ``inputs``' layout (ValueError naming the fix if no record)."""
    if not os.path.isdir(folder):
        raise ConfigInputError(f"--resume-from {folder!r} does not exist: pass the checkpoint-N folder to resume")
    record = load_record(folder)
    if record is None or record.layout is None or record.examples is None:
        raise ConfigInputError(f"{folder!r} holds no stepsync record with the layout it was saved on: pass a "
                               "checkpoint-N folder saved by a run with StepSyncCallback")
    layout = Layout(inputs.world_size, inputs.batch_size, inputs.gradient_accumulation_steps, record.examples)
    state = read_json(os.path.join(folder, TRAINER_STATE), "the checkpoint's trainer_state.json")
    epochs = state.get("num_train_epochs")
    step = record.resume_steps if record.resume_steps is not None else record.trainer_steps
    return record.resume_on(layout, step, behaviour.planned_steps, epochs if isinstance(epochs, int) else None)


def run_inspect(args) -> int:
    framework = framework_called(args.framework) if args.framework else None
    audit = audit_output_dir(args.output_dir, not args.quick, framework)  # a checkpoint-N folder: that one only
    resumes = []
    if args.world_size is not None:
        planned = planned_here()
        resumes = [resume_on(item, args.world_size, planned, args.batch_size, args.gas, args.examples)
                   for item in audit.checkpoints]
    elif args.batch_size is not None or args.gas is not None or args.examples is not None:
        raise ConfigInputError("--batch-size, --gas and --examples describe a resume: give --world-size too")
    # On another number of ranks: the newest checkpoint that is whole and that DeepSpeed loads there.
    here = next((item.name for item, resume in zip(reversed(audit.checkpoints), reversed(resumes))
                 if item.ok and resume.works), None)
    if args.json:
        print(json.dumps({**audit.to_dict(), **({"resume_on": [r.to_dict() for r in resumes],
                                                 "safe_to_resume_on_world_size": here} if resumes else {})}))
    else:
        console = Console()
        print_view(console, audit_view(audit))
        for resume in resumes:
            for line in resume.lines():
                console.print(line, style="green" if resume.works else "bold yellow", highlight=False)
        if resumes:
            console.print(f"on {args.world_size} rank(s): " + (f"safe to resume from: {here}" if here else
                          "no checkpoint resumes as it stands (the lines above say why, and the fix)"),
                          style="green" if here else "bold yellow", highlight=False)
    return EXIT_ALIGNED if audit.ok and all(r.works for r in resumes) else EXIT_DRIFTS


def run_verify(args) -> int:
    # what it refuses is said before anything else, as check says it
    framework = framework_called(args.framework or (TRAINER if args.training_args else DEEPSPEED_LOOP).key)
    if not framework.backward_call.through_an_engine:
        code = verify_sharded_command(framework, args)
        end_after_a_process_group(code)
        return code
    refuse_dtype_flags(args)
    transformers = installed_version("transformers") or assumed_release("transformers")
    files = read_files(args.training_args, args.deepspeed, {"gas": args.gas}, transformers)
    if files.deepspeed is None:
        raise ConfigInputError((f"{args.training_args} names no DeepSpeed config: " if args.training_args else "")
                               + "pass your DeepSpeed config as --deepspeed-config FILE")
    files.refuse_what_the_trainer_refuses()
    config = files.deepspeed
    gas = args.gas or (files.training or {}).get("gas") or config.get("gradient_accumulation_steps")
    if not isinstance(gas, int) or isinstance(gas, bool):
        raise ConfigInputError("gradient_accumulation_steps is not given: pass --gas, or a --training-args or "
                               "--deepspeed-config file that sets it")
    measuring_config(config, gas, args.world_size)
    missing = [p for p in ("torch", "deepspeed") if installed_version(p) is None]
    if missing:
        print(f"stepsync: error: stepsync verify runs DeepSpeed: it needs {', '.join(missing)}: {INSTALL_TRAINING}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    code = verify_command(config, gas, args.json, framework.key, args.world_size, args.verbose)
    end_after_a_process_group(code)
    return code


def end_after_a_process_group(code: int) -> None:
    """Exit at once where the command started torch's process group (verify's one process): left to the interpreter's
    exit, gloo's threads sometimes abort a process whose work is done (``terminate called without an active
    exception``, exit -6) after the verdict was printed."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_trainer_demo(args) -> int:
    missing = [p for p in ("torch", "transformers", "accelerate", "deepspeed") if installed_version(p) is None]
    if missing:  # the light install: the demo trains, so it needs the training packages
        print(f"stepsync: error: stepsync demo needs {', '.join(missing)}: {INSTALL_TRAINING}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run_demo(args)


def run_lightning_demo(args) -> int:
    """The Lightning demo runs in a process of its own: this command line never imports Lightning."""
    remedy = LIGHTNING.parse_policy(Policy.SYNC if args.policy.watches_only else args.policy, as_flag=True)
    missing = [p for p in ("torch", "lightning", "deepspeed") if installed_version(p) is None]
    if missing:
        print(f"stepsync: error: stepsync demo --framework lightning needs {', '.join(missing)}: "
              f"{training_install_hint('lightning')} (or: bash scripts/demo.sh --framework lightning)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    return subprocess.call([sys.executable, "-m", "stepsync.tools.demo_lightning", "--samples", str(args.samples),
                            "--gas", str(args.gas), "--epochs", str(args.epochs), "--policy", remedy.value])


# The demos by name (each its own program: the Lightning one runs in a process of its own).
DEMOS = {"trainer": run_trainer_demo, "lightning": run_lightning_demo}


def version_line() -> str:
    found = ", ".join(f"{p} {installed_version(p) or 'not installed'}" for p in ("transformers", "accelerate",
                                                                                 "deepspeed", "torch"))
    return f"stepsync {__version__} ({found})"


class ReaderMayLeave:
    """A stream that drops what it is given once its reader has closed the pipe (``| head``): the command goes on
    to its verdict, and its exit status is the verdict's whatever the reader read."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.reader_left = False

    def write(self, text: str) -> int:
        if not self.reader_left:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._left()
        return len(text)

    def flush(self) -> None:
        if not self.reader_left:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._left()

    def _left(self) -> None:
        self.reader_left = True
        # What the stream still buffers goes nowhere at the interpreter's own flush, instead of failing there.
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def main(argv: Optional[List[str]] = None) -> int:
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ReaderMayLeave(sys.stdout), ReaderMayLeave(sys.stderr)
    try:
        return run_command(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams


def run_command(argv: Optional[List[str]]) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "check":
            return run_check(args)
        if args.command == "inspect":
            return run_inspect(args)
        if args.command == "verify":
            return run_verify(args)
        return DEMOS[args.framework](args)
    except StepSyncError as exc:  # only stepsync's own: any other error is a bug, shown with its traceback
        print(f"stepsync: error: {exc}", file=sys.stderr)
        if "--json" in (sys.argv[1:] if argv is None else argv):  # a reader of stdout gets one object either way
            print(json.dumps({"error": str(exc), "exit_status": EXIT_BAD_INPUT}))
        return EXIT_BAD_INPUT
    except ImportError as exc:  # run without installing stepsync's own requirements
        print(f"stepsync: error: a package stepsync needs is missing ({exc}): {install_hint()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C ends quietly
        return EXIT_INTERRUPTED
    except Exception:  # a bug: shown as one, with a status no verdict has
        traceback.print_exc()
        print(f"stepsync: error: stepsync {__version__} failed (a bug in stepsync, not in your run): the traceback "
              "above says where", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
