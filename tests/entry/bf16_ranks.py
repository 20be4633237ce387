"""Run under `torchrun --nproc_per_node 2`: ZeRO-1 in bf16 with an fp32 gradient accumulation
(``data_types.grad_accum_dtype``), which makes DeepSpeed pick its BF16_Optimizer, G=4, one window per rank. The model
is one weight per sample (plain SGD at lr 1), so each sample's share of the update is read from its weight: times 2G,
1 is right. An accelerate loop (rank r trains samples r*G .. r*G+G-1, in order) and the Trainer (its own sampler; the
model records which sample each micro-batch held), without stepsync and under each policy, and with
``bf16.immediate_grad_update``. Each rank writes the shares, the samples it trained in order, and what stepsync said
to OUT/rank-R.json."""
import os
import sys
import tempfile

from harness.loops import accumulate_one_window
from harness.runs import dump, end_process_group

G, WORLD, SCALE = 4, 2, 1e-3
CASES = (("fp32", None), ("fp32", "warn"), ("fp32", "raise"), ("fp32", "sync"), ("immediate", "warn"))


def deepspeed_config(accumulation: str, auto: bool) -> dict:
    bf16 = {"enabled": "auto" if auto else True, **({"immediate_grad_update": True} if accumulation == "immediate"
                                                     else {})}
    return {"train_micro_batch_size_per_gpu": "auto" if auto else 1,
            "gradient_accumulation_steps": "auto" if auto else G, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "bf16": bf16,
            "data_types": {"grad_accum_dtype": "fp32"}}


def one_weight_per_sample(trained: list):
    import torch

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(WORLD * G))

        def forward(self, x):
            trained.append(int(x.reshape(-1).float().argmax()))
            return {"loss": SCALE * (self.w * x.reshape(-1)).sum()}

    return Linear()


def shares(module) -> list:
    import deepspeed

    with deepspeed.zero.GatheredParameters([module.w]):
        return [round(-float(v) / SCALE * WORLD * G, 3) for v in module.w.detach().float()]


def loop(accumulation: str, policy):
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=G, mixed_precision="bf16",
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=deepspeed_config(accumulation, False)))
    trained: list = []
    model = one_weight_per_sample(trained)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    error, said = accumulate_one_window(accelerator, model, optimizer, policy, G, WORLD)
    return {"shares": shares(model.module), "trained": trained, "error": error,
            "weight_faults": said}


class OneHot:
    def __len__(self):
        return WORLD * G

    def __getitem__(self, index):
        import torch

        x = torch.zeros(WORLD * G)
        x[index] = 1
        return {"x": x}


def trainer(accumulation: str, policy):
    from stepsync import StepSyncCallback
    from stepsync.tools.tiny_run import run_tiny

    callback = StepSyncCallback(policy, console=False) if policy else None
    trained: list = []
    result = run_tiny(tempfile.mkdtemp(), samples=0, gas=G, epochs=1, callbacks=[callback] if callback else [],
                      deepspeed=deepspeed_config(accumulation, True), model=one_weight_per_sample(trained),
                      train_dataset=OneHot(), bf16=True, learning_rate=1.0, optim="sgd", weight_decay=0.0,
                      lr_scheduler_type="constant", max_grad_norm=0.0)
    return {"shares": shares(result.engine.module), "trained": trained,
            "error": type(result.error).__name__ if result.error else None,
            "weight_faults": callback.report.weight_faults if callback else None}


def main(out_dir: str) -> None:
    from stepsync.tools.tiny_run import cpu_distributed_env

    cpu_distributed_env()
    results = {f"{run.__name__}-{accumulation}-{policy}": run(accumulation, policy)
               for run in (loop, trainer) for accumulation, policy in CASES}
    dump(os.path.join(out_dir, f"rank-{os.environ['RANK']}.json"), results)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()
