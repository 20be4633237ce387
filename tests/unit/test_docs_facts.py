"""Every number and list in the README and docs/ that the code can compute is held against the code: the stacks, the
probed releases and cases, the collectives stepsync makes, the tensor readers, the public errors. A test here fails
when a page and the code part."""
import ast
import json
import os
import re

import pytest

from harness import matrix
from harness.paths import REPO
from harness.touches import READER_CLASSES

ROOT = os.path.join(REPO, "stepsync")


def page(name):
    return " ".join(open(os.path.join(REPO, name)).read().split())


def probed_transformers():
    with open(os.path.join(REPO, "probes", "results.json")) as handle:
        return json.load(handle)["transformers"]


def output_probes():
    """The rows of scripts/probe_outputs.py in stepsync/core/weight_probes.json (each call and output probed)."""
    with open(os.path.join(ROOT, "core", "weight_probes.json")) as handle:
        rows = json.load(handle)
    keys = {"call", "deepspeed", "g", "offload", "outputs", "precision", "shares", "stage", "wrong"}
    return [row for row in rows if set(row) == keys]


FACTS = [
    ("docs/architecture.md", r"\((\d+) stacks, each built", lambda: len(matrix.every_stack())),
    ("docs/releases.md", r"(\d+) stacks cover each change", lambda: len(matrix.STACKS)),
    ("docs/releases.md", r"(\d+) more stacks carry PyTorch Lightning", lambda: len(matrix.LIGHTNING_STACKS)),
    ("docs/releases.md", r"\((\d+) releases in all\)", lambda: len(probed_transformers())),
    ("docs/releases.md", r"from 4\.24 to 5\.25 \((\d+) releases\)",
     lambda: len({tuple(version.split(".")[:2]) for version in probed_transformers()})),
    ("docs/releases.md", r"the final count: (\d+) cases\)",
     lambda: sum(len(entry["cases"]) for entry in probed_transformers().values())),
    ("docs/updates.md", r"([\d,]+) runs on \d+ releases", lambda: f"{len(output_probes()):,}"),
    ("docs/updates.md", r"[\d,]+ runs on (\d+) releases", lambda: len({row["deepspeed"] for row in output_probes()})),
]


@pytest.mark.parametrize("name, pattern, computed", FACTS, ids=[f"{name}: {pattern}" for name, pattern, _ in FACTS])
def test_each_number_on_a_page_is_the_codes(name, pattern, computed):
    found = re.findall(pattern, page(name))
    assert found == [str(computed())], (name, pattern)


def enclosing(tree):
    """Each call in ``tree`` with the qualified name of the function it is made in."""
    def walk(node, names):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from walk(child, names + [child.name])
            else:
                if isinstance(child, ast.Call):
                    yield ".".join(names), child
                yield from walk(child, names)
    yield from walk(tree, [])


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
               "reduce", "gather", "scatter", "reduce_scatter", "all_to_all")


PRIMITIVES = ("spread_across_ranks", "mean_across_ranks")  # one all-reduce each: counted where they are called


def collectives_in_the_code():
    """Where stepsync makes a collective: each call of a primitive (one all-reduce), and each collective of
    torch.distributed called anywhere else, by module and function."""
    found = set()
    for folder, _, files in os.walk(ROOT):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            module = os.path.relpath(path, REPO).replace(os.sep, "/")
            for where, call in enclosing(ast.parse(open(path).read())):
                name = getattr(call.func, "attr", getattr(call.func, "id", ""))
                if where in PRIMITIVES:
                    continue  # the collective itself: counted where it is called
                if name in PRIMITIVES or (name in COLLECTIVES and "dist" in ast.unparse(call.func)):
                    found.add(f"{module}: {where}")
    return found


def test_the_collectives_page_lists_every_collective_stepsync_makes():
    text = open(os.path.join(REPO, "docs", "reliability.md")).read()
    table = text[text.index("| where | when | what it agrees on |"):].split("\n\n")[0]
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
    assert listed == collectives_in_the_code() and len(listed) == 5


def test_the_pages_name_the_tensor_readers_the_tests_hold():
    for name in ("docs/performance.md", "docs/trainer.md"):
        text = page(name)
        sentence = text[text.index("four bounded readers"):][:900]
        assert len(READER_CLASSES) == 4
        assert re.findall(r"`(\w+)` \(", sentence) == list(READER_CLASSES), name


def test_every_public_error_is_importable_from_stepsync():
    import stepsync
    from stepsync.core import errors

    public = [name for name, value in vars(errors).items()
              if isinstance(value, type) and issubclass(value, Exception) and not name.startswith("_")]
    assert public and [name for name in public if not hasattr(stepsync, name)] == []
