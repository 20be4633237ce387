"""Each stepsync message shows once on a terminal, whatever logging the user set up (through a real pty)."""
import os
import pty
import re
import subprocess
import sys

import pytest

from harness.stack import DRIFTS, needs_stack
from harness.paths import entry_script

pytestmark = [needs_stack, pytest.mark.integration]


def on_a_terminal(setup: str) -> str:
    """Everything the run wrote to a terminal that is both its stdout and its stderr, whitespace folded."""
    from harness.runs import child_env

    leader, follower = pty.openpty()
    script = entry_script("screen_run.py")
    env = child_env(dict(os.environ, COLUMNS="400", LINES="50", TERM="xterm"))
    proc = subprocess.Popen([sys.executable, script, setup], stdin=subprocess.DEVNULL, stdout=follower,
                            stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    text = ANSI.sub("", b"".join(chunks).decode(errors="replace"))
    return " ".join(text.split())


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x1b]*\x1b\\")


# What each message says as a log line, and a phrase only its rich view draws.
LOG_LINES = {"forecast": r"stepsync: forecast: (?!N=)", "summary": r"stepsync: Trainer counted 4 updates"}
VIEWS = {"forecast": r"micro-batches/epoch, G=2", "summary": r"stepsync summary"}


def count(pattern, screen):
    return len(re.findall(pattern, screen))


@pytest.mark.parametrize("setup", ["stdout", "rich"])
def test_a_handler_on_the_terminal_is_the_only_copy(setup):
    screen = on_a_terminal(setup)
    for message in LOG_LINES:
        assert count(LOG_LINES[message], screen) == 1, (message, screen[-4000:])
        assert count(VIEWS[message], screen) == 0, (message, screen[-4000:])
    assert screen.count("step drift +1 at epoch 1") == (1 if DRIFTS else 0)


def test_without_logging_the_views_are_the_only_copy():
    screen = on_a_terminal("none")
    for message in LOG_LINES:
        assert count(VIEWS[message], screen) == 1, (message, screen[-4000:])
        assert count(LOG_LINES[message], screen) == 0, (message, screen[-4000:])
    # Python's last-resort handler prints the drift warning on stderr: the panel is not drawn again.
    assert screen.count("step drift +1 at epoch 1") == (1 if DRIFTS else 0)
