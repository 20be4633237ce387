"""Run under `torchrun --nproc_per_node 2`: accelerate loops of the linear model (one weight per sample, plain SGD
at lr 1, rank r trains samples r*G .. r*G+G-1) through `accelerate.accumulate()`, without stepsync and with it under
warn and raise; each rank writes each micro-batch's share of the update (times 2G: 1 is right) and what stepsync
said to OUT/rank-R.json."""
import os
import sys

from harness.loops import accumulate_one_window
from harness.runs import dump, end_process_group

G, SCALE = 3, 1e-3


def loop(policy):
    from stepsync.tools.tiny_run import cpu_distributed_env

    cpu_distributed_env()
    import deepspeed
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": G,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    accelerator = Accelerator(gradient_accumulation_steps=G, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2 * G))

        def forward(self, x):
            return {"loss": SCALE * (self.w * x).sum()}

    model = Linear()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    error, said = accumulate_one_window(accelerator, model, optimizer, policy, G, 2)
    with deepspeed.zero.GatheredParameters([model.module.w]):
        shares = [round(-float(v) / SCALE * 2 * G, 4) for v in model.module.w.detach()]
    return {"shares": shares, "error": error, "weight_faults": said}



def main(out_dir):
    results = {str(policy): loop(policy) for policy in (None, "warn", "raise")}
    dump(os.path.join(out_dir, f"rank-{os.environ['RANK']}.json"), results)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
