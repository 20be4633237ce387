"""What DeepSpeed applies when a loop calls backward() K times and then step() once (open-instruct's learner before
its PR 1498, OpenRLHF's dynamic batches), on CPU; probes/raw_loop.json keeps the results.

    python probes/raw_loop_probe.py K STAGE MODE [bf16]    MODE: plain (the config's G=1, nothing set),
                                                           boundary (set_gradient_accumulation_boundary(i == K-1)
                                                           before each backward), config (the config's G=K),
                                                           late (False before each backward, True only before
                                                           step(): K unknown until the step), closed (as late,
                                                           then one backward of a zero loss closes the window),
                                                           reduced (as late, then engine.allreduce_gradients()),
                                                           unmanaged ("managed_gradient_accumulation": false in
                                                           the config, where DeepSpeed has it: step() is the
                                                           boundary)

Prints one JSON line: the engine's global_steps and micro_steps after the step, and each sample's share of the
update (a one-hot linear model under plain SGD at lr 1 makes it exact: 1 is a micro-batch applied whole).
"""
import json
import sys
import warnings

warnings.filterwarnings("ignore")
from stepsync.tools.tiny_run import cpu_distributed_env  # noqa: E402

cpu_distributed_env()
import deepspeed  # noqa: E402
import torch  # noqa: E402

k, stage, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
bf16 = sys.argv[4:5] == ["bf16"]
model = torch.nn.Linear(k, 1, bias=False)
torch.nn.init.zeros_(model.weight)
config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": k if mode == "config" else 1,
          "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
          **({"managed_gradient_accumulation": False} if mode == "unmanaged" else {}),
          **({"bf16": {"enabled": True}} if bf16 else {})}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config)


def weights():
    with deepspeed.zero.GatheredParameters([engine.module.weight]):
        return engine.module.weight.detach().float().clone().flatten()


before = weights()
rows = torch.eye(k, dtype=torch.bfloat16 if bf16 else torch.float32)
for i in range(k):
    if mode in ("boundary", "late", "closed", "reduced"):
        engine.set_gradient_accumulation_boundary(mode == "boundary" and i == k - 1)
    engine.backward(engine(rows[i:i + 1]).sum())
if mode in ("late", "closed", "reduced"):
    engine.set_gradient_accumulation_boundary(True)
if mode == "closed":
    engine.backward(engine.module.weight.reshape(-1)[0] * 0.0)
if mode == "reduced":
    engine.allreduce_gradients()
engine.step()
shares = [round(-(after - first).item(), 4) for after, first in zip(weights(), before)]
print(json.dumps({"k": k, "stage": stage, "mode": mode, "bf16": bf16, "deepspeed": deepspeed.__version__,
                  "global_steps": engine.global_steps, "micro_steps": engine.micro_steps, "shares": shares}))
sys.stdout.flush()
import os  # noqa: E402

os._exit(0)  # left to the interpreter's exit, gloo's threads sometimes abort the finished process
