"""Probe every transformers minor release (latest patch of each, 4.24 to the newest that installs) and store
what its Trainer really does in probes/results.json. Rerun it when new releases come out; then the test
tests/test_versions.py says which rows of stepsync/versions.py the new data contradicts.

    python3 scripts/probe.py                 every release from 4.24 (the list comes from PyPI)
    python3 scripts/probe.py 4.51.3 4.52.4   only these (merged into the stored results)

Each release gets its own environment (scripts/envs.py: uv, dependencies as of 30 days after the release),
then probes/trainer_probe.py runs its real Trainer without DeepSpeed on CPU. About 20 s per release once
the environment exists. A release that does not install or import is stored with the error.
"""
import datetime
import json
import os
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import envs  # noqa: E402

RESULTS = os.path.join(ROOT, "probes", "results.json")
ENVS = os.path.join(ROOT, ".probes")
FIRST = (4, 24)


def releases():
    """{version: upload date} of the latest patch of every minor release since 4.24, from PyPI."""
    with urllib.request.urlopen("https://pypi.org/pypi/transformers/json", timeout=60) as response:
        data = json.load(response)
    newest = {}
    for version, files in data["releases"].items():
        parts = version.split(".")
        if not files or len(parts) != 3 or not all(p.isdigit() for p in parts):
            continue  # yanked-empty, pre-releases and dev builds are not probed
        key = (int(parts[0]), int(parts[1]))
        if key >= FIRST and (key not in newest or int(parts[2]) > int(newest[key][0].split(".")[2])):
            newest[key] = (version, min(f["upload_time"] for f in files)[:10])
    return dict(newest[key] for key in sorted(newest))


def probe(version, uploaded):
    as_of = (datetime.date.fromisoformat(uploaded) + datetime.timedelta(days=30)).isoformat()
    path = os.path.join(ENVS, version)
    entry = {"uploaded": uploaded, "as_of": as_of}
    try:
        envs.build(path, as_of, [f"transformers=={version}", "accelerate", "setuptools<81"])
    except SystemExit as exc:
        entry["error"] = f"install failed: {exc}"
        return entry
    out = os.path.join(path, "probe.json")
    python = os.path.join(path, "bin", "python")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([python, os.path.join(ROOT, "probes", "trainer_probe.py"), out], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
    if done.returncode:
        entry["error"] = "probe failed: " + done.stderr.strip().splitlines()[-1][:300]
        return entry
    versions = subprocess.run([python, "-c", "import importlib.metadata as m; "
                               "print(m.version('accelerate'), m.version('torch'))"], capture_output=True, text=True)
    entry["accelerate"], entry["torch"] = versions.stdout.split()
    with open(out) as handle:
        entry.update(json.load(handle))
    return entry


def main(argv):
    known = releases()
    wanted = argv or list(known)
    stored = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as handle:
            stored = json.load(handle)["transformers"]
    for version in wanted:
        if version not in known:
            raise SystemExit(f"{version} is not the latest patch of a minor release on PyPI: {', '.join(known)}")
        start = time.time()
        stored[version] = probe(version, known[version])
        status = stored[version].get("error", "ok")
        print(f"{version}: {status} ({time.time() - start:.0f} s)", flush=True)
        ordered = dict(sorted(stored.items(), key=lambda item: tuple(int(p) for p in item[0].split("."))))
        with open(RESULTS, "w") as handle:  # after every release: an interrupted run keeps what it measured
            json.dump({"probe": "probes/trainer_probe.py", "transformers": ordered}, handle, indent=1,
                      sort_keys=True)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
