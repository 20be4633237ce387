"""Train the tiny model once (5 samples, G=2, 3 epochs, ZeRO-0, fp32) and save its parameters.

Usage: python tests/entry/param_run.py sync|none OUT.pt  (run by test_numerics.py, also with another stack's python)
"""
import os
import sys
import tempfile


from harness.runs import end_process_group, final_parameters, run_tiny


def main(mode: str, out: str) -> None:
    import torch

    from stepsync import StepSyncCallback

    callback = StepSyncCallback("sync", console=False) if mode == "sync" else None
    result = run_tiny(tempfile.mkdtemp(), samples=5, gas=2, epochs=3, callback=callback)
    if result.error is not None:
        raise result.error
    torch.save(final_parameters(result), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_process_group()
