"""``stepsync verify --world-size N``: the measurement of :mod:`stepsync.tools.measurement` on N local processes under
torchrun (gloo on CPU), each rank's result written to a folder and rank 0's verdict read back; DeepSpeed's output
goes to a file unless asked for."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any, Dict

from ..core.errors import VerifyInputError
from .measurement import DeepSpeedRefusal, Verdict, measured_verdict, refused
from .tiny_run import cpu_distributed_env


def on_ranks(measured: Dict[str, Any], g: int, framework: str, world: int, verbose: bool) -> Verdict:
    """The measurement on ``world`` local processes under torchrun; rank 0's verdict."""
    with tempfile.TemporaryDirectory(prefix="stepsync-verify-") as folder:
        with open(os.path.join(folder, "config.json"), "w") as handle:
            json.dump(measured, handle)
        with socket.socket() as sock:  # torchrun's --master_port 0 hangs the ranks: pick a free port
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
                   "127.0.0.1", "--master_port", port, "-m", "stepsync.tools.verify_ranks", folder, str(g), framework]
        log = os.path.join(folder, "deepspeed.log")
        with open(log, "w") as output:
            try:
                subprocess.run(command, env=env, stdout=None if verbose else output, stderr=None if verbose else
                               subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=RANKS_TIMEOUT, check=False)
            except subprocess.TimeoutExpired as exc:
                raise VerifyInputError(f"the {world} ranks did not finish in {RANKS_TIMEOUT} s (a rank left waiting "
                                       "for the others): stepsync verify --verbose shows DeepSpeed's output") from exc
        rows = {}
        for rank in range(world):
            path = os.path.join(folder, f"rank-{rank}.json")
            if os.path.exists(path):
                with open(path) as handle:
                    rows[rank] = json.load(handle)
        said = [row["cannot_run"] for row in rows.values() if "cannot_run" in row]
        if said or 0 not in rows:
            raise refused(said[0] if said else "a rank ended without a result", world, verbose)
        found = rows[0]
        found.pop("wrong_micro_batches", None)
        found.pop("wrong_micro_batches_with_logits", None)
        return Verdict(**found)


# What a launcher sets for its own ranks: never passed to the ranks verify starts.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
RANKS_TIMEOUT = 600


def as_a_process_of_its_own() -> None:
    """This process measures alone: a launcher's rank or an inherited port are dropped, and its own rendezvous
    set (a parent's would be joined)."""
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    cpu_distributed_env()


def rank_main(folder: str, g: int, framework: str) -> None:
    """One rank of :func:`on_ranks`: its verdict, or DeepSpeed's refusal, to ``folder/rank-R.json``; a rank that
    fails exits 1, so that torchrun ends the others rather than leave them waiting."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cpu_distributed_env()
    with open(os.path.join(folder, "config.json")) as handle:
        measured = json.load(handle)
    code = 0
    try:
        row = measured_verdict(measured, g, framework, rank, world).to_dict()
    except DeepSpeedRefusal as exc:
        row, code = {"cannot_run": str(exc)}, 1
    with open(os.path.join(folder, f"rank-{rank}.json"), "w") as handle:
        json.dump(row, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)




if __name__ == "__main__":  # one rank of on_ranks, started under torchrun
    rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
