"""``stepsync`` command line: ``check`` (forecast a configuration) and ``demo`` (a live CPU run)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .choices import Policy
from .forecast import RunPlan, forecast
from .versions import NEWEST, Stack, behaviour_of, installed_version

EXIT_ALIGNED, EXIT_DRIFTS, EXIT_BAD_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit 2 with the fix, never a traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"stepsync: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stepsync", description=__doc__,
                     epilog="example: stepsync check --samples 3 --gas 2 --epochs 2 --accelerate 1.7.0")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = commands.add_parser(
        "check", help="forecast a configuration without training",
        epilog="example: stepsync check --samples 3 --batch-size 1 --gas 2 --epochs 2 --accelerate 1.7.0 --json")
    size = check.add_mutually_exclusive_group(required=True)
    size.add_argument("--samples", type=_positive, help="training set length")
    size.add_argument("--micro-batches-per-epoch", type=_positive, help="len(train_dataloader) on one rank")
    check.add_argument("--batch-size", type=_positive, default=1, help="per-device batch size (default 1)")
    check.add_argument("--world-size", type=_positive, default=1, help="number of ranks (default 1)")
    check.add_argument("--gas", type=_positive, required=True, help="gradient_accumulation_steps")
    check.add_argument("--epochs", type=float, default=None, help="num_train_epochs (default 1)")
    check.add_argument("--max-steps", type=_positive, default=None, help="max_steps (overrides --epochs)")
    check.add_argument("--drop-last", action="store_true", help="dataloader_drop_last=True")
    check.add_argument("--policy", default="warn", help=f"one of {', '.join(p.value for p in Policy)}")
    for package in ("transformers", "accelerate", "deepspeed"):
        check.add_argument(f"--{package}", default=None, help=f"{package} version (default: installed, else newest)")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    demo = commands.add_parser("demo", help="a real Trainer + DeepSpeed run on CPU, live",
                               epilog="example: stepsync demo --compare")
    demo.add_argument("--policy", default="warn", help=f"one of {', '.join(p.value for p in Policy)}")
    demo.add_argument("--compare", action="store_true", help="run without stepsync and with 'sync', side by side")
    demo.add_argument("--samples", type=_positive, default=3)
    demo.add_argument("--gas", type=_positive, default=2)
    demo.add_argument("--epochs", type=_positive, default=2)
    return parser


def _micro_batches(args) -> int:
    if args.micro_batches_per_epoch:
        return args.micro_batches_per_epoch
    per_rank = -(-args.samples // args.world_size)  # the distributed sampler pads
    return per_rank // args.batch_size if args.drop_last else -(-per_rank // args.batch_size)


def run_check(args) -> int:
    from rich.console import Console

    from .render import forecast_view

    if args.epochs is not None and args.epochs <= 0:
        raise ValueError(f"--epochs must be > 0, got {args.epochs}")
    stack = Stack(*(getattr(args, p) or installed_version(p) or NEWEST for p in ("transformers", "accelerate", "deepspeed")))
    plan = RunPlan(_micro_batches(args), args.gas, args.epochs or 1.0, args.max_steps or -1)
    if plan.micro_batches_per_epoch < 1:
        raise ValueError("no full batch per epoch: lower --batch-size or drop --drop-last")
    result = forecast(plan, behaviour_of(stack), Policy.parse(args.policy))
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        Console().print(forecast_view(result))
    return EXIT_ALIGNED if result.aligned else EXIT_DRIFTS


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "check":
            return run_check(args)
        from .demo import run_demo

        return run_demo(args)
    except ValueError as exc:
        print(f"stepsync: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
