"""notebooks/walkthrough.ipynb runs from top to bottom on a real stack (its cells assert the counts)."""
import os

import pytest

from harness.stack import DRIFTS, needs_stack
from harness.paths import REPO

NOTEBOOK = os.path.join(REPO, "notebooks", "walkthrough.ipynb")


@needs_stack
@pytest.mark.integration
def test_walkthrough_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib", reason="the notebook's plot needs matplotlib (the drifting stack has it)")
    from harness.runs import PROCESS_GROUP_VARS

    for name in PROCESS_GROUP_VARS:  # the kernel starts its own process group; this process holds the port
        monkeypatch.delenv(name, raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert ("Trainer 4, engine 3, drift +1" if DRIFTS else "Trainer 4, engine 4, drift +0") in text
    assert "Trainer 4, engine 4, drift +0" in text
    assert any("image/png" in o.get("data", {}) for cell in notebook.cells for o in cell.get("outputs", []))


def png_sizes(notebook_path):
    """(width, height) of every PNG output stored in the notebook, read from each PNG's header."""
    import base64
    import json
    import struct

    with open(notebook_path) as handle:
        cells = json.load(handle)["cells"]
    sizes = []
    for cell in cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {}).get("image/png")
            if data:
                raw = base64.b64decode(data if isinstance(data, str) else "".join(data))
                sizes.append(struct.unpack(">II", raw[16:24]))
    return sizes


def test_the_stored_plot_is_large_enough_to_read():
    sizes = png_sizes(NOTEBOOK)
    assert sizes and all(width >= 800 and height >= 300 for width, height in sizes), sizes


def test_the_notebook_uses_the_public_api_only():
    """Its code can be copied into a project: stepsync's names come from ``stepsync`` itself."""
    import json
    import re

    cells = json.load(open(NOTEBOOK))["cells"]
    code = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    assert "from stepsync import" in code and re.findall(r"\bstepsync\.\w+\.", code) == []
    assert re.findall(r"from stepsync\.\w+", code) == []
