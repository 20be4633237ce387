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
ADAPTERS = ("trainer", "accelerate", "lightning", "deepspeed", "fsdp")  # one folder per training framework
FORBIDDEN_IN_CORE = ("torch", "transformers", "deepspeed", "accelerate", "lightning", "rich")
MOST_LINES = 450  # an alarm, not a law (STYLE.md): one concept per file beats a split made to stay under a cap
# Where a policy's members may be compared: the policy's own modules (the choice, and what acts for each).
POLICY_MODULES = ("stepsync.core.choices", "stepsync.engine.policies", "stepsync.engine.steering")


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


def _names_a_policy_member(node):
    return any(isinstance(n, ast.Attribute) and ast.unparse(n.value) == "Policy" and n.attr.isupper()
               for n in ast.walk(node))


def test_no_code_branches_on_a_policy_member_outside_the_policy():
    """A policy answers every question a policy changes (core/choices.py, engine/policies.py): elsewhere a member
    may be named as a value (a default, a framework's refusals), never compared or looked up in a table."""
    branches = []
    for module, path in modules().items():
        if module in POLICY_MODULES:
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            compared = isinstance(node, ast.Compare) and _names_a_policy_member(node)
            table = (isinstance(node, ast.Dict)
                     and any(key is not None and _names_a_policy_member(key) for key in node.keys))
            if compared or table:
                branches.append(f"{module}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert branches == []


FRAMEWORK_NAMES = ("TRAINER", "LIGHTNING", "ACCELERATE_LOOP", "FABRIC_LOOP", "DEEPSPEED_LOOP")


def _names_a_framework(node):
    """A descriptor itself, or a framework's key or its saved folders as a string (a package's name is not one)."""
    from stepsync.core.frameworks import FRAMEWORKS, SavedFolders

    keys = {framework.key for framework in FRAMEWORKS} | {folders.value for folders in SavedFolders}
    said = ast.unparse(node)
    return any(isinstance(n, ast.Name) and n.id in FRAMEWORK_NAMES for n in ast.walk(node)) or (
        any(isinstance(n, ast.Constant) and n.value in keys for n in ast.walk(node))
        and any(word in said for word in ("framework", ".key", "saved_by", "checkpoints", "releases", "loop")))


def test_the_tools_never_branch_on_which_framework_it_is():
    """The command line, inspect and verify ask a framework's descriptor (its packages, backward call, loss paths,
    saved folders), never which one it is: a framework written outside stepsync gets each of them."""
    branches = []
    for module, path in modules().items():
        if layer(module) != "tools":
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            packages = isinstance(node, ast.Compare) and any(  # a package among a descriptor's is a fact of it
                isinstance(side, ast.Attribute) and side.attr == "packages" for side in node.comparators)
            compared = isinstance(node, ast.Compare) and not packages and _names_a_framework(node)
            table = isinstance(node, ast.Dict) and any(key is not None and _names_a_framework(key)
                                                       for key in node.keys)
            if compared or table:
                branches.append(f"{module}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert branches == []


def test_the_run_says_and_draws_through_its_voice_only():
    """Display is a subscriber of the run: engine/run.py neither logs nor draws; its voice (engine/messages.py)
    says and draws what the run found."""
    path = modules()["stepsync.engine.run"]
    imported = {name for name, _ in imports("stepsync.engine.run", path)}
    calls, _ = calls_and_writes(path)
    assert not {"stepsync.display.render", "stepsync.display.output.logger"} & imported
    assert [call for call in calls if call.startswith(("logger.", "self.output."))] == []


def test_the_report_holds_a_copy_of_the_policy_never_read_back():
    read = []
    for module, path in modules().items():
        if layer(module) == "display" or module == "stepsync.core.report":
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if (isinstance(node, ast.Attribute) and node.attr == "policy" and isinstance(node.ctx, ast.Load)
                    and ast.unparse(node.value).split(".")[-1] in ("report", "_report")):
                read.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert read == []


def test_the_run_is_one_object_whose_parts_own_their_concepts():
    """No forwarding mixin: the run's parts (its voice, what its updates did) are objects it holds."""
    tree = ast.parse(open(os.path.join(ROOT, "engine", "run.py")).read())
    run = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Run")
    assert run.bases == []
    slots = {"__slots__"}
    for module, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ClassDef) and node.name != "Run":
                body = [b for b in node.body if not (isinstance(b, ast.Assign) and
                                                     {ast.unparse(t) for t in b.targets} <= slots)]
                # a class that only declares the attributes another class has is a mixin
                declared = [b for b in body if isinstance(b, ast.AnnAssign) and b.value is None]
                assert not (declared and "__slots__ = ()" in ast.unparse(node)), f"{module}.{node.name}"


ALLOWED_BUILTIN_RAISES = {"ImportError", "AttributeError", "ArgumentTypeError", "NotImplementedError"}


def test_every_error_raised_on_purpose_derives_from_stepsync_error():
    """A caller catches one name (StepSyncError); the errors that were a ValueError still are one. Python's own
    protocol errors (a missing module attribute, an import) and argparse's are not stepsync's to rename."""
    import builtins

    wrong = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = ast.unparse(node.exc.func).split(".")[-1]
                builtin = getattr(builtins, name, None)
                if isinstance(builtin, type) and issubclass(builtin, BaseException) \
                        and name not in ALLOWED_BUILTIN_RAISES:
                    wrong.append(f"{module}:{node.lineno}: raise {name}")
    assert wrong == []
    from stepsync.core import errors

    raised = [value for value in vars(errors).values()
              if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__]
    assert len(raised) >= 10 and all(issubclass(cls, errors.StepSyncError) for cls in raised)
    for name in ("StepSyncConfigError", "ConfigInputError", "AuditInputError", "UnsupportedVersion",
                 "UnreadableFileError", "VerifyInputError"):
        assert issubclass(getattr(errors, name), ValueError), name  # no caller that caught a ValueError breaks


def test_an_invalid_choice_is_worded_one_way():
    worded = []
    for module, path in modules().items():
        text = open(path).read()
        for other in ("choose one of", ": choose '", "must be one of"):
            if other in text:
                worded.append(f"{module}: {other!r}")
    assert worded == []


def test_import_stepsync_loads_nothing_but_itself():
    code = ("import sys; before = set(sys.modules); import stepsync; "
            "print(sorted(set(sys.modules) - before))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "['stepsync', 'stepsync._version']", done.stderr


def test_entry_scripts_live_apart_from_the_tests():
    """Each test folder holds tests only; the scripts tests run as child processes live in tests/entry."""
    tests = os.path.join(REPO, "tests")
    for folder in ("unit", "integration", "multiprocess"):
        others = [name for name in os.listdir(os.path.join(tests, folder))
                  if name.endswith(".py") and not name.startswith("test_")]
        assert others == [], folder
    entry = os.path.join(tests, "entry")
    assert not [name for name in os.listdir(entry) if name.startswith("test_")]
    # Each ends its process at once once its results are written: left to the interpreter's exit, gloo's threads
    # sometimes abort a finished process (exit -6). Ray's workers end as Ray ends them.
    ends = ("end_process_group(", "save_final_parameters(")  # the latter ends it after saving (harness.runs)
    lingering = [name for name in os.listdir(entry) if name.endswith(".py") and name != "ray_runs.py"
                 and not any(call in open(os.path.join(entry, name)).read() for call in ends)]
    assert lingering == []


def test_which_tests_a_stack_runs_is_written_once():
    from harness import matrix

    script = open(os.path.join(REPO, "scripts", "test.sh")).read()
    assert "case " not in script and "envs.py tests" in script
    for stack in matrix.every_stack():
        paths = matrix.tests_of(stack.name)
        assert paths and all(os.path.exists(os.path.join(REPO, path)) for path in paths), stack.name


def test_release_facts_are_read_from_their_rows():
    """A missing package's assumed release is said once (versions.assumed_release), a row is found by what it says,
    never by its place, and the Trainer's remedy reads the release that fixed the drift from its row."""
    import re

    copied = []
    for module, path in modules().items():
        text = open(path).read()
        if module != "stepsync.core.versions":
            copied += [f"{module}: {m}" for m in re.findall(r"or NEWEST|MEASURED_[A-Z]+\[-1\]", text)]
        copied += [f"{module}: {m}" for m in re.findall(r"_ROWS\[\d+\]|FEATURES\[[\d:]+\]", text)]
    assert copied == []
    remedy = open(os.path.join(ROOT, "core", "versions.py")).read().split("def remedy", 1)[1].split("\n\n", 1)[0]
    assert not re.search(r'"\d+\.\d+\.\d+"', remedy)


def test_the_drift_between_both_counts_is_defined_once():
    """Every record of both counts (an event, a forecast and its epochs, a report, a checkpoint's record) is a
    Counted: the drift has one definition."""
    from stepsync.core.events import Counted, DriftEvent
    from stepsync.core.prediction import EpochForecast, Forecast
    from stepsync.core.record import ResumeRecord
    from stepsync.core.report import SyncReport

    defined = [module for module, path in modules().items() if layer(module) == "core"
               for node in ast.walk(ast.parse(open(path).read()))
               if isinstance(node, ast.FunctionDef) and node.name == "drift"]
    assert defined == ["stepsync.core.events"]
    assert all(issubclass(cls, Counted) for cls in (DriftEvent, EpochForecast, Forecast, ResumeRecord, SyncReport))


# The report is written where a run opens and closes (the lifecycle, and the record a resume carries on) and at its
# checks, by the run and its parts (its voice, its reading of each update, its first-forward check); a report
# read at any moment, or after a stop, holds everything found until then.
REPORT_WRITERS = {"stepsync.engine.lifecycle", "stepsync.engine.resume", "stepsync.engine.run",
                  "stepsync.engine.messages", "stepsync.engine.outcomes", "stepsync.engine.outputs",
                  "stepsync.engine.tokens", "stepsync.core.report"}


def test_only_the_run_and_its_lifecycle_write_the_report():
    mutating = (".append", ".extend", ".insert", ".update", ".pop", ".clear", ".remove")
    writers = set()
    for module, path in modules().items():
        calls, targets = calls_and_writes(path)
        for text in targets + [call.rsplit(".", 1)[0] for call in calls if call.endswith(mutating)]:
            parts = text.replace("[", ".").split(".")
            if any(name in ("report", "_report") for name in parts[:-1]):
                writers.add(module)
    assert writers <= REPORT_WRITERS, writers - REPORT_WRITERS
