"""A tiny real run whose stdout and stderr are one terminal, with the logging that users set up.

    python tests/entry/screen_run.py SETUP     SETUP: none | stdout (transformers' example scripts) | rich (RichHandler)
"""
import logging
import os
import sys
import tempfile


from stepsync import StepSyncCallback
from harness.runs import end_process_group, run_tiny

setup = sys.argv[1]
if setup == "stdout":  # as transformers' examples/pytorch/*/run_*.py configure it
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)], level=logging.INFO)
elif setup == "rich":
    from rich.logging import RichHandler

    logging.basicConfig(handlers=[RichHandler()], level=logging.INFO, format="%(message)s")
result = run_tiny(tempfile.mkdtemp(), samples=3, gas=2, epochs=2, callback=StepSyncCallback())
end_process_group(1 if result.error else 0)
