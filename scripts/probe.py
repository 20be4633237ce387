"""Probe every transformers minor release (latest patch of each, 4.24 to the newest that installs) and store
what its Trainer really does in probes/results.json. Rerun it when new releases come out; then the test
tests/unit/test_versions.py says which rows of stepsync/core/versions.py the new data contradicts.

    python3 scripts/probe.py                 the latest patch of every minor release from 4.24 (the list comes
                                             from PyPI), then every patch of a minor where a behaviour changes
    python3 scripts/probe.py 4.51.3 4.52.0   only these (merged into the stored results)
    python3 scripts/probe.py --engine [NAME]  the DeepSpeed side (ENGINE_PROBES below) into probes/engine.json

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

from packaging.version import InvalidVersion, Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import envs  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "probes"))
import classify  # noqa: E402

RESULTS = os.path.join(ROOT, "probes", "results.json")
ENVS = os.path.join(ROOT, ".probes")
FIRST = (4, 24)


def releases():
    """{version: upload date} of every final release since 4.24, from PyPI, oldest first."""
    with urllib.request.urlopen("https://pypi.org/pypi/transformers/json", timeout=60) as response:
        data = json.load(response)
    found = {}
    for version, files in data["releases"].items():
        try:
            parsed = Version(version)
        except InvalidVersion:
            continue
        if not files or parsed.is_prerelease or parsed.is_devrelease or len(parsed.release) != 3:
            continue  # yanked-empty, pre-releases and dev builds are not probed
        if parsed.release[:2] >= FIRST:
            found[version] = min(f["upload_time"] for f in files)[:10]
    return dict(sorted(found.items(), key=lambda item: classify.version_key(item[0])))


def latest_patches(known):
    newest = {}
    for version in known:  # oldest first: the last one of each minor wins
        newest[Version(version).release[:2]] = version
    return list(newest.values())


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


def probe_and_store(versions, known, stored):
    for version in versions:
        if version not in known:
            raise SystemExit(f"{version} is not a final transformers release since 4.24 on PyPI")
        start = time.time()
        stored[version] = probe(version, known[version])
        print(f"{version}: {stored[version].get('error', 'ok')} ({time.time() - start:.0f} s)", flush=True)
        ordered = dict(sorted(stored.items(), key=lambda item: classify.version_key(item[0])))
        with open(RESULTS, "w") as handle:  # after every release: an interrupted run keeps what it measured
            json.dump({"probe": "probes/trainer_probe.py", "transformers": ordered}, handle, indent=1)
            handle.write("\n")


# The DeepSpeed side, probed with real DeepSpeed runs (probes/engine_probe.py) at each boundary:
# name -> (transformers, accelerate, deepspeed, as_of). Pairs differ in one package only.
ENGINE_PROBES = {
    "trainer-steps-4.29": ("4.29.2", "0.20.3", "0.14.5", "2024-08-31"),  # the Trainer calls engine.step()
    # accelerate's wrapper does. 4.30-4.38 cannot run DeepSpeed on a CPU-only machine (they ask for NCCL):
    # 4.39.3 is the first accelerate-based release measured.
    "accelerate-steps-4.39": ("4.39.3", "0.29.3", "0.14.5", "2024-08-31"),
    "accelerate-0.34": ("4.47.1", "0.34.2", "0.16.2", "2025-01-15"),
    "accelerate-1.0": ("4.47.1", "1.0.0", "0.16.2", "2025-01-15"),  # the first 1.x
    "accelerate-1.7": ("4.47.1", "1.7.0", "0.16.2", "2025-01-15"),
    "accelerate-1.8": ("4.47.1", "1.8.0", "0.16.2", "2025-01-15"),  # accelerate PR 3630
    "deepspeed-0.19.3": ("5.24.0", "1.7.0", "0.19.3", "2026-11-30"),
    "deepspeed-0.19.4": ("5.24.0", "1.7.0", "0.19.4", "2026-11-30"),  # managed_gradient_accumulation
}
ENGINE_RESULTS = os.path.join(ROOT, "probes", "engine.json")


def probe_engines(names):
    stored = {}
    if os.path.exists(ENGINE_RESULTS):
        with open(ENGINE_RESULTS) as handle:
            stored = json.load(handle)["stacks"]
    for name in names:
        transformers, accelerate, deepspeed, as_of = ENGINE_PROBES[name]
        start = time.time()
        path = os.path.join(ENVS, "engine-" + name)
        pins = [f"transformers=={transformers}", f"accelerate=={accelerate}", f"deepspeed=={deepspeed}",
                "setuptools<81"]
        entry = {"pins": pins, "as_of": as_of}
        try:
            envs.build(path, as_of, pins, editable=ROOT)
            out = os.path.join(path, "engine.json")
            env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                       TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
            env.pop("TORCH_EXTENSIONS_DIR", None)  # one compiled op per DeepSpeed release (stepsync.tools.tiny_run)
            done = subprocess.run([os.path.join(path, "bin", "python"), os.path.join(ROOT, "probes", "engine_probe.py"),
                                   out], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  timeout=900)
            if done.returncode:
                entry["error"] = "probe failed: " + done.stderr.strip().splitlines()[-1][:300]
            else:
                with open(out) as handle:
                    entry.update(json.load(handle))
        except SystemExit as exc:
            entry["error"] = f"install failed: {exc}"
        stored[name] = entry
        print(f"{name}: {entry.get('error', 'ok')} ({time.time() - start:.0f} s)", flush=True)
        with open(ENGINE_RESULTS, "w") as handle:
            json.dump({"probe": "probes/engine_probe.py", "stacks": stored}, handle, indent=1)
            handle.write("\n")


def main(argv):
    if argv[:1] == ["--engine"]:
        probe_engines(argv[1:] or list(ENGINE_PROBES))
        return 0
    known = releases()
    stored = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as handle:
            stored = json.load(handle)["transformers"]
    probe_and_store(argv or latest_patches(known), known, stored)
    if not argv:
        # Where a behaviour changes between two minors, probe every patch of the new minor: the table names
        # the first release measured with the new behaviour.
        for old, new in classify.changes(stored):
            minor = new.rsplit(".", 1)[0] + "."
            patches = [v for v in known if v.startswith(minor) and v not in stored]
            probe_and_store(patches, known, stored)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
