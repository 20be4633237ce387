"""Probe DeepSpeed's bf16 optimizer on W ranks: each micro-batch's weight in one window, solved from the parameters
(one weight per sample, plain SGD at lr 1, the engine driven directly). Rank r trains samples r*G .. r*G+G-1; a right
update gives each 1/(WG). Run under torchrun, one configuration per launch:

    DS_ACCELERATOR=cpu PYTHON -m torch.distributed.run --nproc_per_node W scripts/probe_bf16_ranks.py STAGE G \\
        [grad_accum_fp32] [immediate]

``grad_accum_fp32`` sets ``data_types.grad_accum_dtype: fp32`` (what makes DeepSpeed pick its BF16_Optimizer with
ZeRO-1), ``immediate`` sets ``bf16.immediate_grad_update: true``. Rank 0 prints one JSON row (``shares``: each
micro-batch's share times WG, per rank in order; ``wrong``: the 1-based micro-batches of a window that are not 1/(WG)
on any rank; ``residual``: |update - the right update| / |the right update|), or ``cannot_run`` with DeepSpeed's
refusal. Its rows are stored in ``stepsync/core/weight_probes.json`` (``tests/unit/test_weights.py`` holds the
weight faults' rows against them).
"""
import json
import os
import sys
from importlib.metadata import version

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stepsync.tools.tiny_run import cpu_distributed_env  # noqa: E402

SCALE = 1e-3  # bf16 keeps the loss's small values exact enough; no clip norm acts on them


def main(stage: int, g: int, options) -> None:
    cpu_distributed_env()
    import deepspeed
    import torch
    import torch.distributed as dist

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": g, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": True, **({"immediate_grad_update": True} if "immediate" in options else {})}}
    if "grad_accum_fp32" in options:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    row = dict(deepspeed=version("deepspeed"), world_size=world, stage=stage, offload="none", g=g, precision="bf16",
               call="engine", outputs="loss",
               grad_accum_dtype="fp32" if "grad_accum_fp32" in options else None,
               immediate_grad_update="immediate" in options)
    width = world * g
    model = torch.nn.Linear(width, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    try:
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config,
                                                       optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        row["optimizer"] = type(engine.optimizer).__name__
        rank = dist.get_rank()
        for k in range(g):
            x = torch.zeros(1, width, dtype=torch.bfloat16)
            x[0, rank * g + k] = 1
            engine.backward(SCALE * engine(x).sum())
            engine.step()
        with deepspeed.zero.GatheredParameters([engine.module.weight]):
            moved = [-float(v) / SCALE * width for v in engine.module.weight.detach().float().flatten()]
        row.update(shares=[round(s, 4) for s in moved],
                   wrong=sorted({k % g + 1 for k, s in enumerate(moved) if abs(s - 1) > 2e-2}),
                   residual=round(sum((s - 1) ** 2 for s in moved) ** 0.5 / width ** 0.5, 4))
    except Exception as exc:  # DeepSpeed refuses the combination, loudly
        row["cannot_run"] = f"{type(exc).__name__}: {exc}"[:200]
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
