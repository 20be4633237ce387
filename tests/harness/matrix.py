"""The support table: what each tested stack does, without stepsync and under each policy, from real runs.

``scripts/support_table.sh`` runs :func:`measure` with every stack's python, stores each result in
``tests/support/<stack>.json`` and rewrites docs/releases.md's table with :func:`render_table`; the tests
re-run the cases on the stack they run on and compare with the stored file, and compare docs/releases.md
with the stored files. Everything here but :func:`measure` is pure.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

POLICIES = ("none", "sync", "realign", "drop_last")
TABLE_START = "<!-- support-table:start (scripts/support_table.sh writes this) -->"
TABLE_END = "<!-- support-table:end -->"


@dataclass(frozen=True)
class Case:
    """One run shape on one rank: ``samples`` in batches of ``batch``, G, epochs, and ``max_steps`` (-1: from the
    epochs)."""

    samples: int
    gas: int
    epochs: int
    max_steps: int = -1
    batch: int = 1

    def label(self) -> str:
        steps = f", max_steps={self.max_steps}" if self.max_steps > 0 else ""
        if self.batch == 1:
            return f"N={self.samples}, G={self.gas}, E={self.epochs}{steps}"
        micro = -(-self.samples // self.batch)
        return f"{self.samples} samples, batch {self.batch} (N={micro}), G={self.gas}, E={self.epochs}{steps}"

    def to_dict(self) -> dict:
        data = dict(self.__dict__)
        if self.batch == 1:
            del data["batch"]  # the stored files of batch-1 cases stay as they were
        return data


@dataclass(frozen=True)
class StackSpec:
    """One tested stack: its pins, the day its other dependencies are resolved as of, and its cases.

    ``extras`` are packages its tests need beyond the three pins (clients such as TRL and PEFT, the
    notebook's matplotlib); ``scripts/stack.sh NAME`` builds it.
    """

    name: str
    transformers: str
    accelerate: str
    deepspeed: str
    as_of: str
    shows: str
    cases: Tuple[Case, ...]
    extras: Tuple[str, ...] = ()

    def requirements(self) -> List[str]:
        return [f"transformers=={self.transformers}", f"accelerate=={self.accelerate}",
                f"deepspeed=={self.deepspeed}", *self.extras, *TEST_REQUIREMENTS]


# The trackers whose readers the tests read back what stepsync logged (tests/integration/test_trackers.py).
TRACKERS = ("tensorboard==2.21.0", "mlflow-skinny==3.18.0", "wandb==0.31.0")

# What every stack's tests need; resolved as of the stack's day like everything else.
TEST_REQUIREMENTS = ("rich", "pytest", "hypothesis", "nbclient", "ipykernel", "setuptools<81")

# The test matrix: each behaviour change the probes found (probes/*.json, stepsync/core/versions.py), measured on
# both sides with real DeepSpeed runs. Stacks sharing a DeepSpeed release share its compiled op. transformers
# 4.57 and 5.0 fill DeepSpeed's warmup_num_steps with 0, which DeepSpeed 0.19.5 and later refuse: they get 0.18.4
# (January 2026).
STACKS = (
    StackSpec("aligned", "5.24.0", "1.16.0", "0.19.8", "2026-11-30", "no drift", (Case(3, 2, 2), Case(7, 3, 2)),
              extras=("ray[train]==2.60.0",)),
    StackSpec("drifting", "5.24.0", "1.7.0", "0.19.8", "2026-11-30", "Trainer ahead by up to 1 per epoch",
              (Case(3, 2, 2), Case(7, 3, 2)), extras=("matplotlib", "trl==1.14.2", "peft==0.21.2", *TRACKERS)),
    StackSpec("t447", "4.47.1", "1.2.1", "0.16.2", "2025-01-15", "4.47.1 counts across epochs (max_steps=4)",
              (Case(3, 2, 2, max_steps=4), Case(7, 3, 2, max_steps=4))),
    StackSpec("t445", "4.45.2", "0.34.2", "0.15.4", "2024-10-15", "drift only when N <= G",
              (Case(3, 4, 2), Case(7, 3, 2))),
    StackSpec("t424", "4.24.0", "0.15.0", "0.14.5", "2024-07-15", "engine ahead (negative drift)",
              (Case(3, 2, 3), Case(7, 3, 2))),
    StackSpec("t427", "4.27.0", "0.18.0", "0.14.5", "2024-07-15", "first release counting across epochs",
              (Case(3, 4, 2), Case(5, 2, 3))),
    StackSpec("t439", "4.39.3", "0.29.3", "0.14.5", "2024-07-15", "accelerate's wrapper calls engine.step()",
              (Case(3, 4, 2), Case(5, 2, 3))),
    StackSpec("t446", "4.46.3", "1.1.1", "0.15.4", "2024-12-15", "epochs cut by num_examples % G",
              (Case(5, 2, 3), Case(10, 3, 2, batch=2))),
    StackSpec("t451", "4.51.3", "1.6.0", "0.16.2", "2025-05-15", "last floor plan: stops after 2 of 3 epochs",
              (Case(5, 2, 3), Case(10, 3, 2, batch=2))),
    StackSpec("t452", "4.52.0", "1.7.0", "0.16.2", "2025-06-15", "first ceil plan",
              (Case(5, 2, 3), Case(10, 3, 2, batch=2))),
    StackSpec("t457", "4.57.6", "1.7.0", "0.18.4", "2026-01-31", "last 4.x, accelerate 1.7",
              (Case(3, 2, 2), Case(7, 3, 2))),
    StackSpec("t457f", "4.57.6", "1.8.0", "0.18.4", "2026-01-31", "last 4.x, accelerate 1.8 (the fix)",
              (Case(3, 2, 2), Case(7, 3, 2))),
    StackSpec("t500", "5.0.0", "1.7.0", "0.18.4", "2026-02-15", "5.0 with accelerate 1.7",
              (Case(3, 2, 2), Case(7, 3, 2))),
    StackSpec("d183", "5.24.0", "1.16.0", "0.18.3", "2026-11-30", "DeepSpeed 0.18.3 divides the Trainer's loss twice",
              (Case(3, 2, 2), Case(7, 3, 2))),
    StackSpec("d189", "5.24.0", "1.16.0", "0.18.9", "2026-11-30",
              "DeepSpeed 0.18.9's bf16 optimizer leaves each window's last micro-batch out of the average across ranks",
              (Case(3, 2, 2), Case(7, 3, 2))),
    StackSpec("a18", "4.57.6", "1.8.0", "0.18.2", "2026-01-31", "accelerate 1.8's no_sync on DeepSpeed 0.18.2",
              (Case(3, 2, 2), Case(7, 3, 2))),
)


@dataclass(frozen=True)
class LightningSpec:
    """One tested PyTorch Lightning stack: its pins and the day its other dependencies are resolved as of."""

    name: str
    lightning: str
    deepspeed: str
    as_of: str
    shows: str
    extras: Tuple[str, ...] = ()

    def requirements(self) -> List[str]:
        return [f"lightning=={self.lightning}", f"deepspeed=={self.deepspeed}", "numpy<2", *self.extras,
                *TEST_REQUIREMENTS]


# Every Lightning release probed (probes/lightning.json), with a DeepSpeed that runs on CPU: the oldest one that
# does is 0.14.5, which the releases before DeepSpeed 0.19 get.
LIGHTNING_STACKS = (
    LightningSpec("lightning", "2.6.6", "0.19.8", "2026-11-30", "newest Lightning", extras=TRACKERS),
    LightningSpec("l240", "2.4.0", "0.14.5", "2024-08-15", "Lightning 2.4"),
    LightningSpec("l225", "2.2.5", "0.14.5", "2024-07-15", "Lightning 2.2"),
    LightningSpec("l209", "2.0.9", "0.14.5", "2024-07-15", "Lightning 2.0"),
)


@dataclass(frozen=True)
class TorchSpec:
    """A stack of torch alone (the CPU build every stack gets) and the tests' tools: what a torch-native loop's
    watch needs, with no transformers, accelerate or DeepSpeed installed."""

    name: str
    as_of: str
    shows: str

    def requirements(self) -> List[str]:
        return ["numpy", *TEST_REQUIREMENTS]  # torch.distributed.checkpoint needs numpy, which torch leaves out


TORCH_STACKS = (TorchSpec("torch", "2026-11-30", "torch alone: the FSDP2 and DDP watches without the others"),)


def every_stack() -> tuple:
    """Every stack of the matrix: the Trainer's, Lightning's and torch's alone."""
    return (*STACKS, *LIGHTNING_STACKS, *TORCH_STACKS)


# Which tests each stack runs (scripts/test.sh runs them): everything on the two newest; elsewhere the set that
# shows what the stack is in the matrix for. Paths are relative to the repository.
LIGHTNING_TESTS = ("tests/unit/test_lightning_versions.py", "tests/integration/test_lightning.py",
                   "tests/integration/test_lightning_trackers.py",
                   "tests/integration/test_fabric.py", "tests/multiprocess/test_lightning_two_processes.py",
                   "tests/multiprocess/test_lightning_resume.py", "tests/integration/test_token_weights.py")
FOCUSED_TESTS = ("tests/unit/test_forecast.py", "tests/unit/test_versions.py", "tests/unit/test_run.py",
                 "tests/integration/test_support.py", "tests/integration/test_user_runs.py",
                 "tests/multiprocess/test_loops_two_processes.py")
TESTS = {
    "drifting": ("tests",),
    "aligned": ("tests",),
    "lightning": LIGHTNING_TESTS,
    # The last release before bf16's overflow check (the updates it applies although not finite), and one that
    # drops micro-batches under ZeRO-2 with offload (stepsync verify and the start's warning).
    "t457": (*FOCUSED_TESTS, "tests/integration/test_skipped_updates.py",
             "tests/integration/test_non_finite_updates.py", "tests/multiprocess/test_non_finite_on_two_ranks.py",
             "tests/integration/test_verify.py", "tests/integration/test_weight_faults.py",
             "tests/integration/test_output_hooks.py", "tests/integration/test_trainer_refusals.py"),
    # DeepSpeed 0.18.3 divides the Trainer's loss again: the fault, its forecast and its repair by sync.
    "d183": ("tests/integration/test_support.py", "tests/integration/test_output_hooks.py",
             "tests/integration/test_verify.py"),
    # DeepSpeed 0.18.9's BF16_Optimizer (ZeRO-1, an fp32 gradient accumulation) adds each window's last micro-batch
    # after the average across ranks: the fault on two ranks, its forecast, and the ranks' weights parting.
    "d189": ("tests/integration/test_support.py", "tests/multiprocess/test_bf16_optimizer_on_two_ranks.py"),
    # accelerate 1.8 enters DeepSpeed 0.18.2's no_sync(): micro-batches left undivided on several ranks.
    "a18": ("tests/integration/test_support.py", "tests/multiprocess/test_no_sync_on_two_ranks.py",
            "tests/integration/test_deepspeed_loop_releases.py"),
    # DeepSpeed 0.15.4 applies every micro-batch of several backward() calls before one step() on ZeRO 1 and 2;
    # transformers 4.46's Trainer divides a token mean by G once more under DeepSpeed.
    "t446": (*FOCUSED_TESTS, "tests/integration/test_without_deepspeed.py",
             "tests/integration/test_deepspeed_loop_releases.py", "tests/integration/test_token_weights.py"),
    # The watches of torch-native loops where only torch is installed (stepsync's own dependencies beside it).
    "torch": ("tests/integration/test_fsdp.py", "tests/multiprocess/test_fsdp_two_ranks.py"),
}


def tests_of(name: str) -> Tuple[str, ...]:
    """The tests the stack called ``name`` runs: its own set, the older Lightning releases' two, or the focused
    set with the run without DeepSpeed."""
    spec(name)
    if name in TESTS:
        return TESTS[name]
    if any(stack.name == name for stack in LIGHTNING_STACKS):
        return LIGHTNING_TESTS[1:3]
    return (*FOCUSED_TESTS, "tests/integration/test_without_deepspeed.py")


# Seconds each stack's tests took on the 2-core CI machine (its printed times); 40 for the rest. Only the lanes
# scripts/test.sh runs the stacks in are balanced with them.
TEST_SECONDS = {"drifting": 1450, "aligned": 740, "t457": 290, "d183": 230, "lightning": 160, "d189": 60, "torch": 40}


def lanes(names: List[str], count: int) -> List[List[str]]:
    """``names`` in ``count`` lanes of about equal test time, the longest first into the lane least loaded."""
    loads: List[Tuple[int, List[str]]] = [(0, []) for _ in range(max(count, 1))]
    for name in sorted(names, key=lambda n: -TEST_SECONDS.get(n, 40)):
        at = min(range(len(loads)), key=lambda i: loads[i][0])
        loads[at] = (loads[at][0] + TEST_SECONDS.get(name, 40), loads[at][1] + [name])
    return [lane for _, lane in loads if lane]


def spec(name: str):
    """The StackSpec, LightningSpec or TorchSpec called ``name``."""
    for stack in every_stack():
        if stack.name == name:
            return stack
    names = ", ".join(s.name for s in every_stack())
    raise ValueError(f"unknown stack {name!r}: choose one of {names}")


def measure(stack: StackSpec, work_dir: str) -> dict:
    """Run every case of ``stack`` without stepsync (policy ``warn`` watching) and under each remedy.

    Needs the stack installed; returns what the support file stores.
    """
    from harness.runs import run_tiny
    from stepsync import StepSyncCallback

    cases = []
    for number, case in enumerate(stack.cases):
        results = {}
        for policy in POLICIES:
            callback = StepSyncCallback("warn" if policy == "none" else policy, console=False)
            run = run_tiny(os.path.join(work_dir, f"{number}-{policy}"), samples=case.samples, gas=case.gas,
                           epochs=case.epochs, max_steps=case.max_steps, callback=callback,
                           per_device_train_batch_size=case.batch)
            results[policy] = outcome(run)
        cases.append({"case": case.to_dict(), "results": results})
    return {"stack": stack.name, "versions": [stack.transformers, stack.accelerate, stack.deepspeed], "cases": cases}


def outcome(run) -> dict:
    """What one real run did, in the terms of the table (counts from the engine and the Trainer themselves)."""
    from harness.loops import rises  # stepsync's modules: only inside a stack, never where scripts/envs.py reads this

    report = run.callback.report
    forecast = report.forecast
    return {
        "trainer_steps": run.trainer.state.global_step,
        "engine_steps": getattr(run.engine, "global_steps", None),
        "error": None if run.error is None else f"{type(run.error).__name__}: {run.error}",
        "epoch_ends": [list(pair) for pair in run.recording.epoch_ends],
        "forecast_epoch_ends": None if forecast is None else [[r.trainer_steps, r.engine_steps] for r in forecast.epochs],
        "causes": [event.cause.name for event in report.events for _ in range(event.changes)],  # one per change
        # Equal counts can still hide windows that straddle epochs: compare where each side updated.
        "windows_agree": rises(run.recording.trainer_steps) == rises(run.recording.engine_steps),
        "fell_back": any("falling back" in note for note in report.notes),
        "micro_batches": len(run.recording.engine_steps),
        "forecast_ends_early": None if forecast is None else forecast.ends_early() is not None,
    }


def load(directory: str) -> Dict[str, dict]:
    """The stored support files, by stack name, in the order of :data:`STACKS`."""
    found = {}
    for stack in STACKS:
        path = os.path.join(directory, f"{stack.name}.json")
        if os.path.exists(path):
            with open(path) as handle:
                found[stack.name] = json.load(handle)
    return found


CAUSE_WORDS = {"PARTIAL_WINDOW": "partial window", "TINY_EPOCH": "tiny epoch", "ENGINE_AHEAD": "engine ahead",
               "INHERITED": "inherited", "OUTSIDE_ACCUMULATE": "backward outside accumulate()",
               "UNEXPLAINED": "unexplained"}


def _cell(result: dict, case: Case) -> str:
    if result["error"]:
        return f"refused at start ({result['error'].split(':', 1)[0]})"
    drift = result["trainer_steps"] - result["engine_steps"]
    text = f"{result['trainer_steps']} / {result['engine_steps']}"
    asked = case.epochs * -(-case.samples // case.batch)  # an epoch-based run asks for every micro-batch
    short = (f", {result['micro_batches']} of {asked} micro-batches"
             if case.max_steps <= 0 and result["micro_batches"] < asked else "")
    if not drift:
        windows = "" if result["windows_agree"] else ", windows differ"
        return f"{text} ✓{windows}{short}" + (" (fell back to `realign`)" if result["fell_back"] else "")
    causes = ", ".join(dict.fromkeys(CAUSE_WORDS[c] for c in result["causes"]))
    return f"{text} (drift {drift:+d}: {causes}){short}"


def render_table(measured: Dict[str, dict]) -> str:
    """docs/releases.md's support table (markdown), one row per stack and case."""
    lines = ["| stack | transformers / accelerate / deepspeed | case | without stepsync (Trainer / engine) | "
             + " | ".join(f"`{p}`" for p in POLICIES[1:]) + " |",
             "|---" * (4 + len(POLICIES) - 1) + "|"]
    for stack in STACKS:
        data = measured.get(stack.name)
        if data is None:
            continue
        for entry in data["cases"]:
            case = Case(**entry["case"])
            results = entry["results"]
            lines.append(f"| {stack.name} | {' / '.join(data['versions'])} | {case.label()} | "
                         + " | ".join(_cell(results[p], case) for p in POLICIES) + " |")
    return "\n".join(lines)


def _table_bounds(readme: str):
    """(end of the start marker, start of the end marker) in ``readme``, or None without both markers."""
    start, end = readme.find(TABLE_START), readme.find(TABLE_END)
    return None if start < 0 or end < start else (start + len(TABLE_START), end)


def replace_table(readme: str, table: str) -> str:
    """``readme`` with the text between the support-table markers replaced by ``table``."""
    bounds = _table_bounds(readme)
    if bounds is None:
        raise ValueError(f"docs/releases.md has no support table markers: add {TABLE_START!r} and {TABLE_END!r}")
    return readme[: bounds[0]] + "\n" + table + "\n" + readme[bounds[1]:]


def table_in(readme: str) -> Optional[str]:
    bounds = _table_bounds(readme)
    return None if bounds is None else readme[bounds[0]: bounds[1]].strip("\n")


def disagreements(stored: dict, fresh: dict) -> List[str]:
    """Where a fresh measurement differs from the stored one (empty when they agree)."""
    problems = []
    for old, new in zip(stored["cases"], fresh["cases"]):
        for policy in POLICIES:
            if old["results"].get(policy) != new["results"].get(policy):
                problems.append(f"{Case(**old['case']).label()}, {policy}: stored {old['results'].get(policy)}, "
                                f"measured {new['results'].get(policy)}")
    if len(stored["cases"]) != len(fresh["cases"]):
        problems.append(f"stored {len(stored['cases'])} cases, measured {len(fresh['cases'])}")
    return problems
