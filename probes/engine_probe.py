"""Probe one stack's DeepSpeed side: who calls engine.step(), where the engine updates, and what
DeepSpeed's managed_gradient_accumulation does. Real Trainer, real DeepSpeed (ZeRO 0), CPU, no stepsync.

Usage (inside the stack's environment): python probes/engine_probe.py OUT.json
"""
import json
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

N, G, EPOCHS = 5, 2, 2


def run(managed=True):
    from transformers import TrainerCallback

    from stepsync.tools.tiny_run import deepspeed_config
    from harness.runs import run_tiny

    seen = {"step_calls": 0, "callers": set(), "micro_batches": 0}

    class Spy(TrainerCallback):
        """Counts engine.step() calls and names the module that makes them."""

        def on_train_begin(self, args, state, control, **kwargs):
            engine = self.trainer.model_wrapped
            original = engine.step

            def step(*a, **k):
                seen["step_calls"] += 1
                seen["callers"].add(sys._getframe(1).f_globals.get("__name__", "?"))
                return original(*a, **k)

            engine.step = step
            seen["has_set_boundary"] = callable(getattr(engine, "set_gradient_accumulation_boundary", None))
            seen["has_managed_flag"] = callable(getattr(engine, "managed_gradient_accumulation", None))

        def on_substep_end(self, args, state, control, **kwargs):
            seen["micro_batches"] += 1

        def on_step_end(self, args, state, control, **kwargs):
            seen["micro_batches"] += 1

    spy = Spy()
    config = deepspeed_config(0)
    if not managed:
        config["managed_gradient_accumulation"] = False
    result = run_tiny(tempfile.mkdtemp(), samples=N, gas=G, epochs=EPOCHS, extra_callbacks=[spy],
                      on_trainer=lambda trainer: setattr(spy, "trainer", trainer), deepspeed=config)
    out = {
        "error": None if result.error is None else f"{type(result.error).__name__}: {result.error}"[:300],
        "trainer_updates_at": result.recording.trainer_updates_at,
        "engine_updates_at": result.recording.engine_updates_at,
        "epoch_ends": [list(pair) for pair in result.recording.epoch_ends],
        "step_calls": seen["step_calls"],
        "micro_batches": seen["micro_batches"],
        "step_callers": sorted(seen["callers"]),
        "has_set_boundary": seen.get("has_set_boundary"),
        "has_managed_flag": seen.get("has_managed_flag"),
    }
    return out


def main():
    warnings.filterwarnings("ignore")
    import importlib.metadata as metadata

    from stepsync.tools.tiny_run import cpu_distributed_env

    cpu_distributed_env()
    data = {"versions": {p: metadata.version(p) for p in ("transformers", "accelerate", "deepspeed", "torch")},
            "case": {"samples": N, "gas": G, "epochs": EPOCHS}, "managed": run()}
    if data["managed"]["has_managed_flag"]:
        data["unmanaged"] = run(managed=False)
    with open(sys.argv[1], "w") as handle:
        json.dump(data, handle)


if __name__ == "__main__":
    main()
