"""Probe what DeepSpeed's output hooks (0.18.3 on) do to each micro-batch's weight: the model's output as the loss
alone or as the loss with the logits it is computed from, backward called as a loop calls it (engine.backward(loss))
or as the Trainer does (engine.backward(loss / G, scale_wrt_gas=False)). One window per configuration, through the
engine itself, measured by ``stepsync verify``'s own code (stepsync.tools.verify.measure_window).

    DS_ACCELERATOR=cpu .stacks/p-0.18.3/bin/python scripts/probe_outputs.py rows.json

Then merge the rows into stepsync/core/weight_probes.json (``python3 scripts/probe_outputs.py --merge rows.json``);
tests/unit/test_weights.py holds the fault rows against them.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def probe(out):
    from importlib.metadata import version

    from stepsync.tools.verify import VerifyInputError, measure_window

    rows = []
    for precision in ("fp32", "bf16"):
        for stage, offload in ((0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "cpu")):
            for g in (2, 3):
                for outputs in ("loss", "loss+logits"):
                    for call in ("engine", "trainer"):
                        zero = {"stage": stage}
                        if offload == "cpu":
                            zero["offload_optimizer"] = {"device": "cpu"}
                        config = {"zero_optimization": zero}
                        if precision == "bf16":
                            config["bf16"] = {"enabled": True}
                        row = dict(deepspeed=version("deepspeed"), stage=stage, offload=offload, precision=precision,
                                   g=g, call=call, outputs=outputs)
                        try:
                            weights, wrong = measure_window(config, g, outputs, call, precision)
                            row.update(shares=[float("%.4g" % (w * g)) for w in weights], wrong=wrong)
                        except VerifyInputError as exc:
                            row["cannot_run"] = str(exc)[:200]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    with open(out, "w") as handle:
        json.dump(rows, handle)


def merge(paths):
    stored_path = os.path.join(ROOT, "stepsync", "core", "weight_probes.json")
    with open(stored_path) as handle:
        stored = json.load(handle)
    key = ("deepspeed", "stage", "offload", "precision", "g", "call", "outputs", "accelerate", "world_size")
    defaults = {"call": "engine", "outputs": "loss", "world_size": 1}
    seen = {tuple(row.get(k, defaults.get(k)) for k in key): i for i, row in enumerate(stored)}
    for path in paths:
        with open(path) as handle:
            for row in json.load(handle):
                found = tuple(row.get(k, defaults.get(k)) for k in key)
                if found in seen:
                    stored[seen[found]] = row
                else:
                    seen[found] = len(stored)
                    stored.append(row)
    with open(stored_path, "w") as handle:  # one row a line, as stored
        handle.write("[\n" + ",\n".join(json.dumps(row) for row in stored) + "\n]\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--merge"]:
        merge(sys.argv[2:])
    else:
        probe(sys.argv[1])
