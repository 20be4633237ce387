"""Helpers for the real-run tests: which stack this is, and the expected counts (independent of the forecast)."""
import os

import pytest
from packaging.version import Version

from stepsync.core.versions import Stack

STACK = os.environ.get("STEPSYNC_STACK", "")
INSTALLED = Stack.installed()

try:
    import deepspeed  # noqa: F401
    import transformers  # noqa: F401
    HAVE_STACK = True
except Exception:  # pragma: no cover
    HAVE_STACK = False

needs_stack = pytest.mark.skipif(not HAVE_STACK, reason="needs transformers and deepspeed (scripts/test.sh)")
DRIFTS = INSTALLED.accelerate != "newest" and Version(INSTALLED.accelerate) < Version("1.8")


def expected_counts(n, g, epochs):
    """transformers 5.x: ceil(N/G) Trainer updates per epoch; the engine counts its own micro-steps
    (accelerate < 1.8) or follows the Trainer (>= 1.8)."""
    trainer = epochs * -(-n // g)
    engine = (epochs * n) // g if DRIFTS else trainer
    return trainer, engine


def write_torch_archive(path, content: dict) -> None:
    """A file in torch.save's format (a zip holding NAME/data.pkl), written with the standard library only."""
    import pickle
    import zipfile

    name = os.path.splitext(os.path.basename(str(path)))[0]
    with zipfile.ZipFile(str(path), "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{name}/data.pkl", pickle.dumps(content, protocol=2))
        archive.writestr(f"{name}/version", "3\n")
