"""What TRL's GRPOTrainer divides a dapo/cispo/vespo loss by, against the window's own completion tokens, on the
real Trainer and DeepSpeed (ZeRO-0, CPU); probes/trl_grpo.json keeps the results.

    python probes/trl_grpo_probe.py LOSS_TYPE STEPS_PER_GENERATION G

With ``beta=0`` and one iteration, each completion token's loss is minus its advantage (the ratio is exactly 1),
so each micro-batch's summed token loss is -sum(A_s n_s) over its completions, read from the inputs TRL hands the
loss. The loss handed to the backward divides that sum by some normaliser: the probe reads it from the backward's
loss, and holds it against the window's own completion tokens (what a token mean over the window divides by).
Prints one JSON line: the releases, the config, and per update the ratio window tokens / normaliser (1: a token
mean over the window; G / steps_per_generation: divided by the generation batch's tokens).
"""
import json
import os
import sys
import tempfile
import warnings
from importlib.metadata import version

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from harness.tokenizer import tiny_tokenizer  # noqa: E402
from stepsync.tools.tiny_run import cpu_distributed_env, deepspeed_config, tiny_model  # noqa: E402


def main(loss_type: str, per_generation: int, g: int) -> dict:
    cpu_distributed_env()
    import trl
    from datasets import Dataset

    tokenizer, words = tiny_tokenizer()
    prompts = 2 * per_generation * 2
    data = Dataset.from_dict({"prompt": [" ".join(words[i:i + 3]) for i in range(prompts)]})
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, gradient_accumulation_steps=g,
                          num_generations=4, steps_per_generation=per_generation, max_completion_length=6,
                          num_train_epochs=1, bf16=False, learning_rate=1e-2, report_to=[], logging_steps=1,
                          save_strategy="no", disable_tqdm=True, use_cpu=True, deepspeed=deepspeed_config(0),
                          loss_type=loss_type, beta=0.0, num_iterations=1, shuffle_dataset=False, seed=0)
    model = tiny_model()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # Rewards rising with the completion's place in its group of 4: each micro-batch (2 completions) holds advantages
    # of one sign, whose sum never cancels.
    trainer = trl.GRPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                              reward_funcs=lambda completions, **kwargs: [float(len(c)) + 0.1 * i
                                                                          for i, c in enumerate(completions)])
    seen = []  # per micro-batch: (-sum(A_s n_s), completion tokens), then the loss handed to the backward
    compute = trainer._compute_loss

    def spied_compute(model, inputs, *rest, **kwargs):
        mask = inputs["completion_mask"]
        summed = -(inputs["advantages"].reshape(-1, *([1] * (mask.dim() - 1))) * mask).sum()
        seen.append([float(summed), int(mask.sum())])
        return compute(model, inputs, *rest, **kwargs)

    trainer._compute_loss = spied_compute
    backward = trainer.accelerator.backward

    def spied_backward(loss, **kwargs):
        seen[-1].append(float(loss.detach()))
        return backward(loss, **kwargs)

    trainer.accelerator.backward = spied_backward
    trainer.train()
    ratios = []
    for start in range(0, len(seen) - len(seen) % g, g):
        window = seen[start:start + g]
        tokens = sum(row[1] for row in window)
        normalisers = [row[0] / row[2] for row in window if abs(row[2]) > 1e-12]
        ratios.append([round(tokens / normaliser, 4) for normaliser in normalisers])
    return {"trl": version("trl"), "transformers": version("transformers"), "deepspeed": version("deepspeed"),
            "loss_type": loss_type, "steps_per_generation": per_generation, "g": g, "ratios": ratios}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
