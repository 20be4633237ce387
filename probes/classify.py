"""Read what a probed Trainer did (probes/results.json) as the behaviours stepsync/core/versions.py names.

Pure Python. scripts/probe.py uses it to find where a behaviour changes (then probes every patch release
around the change); tests/unit/test_versions.py checks that versions.py's release rows equal what it derives.
"""
from typing import Dict, List, Optional, Tuple

from packaging.version import Version


def version_key(version: str) -> Version:
    return Version(version)


def behaviour(entry: dict) -> Optional[Dict[str, object]]:
    """What one release's Trainer does, from its probe entry; None when the probe could not run."""
    results = entry.get("results")
    if not results or any("error" in results[name] for name in ("n5_g2_e3", "n3_g4_e2", "s10_b2_g3_e2")):
        return None
    epochs = results["n5_g2_e3"]["epochs"]  # N=5, G=2: the second epoch tells the rule apart
    second = epochs[1]["updates_at"]
    if second == [2, 4, 5]:
        rule = "epoch_end"  # every epoch's last partial window is an update
    elif second == [1, 3, 5]:
        rule = "global_counter"  # the window counter runs across epochs
    elif second == [2, 4]:
        rule = "epoch_window"  # the window restarts each epoch; the leftover spills over
    else:
        raise ValueError(f"{entry.get('transformers', '?')}: unknown counting {second}")
    planned = results["n5_g2_e3"]["max_steps"]
    tiny = results["n3_g4_e2"]["epochs"][0]["updates_at"]
    return {
        "trainer_rule": rule,
        "planned_steps": {6: "floor", 9: "ceil"}[planned],  # 3 * (5 // 2) or 3 * ceil(5 / 2)
        # A tiny epoch (N=3 < G=4) still ends with an update.
        "tiny_epoch_update": tiny == [3],
        # 10 samples in batches of 2 (N=5), G=3: windows sized from `num_examples % G` cut the epoch to 4.
        "remainder_cut": results["s10_b2_g3_e2"]["epochs"][0]["micro_batches"] < 5,
    }


FIELDS = ("trainer_rule", "planned_steps", "tiny_epoch_update", "remainder_cut")


def ranges(results: Dict[str, dict], field: str) -> List[Tuple[object, str, Optional[str]]]:
    """(value, first release measured with it, first release measured with the next value or None), in order."""
    rows: List[list] = []
    for version in sorted(results, key=version_key):
        found = behaviour(results[version])
        if found is None:
            continue
        if rows and rows[-1][0] == found[field]:
            continue
        if rows:
            rows[-1][2] = version
        rows.append([found[field], version, None])
    return [tuple(row) for row in rows]


def changes(results: Dict[str, dict]) -> List[Tuple[str, str]]:
    """(last release of the old behaviour, first of the new), for every change of any field."""
    measured = [v for v in sorted(results, key=version_key) if behaviour(results[v]) is not None]
    return [(old, new) for old, new in zip(measured, measured[1:])
            if behaviour(results[old]) != behaviour(results[new])]
