"""The README's and the docs' code blocks, and the README's CPU launch line, for the tests that run them as written
(tests/integration/test_readme_examples.py, tests/integration/test_lightning.py)."""
import os
import re
import subprocess
import sys

from harness.paths import REPO as ROOT


def readme():
    return open(os.path.join(ROOT, "README.md")).read()


def examples():
    """The Python blocks of "Three examples", in order."""
    text = readme()
    section = text[text.index("## Three examples"):]
    section = section[:section.index("\n## ", 4)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def doc_blocks(page: str, kind: str = "python"):
    """The ``kind`` code blocks of docs/``page``, in order."""
    return re.findall(rf"```{kind}\n(.*?)```", open(os.path.join(ROOT, "docs", page)).read(), re.S)


def launch_line():
    """The README's CPU launch line, split into its variable and its command."""
    found = re.search(r"`(DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 train\.py)`", readme())
    assert found, "the README's Install section names the CPU launch line"
    variable, *command = found.group(1).split()
    return dict([variable.split("=")]), command


def launch(tmp_path, script: str, **settings: str):
    """train.py started with the README's launch line (torchrun from this environment), as a user starts it;
    ``settings``: more environment variables."""
    (tmp_path / "train.py").write_text(script)
    variables, command = launch_line()
    assert command[0] == "torchrun"
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env.update(variables, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **settings)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return subprocess.run([torchrun, *command[1:], str(tmp_path / "out")], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600)


def filled(block: str, replacements: dict) -> str:
    for ellipsis, value in replacements.items():
        assert ellipsis in block, ellipsis
        block = block.replace(ellipsis, value)
    assert "..." not in block  # every blank of the README's example is filled above
    return block
