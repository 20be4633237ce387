"""The package's layers: core <- display <- training <- tools, arrows pointing inward, no cycle.

Read from the source with ast: the imports each module makes when it is loaded (function-level imports and
``if TYPE_CHECKING:`` blocks are not loads), resolved to stepsync modules.
"""
import ast
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "stepsync")
LAYERS = ("core", "display", "training", "tools")  # each may import only the ones before it
FORBIDDEN_IN_CORE = ("torch", "transformers", "deepspeed", "accelerate", "rich")


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


def load_time_imports(module, path):
    """Absolute names this module imports when it is loaded."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    names = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module
                names.append(prefix)
                names.extend(f"{prefix}.{alias.name}" for alias in node.names)

    visit(tree.body)
    return names


def graph():
    known = modules()
    edges = {}
    for module, path in known.items():
        edges[module] = {name for name in load_time_imports(module, path) if name in known and name != module}
    return edges


def layer(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_no_import_cycle():
    edges, state, cycles = graph(), {}, []

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


def test_arrows_point_inward():
    wrong = []
    for module, targets in graph().items():
        here = layer(module)
        for target in targets:
            there = layer(target)
            if here and there and LAYERS.index(there) > LAYERS.index(here):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_core_imports_no_framework_and_no_rendering():
    for module, path in modules().items():
        if layer(module) == "core":
            roots = {name.split(".")[0] for name in load_time_imports(module, path)}
            assert not roots & set(FORBIDDEN_IN_CORE), (module, roots & set(FORBIDDEN_IN_CORE))
    code = ("import sys; import stepsync.core.forecast, stepsync.core.report, stepsync.core.rules, "
            "stepsync.core.versions, stepsync.core.choices; "
            f"print(sorted(m for m in {FORBIDDEN_IN_CORE!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(ROOT))
    assert done.stdout.strip() == "[]", done.stderr


def test_the_layers_are_the_folders():
    assert sorted({layer(m) for m in modules()} - {None}) == sorted(LAYERS)
    top_level = sorted(m for m in modules() if layer(m) is None)
    assert top_level == ["stepsync", "stepsync.__main__", "stepsync._version"]
