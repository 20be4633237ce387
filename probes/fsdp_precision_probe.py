"""How FSDP2 (``fully_shard``) weighs each micro-batch of a window whose gradient sync is off but at the last, by
``MixedPrecisionPolicy``, measured on CPU (gloo, one rank).

    PYTHONPATH=. python probes/fsdp_precision_probe.py [G ...]     (prints one JSON object per case and G)

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

# name -> (weights, param_dtype, reduce_dtype, grad_dtype) as stepsync verify --framework fsdp takes them
CASES = {
    "none": ("float32", None, None, None),
    "bf16": ("float32", "bfloat16", None, None),
    "bf16_reduce_fp32": ("float32", "bfloat16", "float32", None),
    "bf16_reduce_bf16": ("float32", "bfloat16", "bfloat16", None),
    # bfloat16 weights, no policy: as they are, and with each parameter's grad_dtype set to float32 before
    # fully_shard (autograd's own way to keep a bfloat16 parameter's gradient in float32; PyTorch PR 194434
    # measures FSDP2 accumulating such a gradient in bfloat16)
    "bf16_weights": ("bfloat16", None, None, None),
    "bf16_weights_grad_dtype_fp32": ("bfloat16", None, None, "float32"),
}


def main(argv) -> int:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from stepsync.tools.fsdp_measurement import measure_fsdp_window

    cases = [(name, False) for name in CASES] + [("bf16_reduce_fp32", True)]
    for g in [int(a) for a in argv] or [2, 4]:
        for name, late in cases:
            weights, compute, reduce, grad = CASES[name]
            verdict = measure_fsdp_window(g, weights, compute, reduce, grad, late_parameter=late)
            row = {"policy": name, "g": g, "late_parameter": late}
            row.update({"cannot_run": verdict.error} if verdict.error else
                       {"shares": verdict.shares, "small_kept": verdict.small_kept})
            print(json.dumps({"torch": verdict.torch, **row}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
