"""Train the tiny model with a custom accelerate loop (5 samples, G=2, 2 epochs, ZeRO-0) and save its parameters.

Usage: python tests/entry/loop_param_run.py sync|none OUT.pt   (run by test_loops.py, also with another stack's python)
"""
import os
import sys


from harness.runs import end_process_group, final_parameters
from harness.loops import run_loop


def main(mode: str, out: str) -> None:
    import torch

    result = run_loop(5, 2, 2, "sync" if mode == "sync" else None)
    if result.error is not None:
        raise result.error
    torch.save(final_parameters(result), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_process_group()
