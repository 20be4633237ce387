"""Train the tiny model with a custom accelerate loop (5 samples, G=2, 2 epochs, ZeRO-0) and save its parameters.

Usage: python tests/entry/loop_param_run.py sync|none OUT.pt   (run by test_loops.py, also with another stack's python)
"""
import os
import sys


from harness.runs import save_final_parameters
from harness.loops import run_loop


if __name__ == "__main__":
    save_final_parameters(run_loop(5, 2, 2, "sync" if sys.argv[1] == "sync" else None), sys.argv[2])
