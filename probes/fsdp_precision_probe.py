"""How FSDP2 (``fully_shard``) weighs each micro-batch of a window whose gradient sync is off but at the last, by
``MixedPrecisionPolicy``, measured on CPU (gloo, one rank).

    python probes/fsdp_precision_probe.py [G ...]     (prints one JSON object per policy and G)

The model is a linear map with fp32 weights ``w`` of 2G - 1 entries and the loss ``w . x``, plain SGD at lr 1, so
an update moves ``w`` by minus the gradient the window left. Micro-batch k puts 1 on its own entry k (its share of
the update, as DeepSpeed's weight probes read it); micro-batch 0 also puts 1 on each entry G + k - 1 and micro-batch
k >= 1 adds 2**-10 there, a contribution smaller than a bfloat16 can add to 1 (its spacing at 1 is 2**-7). What an
update kept of micro-batch k's small contribution (``small_kept``: 1 whole, 0 rounded away) says where the window's
gradients were summed: in float32 each is kept, in bfloat16 none. The sync is off for the window's first G - 1
micro-batches (``set_requires_gradient_sync(False)``) and on for its last, as a loop writes it. Cases: each
``MixedPrecisionPolicy`` below on float32 weights; bfloat16 weights without one, with and without a float32
``grad_dtype``; and a parameter that only the window's last micro-batch uses (PyTorch issue 196996: a mixed-dtype
assertion under bf16 compute and fp32 reduce).
"""
import json
import os
import sys
import warnings

SMALL = 2.0 ** -10
POLICIES = {  # name -> (param_dtype, reduce_dtype) of MixedPrecisionPolicy; None: the weights' own dtype
    "none": None,
    "bf16": ("bfloat16", None),
    "bf16_reduce_fp32": ("bfloat16", "float32"),
    "bf16_reduce_bf16": ("bfloat16", "bfloat16"),
}
# bfloat16 weights, no policy: as they are, and with each parameter's grad_dtype set to float32 before fully_shard
# (autograd's own way to keep a bfloat16 parameter's gradient in float32; PyTorch PR 194434 measures FSDP2
# accumulating such a gradient in bfloat16)
BF16_WEIGHTS = {"bf16_weights": None, "bf16_weights_grad_dtype_fp32": "float32"}


def measure(policy: str, g: int, late: bool = False) -> dict:
    """One window; ``late``: a second parameter, used only by the window's last (synced) micro-batch."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    size = 2 * g - 1

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(size))
            self.v = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x, last):
            out = (x.to(self.w.dtype) * self.w).sum()
            return out + self.v.sum() if last else out

    model = Linear()
    kwargs = {}
    if policy in BF16_WEIGHTS:
        model.to(torch.bfloat16)
        if BF16_WEIGHTS[policy]:
            for parameter in model.parameters():
                parameter.grad_dtype = getattr(torch, BF16_WEIGHTS[policy])
    elif POLICIES[policy] is not None:
        compute, reduce = POLICIES[policy]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, compute),
                                                   reduce_dtype=getattr(torch, reduce) if reduce else None)
    fully_shard(model, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.w.full_tensor().detach().float().clone()
    for k in range(g):
        x = torch.zeros(size)
        x[k] = 1.0
        if k == 0:
            x[g:] = 1.0
        else:
            x[g + k - 1] = SMALL
        model.set_requires_gradient_sync(k == g - 1)
        model(x, late and k == g - 1).backward()
    optimizer.step()
    moved = (before - model.w.full_tensor().detach().float()).tolist()
    shares = [round(v, 6) for v in moved[:g]]
    small_kept = [round((moved[g + k - 1] - moved[0]) / SMALL, 4) for k in range(1, g)]
    return {"policy": policy, "g": g, "late_parameter": late, "shares": shares, "small_kept": small_kept}


def main(argv) -> int:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    cases = [(policy, False) for policy in [*POLICIES, *BF16_WEIGHTS]] + [("bf16_reduce_fp32", True)]
    for g in [int(a) for a in argv] or [2, 4]:
        for policy, late in cases:
            try:
                row = measure(policy, g, late)
            except Exception as exc:  # a release that refuses the case: said as the row
                row = {"policy": policy, "g": g, "late_parameter": late,
                       "cannot_run": f"{type(exc).__name__}: {exc}"[:200]}
            print(json.dumps({"torch": torch.__version__.split("+")[0], **row}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
