"""Train the tiny model with a custom accelerate loop (5 samples, G=2, 2 epochs, ZeRO-0) and save its parameters.

Usage: python tests/loop_param_run.py sync|none OUT.pt   (run by test_loops.py, also with another stack's python)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from stepsync.tools.testing import final_parameters, run_loop  # noqa: E402


def main(mode: str, out: str) -> None:
    import torch

    result = run_loop(5, 2, 2, "sync" if mode == "sync" else None)
    if result.error is not None:
        raise result.error
    torch.save(final_parameters(result), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
