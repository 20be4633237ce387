"""Probe one transformers release: what its Trainer really does with accumulation windows.

Runs the real Trainer of the installed release, without DeepSpeed (the Trainer's counting does not
depend on it), on CPU, with a tiny GPT-2 built from a config and data in memory, for every case in
CASES, and prints one JSON object: per case the planned ``max_steps``, the epochs it planned, and per
epoch the micro-batches it trained and the 1-based positions where ``global_step`` rose.

Usage (inside an environment that has the release installed): python probes/trainer_probe.py OUT.json
``scripts/probe.py`` builds one environment per release and collects the output into probes/results.json.
"""
import json
import os
import sys
import tempfile
import warnings

# (samples, per-device batch size, G, epochs, max_steps): each case separates two rules or plans.
CASES = {
    "n5_g2_e3": (5, 1, 2, 3, -1),  # epoch-window / cross-epoch counter / epoch-end rule; floor vs ceil plan
    "n7_g3_e2": (7, 1, 3, 2, -1),  # a partial window of 1
    "n6_g2_e2": (6, 1, 2, 2, -1),  # whole windows only: every rule agrees
    "n3_g4_e2": (3, 1, 4, 2, -1),  # tiny epoch, N < G
    "n4_g4_e2": (4, 1, 4, 2, -1),  # tiny epoch, N == G
    "n5_g2_e1.5": (5, 1, 2, 1.5, -1),  # fractional epochs
    "n5_g2_max4": (5, 1, 2, 3, 4),  # max_steps inside the second epoch
    "s10_b2_g3_e2": (10, 2, 3, 2, -1),  # 5 micro-batches; `num_examples % G` (1) != `N % G` (2)
    "s6_b2_g4_e2": (6, 2, 4, 2, -1),  # 3 micro-batches, G > N; `num_examples % G` = 2
}


def run_case(samples, batch, gas, epochs, max_steps):
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    rows = torch.randint(0, 64, (samples, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in rows]
    seen = {"max_steps": None, "num_train_epochs": None, "epochs": []}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["max_steps"] = state.max_steps
            seen["num_train_epochs"] = getattr(state, "num_train_epochs", None)

        def on_epoch_begin(self, args, state, control, **kwargs):
            seen["epochs"].append({"micro_batches": 0, "updates_at": []})

        def on_substep_end(self, args, state, control, **kwargs):
            seen["epochs"][-1]["micro_batches"] += 1

        def on_step_end(self, args, state, control, **kwargs):
            epoch = seen["epochs"][-1]
            epoch["micro_batches"] += 1
            epoch["updates_at"].append(epoch["micro_batches"])

    fields = TrainingArguments.__dataclass_fields__
    options = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch,
                   gradient_accumulation_steps=gas, num_train_epochs=epochs, max_steps=max_steps,
                   learning_rate=1e-2, logging_strategy="no", save_strategy="no", report_to=[],
                   disable_tqdm=True, dataloader_num_workers=0, seed=0)
    options["use_cpu" if "use_cpu" in fields else "no_cuda"] = True
    trainer = Trainer(model=model, args=TrainingArguments(**options), train_dataset=data, callbacks=[Probe()])
    trainer.train()
    seen["global_step"] = trainer.state.global_step
    seen["transformers"] = transformers.__version__
    return seen


def main():
    warnings.filterwarnings("ignore")
    os.environ.setdefault("WANDB_DISABLED", "true")
    import transformers

    transformers.logging.set_verbosity_error()
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = run_case(*case)
        except Exception as exc:  # a release that cannot run a case says so in the data
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    with open(sys.argv[1], "w") as handle:  # the Trainer prints to stdout: keep the data apart
        json.dump({"cases": {name: list(case) for name, case in CASES.items()}, "results": results}, handle)


if __name__ == "__main__":
    main()
