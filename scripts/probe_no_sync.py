"""Probe accelerate's accumulate() on two ranks with DeepSpeed: each micro-batch's weight in one window, solved
from the parameters (one weight per sample, plain SGD at lr 1). Rank r trains samples r*G .. r*G+G-1; a right update
gives each 1/(2G). Run under torchrun, one configuration per launch:

    DS_ACCELERATOR=cpu .stacks/ENV/bin/torchrun --nproc_per_node 2 scripts/probe_no_sync.py STAGE G >> rows.jsonl

Rank 0 prints one JSON row (``shares``: each micro-batch's share times G, per rank in order; ``wrong``: the 1-based
micro-batches of a window that are not 1/G), or ``cannot_run`` with DeepSpeed's refusal. Merge the rows into
stepsync/core/weight_probes.json with ``python3 scripts/probe_outputs.py --merge``.
"""
import json
import os
import sys
from importlib.metadata import version

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stepsync.tools.tiny_run import cpu_distributed_env  # noqa: E402

SCALE = 1e-3


def main(stage, g):
    cpu_distributed_env()
    import deepspeed
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": g,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    row = dict(deepspeed=version("deepspeed"), accelerate=version("accelerate"), world_size=2, stage=stage,
               offload="none", precision="fp32", g=g, call="accelerate", outputs="loss")
    accelerator = Accelerator(gradient_accumulation_steps=g, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    width = 2 * g
    w = torch.nn.Parameter(torch.zeros(width))

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, x):
            return {"loss": SCALE * (self.w * x).sum()}

    model = Linear()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    rank = dist.get_rank()
    try:
        for k in range(g):
            x = torch.zeros(width)
            x[rank * g + k] = 1
            with accelerator.accumulate(model):
                accelerator.backward(model(x)["loss"])
                optimizer.step()
                optimizer.zero_grad()
        with deepspeed.zero.GatheredParameters([model.module.w]):
            shares = [round(-float(v) / SCALE * width, 4) for v in model.module.w.detach()]
        row.update(shares=shares, wrong=sorted({k % g + 1 for k, s in enumerate(shares) if abs(s - 1) > 1e-4}))
    except AssertionError as exc:  # DeepSpeed refuses the combination
        row["cannot_run"] = f"AssertionError: {exc}"[:200]
    if rank == 0:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
