"""Read back what a run stored in its trackers, with each tracker's own reader where it has one: TensorBoard's
``EventAccumulator``, MLflow's client on its file store, W&B's protobuf records from an offline run's file (W&B
0.31 ships no reader of its own in Python: the file's framing, a LevelDB log, is read here, each record parsed with
W&B's own ``wandb_internal_pb2``)."""
from __future__ import annotations

import glob
import os
import struct
from typing import Dict, List, Tuple

BLOCK = 32768  # W&B's log: 32 KiB blocks; a record is split across them as FIRST, MIDDLE..., LAST
HEADER = 7  # each record's: CRC-32 (4 bytes), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tracker_environment(out) -> Dict[str, str]:
    """The environment of a run that writes to all three trackers under ``out``, with no network."""
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(out), "WANDB_SILENT": "true",
            "MLFLOW_TRACKING_URI": f"file://{out}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"}


def tensorboard(folder) -> Tuple[Dict[str, List[Tuple[int, float]]], Dict[str, List[Tuple[int, str]]]]:
    """(scalars by tag: [(step, value)], texts by tag: [(step, text)]) of every event file under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: Dict[str, list] = {}
    texts: Dict[str, list] = {}
    for run in sorted({os.path.dirname(path) for path in glob.glob(f"{folder}/**/events.out.tfevents.*",
                                                                   recursive=True)}):
        events = EventAccumulator(run, size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((event.step, event.value) for event in events.Scalars(tag))
        for tag in events.Tags()["tensors"]:
            texts.setdefault(tag, []).extend((event.step, event.tensor_proto.string_val[0].decode())
                                             for event in events.Tensors(tag))
    return scalars, texts


def mlflow_run(out):
    """(the client, the one run) of the MLflow file store under ``out``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file://{out}/mlruns")
    runs = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]
    assert len(runs) == 1, runs
    return client, runs[0]


def wandb_records(out) -> list:
    """Every record of the one offline W&B run under ``out``, parsed with W&B's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2

    paths = glob.glob(f"{out}/wandb/offline-run-*/run-*.wandb")
    assert len(paths) == 1, paths
    with open(paths[0], "rb") as handle:
        data = handle.read()
    assert data[:4] == b":W&B"
    records, position, pieces = [], HEADER, b""
    while position + HEADER <= len(data):
        room = BLOCK - position % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
        if kind == 0 and length == 0:
            break
        pieces += data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def wandb_summary_and_alerts(out) -> Tuple[Dict[str, str], List[Tuple[str, str, str]]]:
    """(the run summary's values as JSON text by key, the alerts as (title, text, level)) of W&B's offline run."""
    summary: Dict[str, str] = {}
    alerts = []
    for record in wandb_records(out):
        kind = record.WhichOneof("record_type")
        if kind == "summary":
            summary.update((item.key or "/".join(item.nested_key), item.value_json) for item in record.summary.update)
        elif kind == "alert":
            alerts.append((record.alert.title, record.alert.text, record.alert.level))
    return summary, alerts
