"""Train the tiny model once (5 samples, G=2, 3 epochs, ZeRO-0, fp32) and save its parameters.

Usage: python tests/entry/param_run.py sync|none OUT.pt  (run by test_numerics.py, also with another stack's python)
"""
import os
import sys
import tempfile


from harness.runs import run_tiny, save_final_parameters


def run(mode: str):
    from stepsync import StepSyncCallback

    callback = StepSyncCallback("sync", console=False) if mode == "sync" else None
    return run_tiny(tempfile.mkdtemp(), samples=5, gas=2, epochs=3, callback=callback)


if __name__ == "__main__":
    save_final_parameters(run(sys.argv[1]), sys.argv[2])
