"""The package's layers, read from the source with ast: every import, at module level or inside a function.

    core  <-  display  <-  engine  <-  the framework adapters (trainer, accelerate, ...)  <-  tools

Arrows point inward; an adapter never imports another adapter; nothing imports in a cycle, not even for
annotations (``if TYPE_CHECKING:``). A function may import lazily only a third-party package (torch,
transformers, ...), never a stepsync module. Every run opens and closes in one place (engine/lifecycle.py), and no
adapter writes its report.
"""
import ast
import os
import subprocess
import sys

from harness.paths import REPO

ROOT = os.path.join(REPO, "stepsync")
LAYERS = ("core", "display", "engine", "adapters", "tools")  # each may import only the ones before it
ADAPTERS = ("trainer", "accelerate", "lightning")  # one folder per training framework
FORBIDDEN_IN_CORE = ("torch", "transformers", "deepspeed", "accelerate", "lightning", "rich")
MOST_LINES = 350  # an alarm, not a law (STYLE.md): a split that makes a cycle costs more than a 350-line file


def modules():
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def imports(module, path, annotations=False):
    """(absolute name, at module level) of every import this module makes (with ``annotations``, those under
    ``if TYPE_CHECKING:`` too)."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = []

    def visit(nodes, top):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not annotations:
                continue
            if isinstance(node, ast.Import):
                found.extend((alias.name, top) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module
                found.append((prefix, top))
                found.extend((f"{prefix}.{alias.name}", top) for alias in node.names)
            else:
                inside = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(ast.iter_child_nodes(node), top and not inside)

    visit(tree.body, True)
    return found


def graph(annotations=False):
    known = modules()
    # A module's own packages are loading already when it loads (``from . import x`` names its package first).
    return {module: {name for name, _ in imports(module, path, annotations)
                     if name in known and name != module and not module.startswith(name + ".")}
            for module, path in known.items()}


def layer(module):
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return "adapters" if parts[1] in ADAPTERS else parts[1] if parts[1] in LAYERS else None


def test_no_import_cycle_not_even_for_annotations():
    edges, state, cycles = graph(annotations=True), {}, []

    def walk(node, path):
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target, path + [target])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            walk(node, [node])
    assert cycles == []


def test_arrows_point_inward_and_adapters_stay_apart():
    wrong = []
    for module, targets in graph().items():
        here = layer(module)
        for target in targets:
            there = layer(target)
            if target == "stepsync":  # the public API: what the tools use as a user would
                if here != "tools":
                    wrong.append(f"{module} -> {target}")
            elif here and there and LAYERS.index(there) > LAYERS.index(here):
                wrong.append(f"{module} -> {target}")
            elif here == there == "adapters" and module.split(".")[1] != target.split(".")[1]:
                wrong.append(f"{module} -> {target} (one adapter into another)")
    assert wrong == []


def test_lazy_imports_are_third_party_only():
    lazy = [(module, name) for module, path in modules().items()
            for name, top in imports(module, path) if not top and name.split(".")[0] == "stepsync"]
    assert lazy == []


def test_the_core_imports_no_framework_and_no_rendering():
    for module, path in modules().items():
        if layer(module) == "core":
            roots = {name.split(".")[0] for name, _ in imports(module, path)}
            assert not roots & set(FORBIDDEN_IN_CORE), (module, roots & set(FORBIDDEN_IN_CORE))
    core = sorted(m for m in modules() if layer(m) == "core")
    code = (f"import sys; import {', '.join(core)}; "
            f"print(sorted(m for m in {FORBIDDEN_IN_CORE!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "[]", done.stderr


def test_the_layers_are_the_folders():
    assert sorted({layer(m) for m in modules()} - {None}) == sorted(LAYERS)
    top_level = sorted(m for m in modules() if layer(m) is None)
    assert top_level == ["stepsync", "stepsync.__main__", "stepsync._version"]


def test_no_module_is_long():
    long = {module: n for module, path in modules().items() if (n := len(open(path).read().splitlines())) > MOST_LINES}
    assert long == {}


def calls_and_writes(path):
    """(what is called, what is assigned to) in a module, as source text."""
    tree = ast.parse(open(path).read())
    calls = [ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    targets = [ast.unparse(target) for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign))
               for target in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    return calls, targets


def test_every_run_opens_and_closes_in_the_lifecycle():
    opened, closed = set(), set()
    for module, path in modules().items():
        calls, _ = calls_and_writes(path)
        if {"Run", "SyncReport"} & set(calls):
            opened.add(module)
        if any(call.endswith((".finish", ".summarize")) for call in calls):
            closed.add(module)
    assert opened == closed == {"stepsync.engine.lifecycle"}


def test_no_adapter_writes_the_report():
    written = []
    for module, path in modules().items():
        if layer(module) != "adapters":
            continue
        calls, targets = calls_and_writes(path)
        for text in targets + [call.rsplit(".", 1)[0] for call in calls if "." in call]:
            parts = text.replace("[", ".").split(".")
            if any(name in ("report", "_report") for name in parts[:-1]):  # report.x = ..., report.x.append(...)
                written.append(f"{module}: {text}")
    assert written == []
