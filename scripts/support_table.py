"""Measure one stack's support cases, or render the README's support table from the stored measurements.

    python scripts/support_table.py measure STACK      (with that stack's python; writes tests/support/<stack>.json)
    python scripts/support_table.py render             (rewrites the table in docs/releases.md)

scripts/support_table.sh does both for every stack.
"""
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/harness/matrix.py

from harness import matrix as support  # noqa: E402

STORE = os.path.join(ROOT, "tests", "support")


def main(argv) -> int:
    if argv[:1] == ["measure"] and len(argv) == 2:
        data = support.measure(support.spec(argv[1]), tempfile.mkdtemp())
        with open(os.path.join(STORE, f"{argv[1]}.json"), "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.write("\n")
        return 0
    if argv == ["render"]:
        path = os.path.join(ROOT, "docs", "releases.md")
        readme = open(path).read()
        with open(path, "w") as handle:
            handle.write(support.replace_table(readme, support.render_table(support.load(STORE))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
