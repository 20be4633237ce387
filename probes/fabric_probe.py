"""What ZeRO 1 and 2 do in Fabric's documented accumulation loop on DeepSpeed, on CPU (probes/fabric.json).

    python probes/fabric_probe.py N G STAGE CONFIG_GAS      (CONFIG_GAS 1: gradient_accumulation_steps=G in the
                                                            DeepSpeed config; 0: left at 1)

Prints OK with the last (epoch, batch, engine global_steps, scheduler steps) and each update's {sample: weight}
(a one-hot linear model under plain SGD makes them exact), or ERR with the exception. Lightning's one device
check is lifted as stepsync/tools/tiny_lightning.py does.
"""
import sys
import warnings

warnings.filterwarnings("ignore")
from stepsync.tools.tiny_lightning import lift_the_cuda_check
from stepsync.tools.tiny_run import cpu_distributed_env
cpu_distributed_env()
import torch, lightning as L
from lightning.fabric.strategies import DeepSpeedStrategy
lift_the_cuda_check()
n, g, E = int(sys.argv[1]), int(sys.argv[2]), 2
stage = int(sys.argv[3]); gas_in_config = sys.argv[4] == "1"
config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True}
if gas_in_config: config["gradient_accumulation_steps"] = g
fabric = L.Fabric(accelerator="cpu", strategy=DeepSpeedStrategy(config=config, parallel_devices=[torch.device("cpu", 0)], process_group_backend="gloo"), devices=1)
fabric.launch()
w = torch.nn.Parameter(torch.zeros(n))
class M(torch.nn.Module):
    def __init__(self): super().__init__(); self.w = torch.nn.Parameter(torch.zeros(n))
    def forward(self, x): return (x @ self.w).sum()
model = M(); opt = torch.optim.SGD(model.parameters(), lr=1.0)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
model, opt = fabric.setup(model, opt)
engine = model._forward_module if hasattr(model, "_forward_module") else model
import deepspeed
def params():
    with deepspeed.zero.GatheredParameters([model.module.w] if hasattr(model, "module") else [model.w]):
        return (model.module.w if hasattr(model, "module") else model.w).detach().clone()
last = params(); updates = []; rows = []
data = torch.eye(n)
try:
  for epoch in range(E):
    for i in range(n):
        is_acc = (i + 1) % g != 0
        with fabric.no_backward_sync(model, enabled=is_acc):
            loss = model(data[i]) / g
            fabric.backward(loss)
        if not is_acc:
            opt.step(); opt.zero_grad(); sched.step()
        p = params()
        if not torch.equal(p, last): updates.append({j: round(float(v),4) for j, v in enumerate(last - p) if abs(float(v))>1e-9})
        last = p
        rows.append((epoch, i, engine.global_steps, sched.last_epoch))
  print("OK", rows[-1], updates)
except Exception as e:
  print("ERR", type(e).__name__, e)
