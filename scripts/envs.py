"""Build a virtual environment for one set of pins, fast, and reuse it while the pins stay the same.

    python3 scripts/envs.py build PATH AS_OF REQUIREMENT...    prints PATH when it is ready
    python3 scripts/envs.py stack NAME                         a test stack of tests/harness/matrix.py, in .stacks/NAME
    python3 scripts/envs.py tools PATH REQUIREMENT...          a small environment of tools (no torch), e.g. linters
    python3 scripts/envs.py pins NAME                          the pinned releases of a test stack
    python3 scripts/envs.py tests NAME                         the tests it runs (tests/harness/matrix.py)
    python3 scripts/envs.py lanes N NAME...                    the stacks in N lanes of about equal test time

- uv installs everything when it is on PATH (seconds per environment); pip is the fallback.
- torch is the CPU build 2.13.0: the local wheel that pip's find-links names, else ``pip install torch==2.13.0``
  (letting an installer resolve torch by itself pulls a multi-GB CUDA build).
- ``AS_OF`` (YYYY-MM-DD) makes uv resolve every dependency that is not pinned with ``==`` as it stood that day
  (``--exclude-newer``), so an old transformers gets the huggingface_hub, tokenizers and numpy of its time.
  torch and what torch needs are exempt: they come from today. pip ignores the date.
- The environment is reused while a stamp of the pins, AS_OF and the installer matches; otherwise rebuilt.

Used by scripts/stack.sh (the test stacks) and scripts/probe.py (one environment per release).
"""
import glob
import hashlib
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the stack matrix: tests/harness/matrix.py

TORCH = "2.13.0"
# torch 2.13's own requirements: resolved today, whatever AS_OF says.
TORCH_DEPENDENCIES = ("torch", "setuptools", "sympy", "mpmath", "networkx", "typing-extensions", "fsspec",
                      "filelock", "jinja2", "markupsafe")


def _find_links():
    places = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        configured = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                                    capture_output=True, text=True).stdout.split()
        places += configured
    except OSError:
        pass
    return [p for p in places if os.path.isdir(p)]


def local_torch_wheel():
    """The CPU wheel of torch 2.13.0 for this Python that pip's find-links hold, or None."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for place in _find_links():
        found = sorted(glob.glob(os.path.join(place, f"torch-{TORCH}+cpu-{tag}-*.whl")))
        if found:
            return found[0]
    return None


def uv_command():
    """How to run uv here (its own command, or the module pip installed), or None."""
    if shutil.which("uv"):
        return ["uv"]
    found = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True)
    return [sys.executable, "-m", "uv"] if found.returncode == 0 else None


def installer():
    return "uv" if uv_command() else "pip"


def stamp_of(requirements, as_of, tool):
    text = "\n".join([tool, as_of, TORCH, *requirements])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _build_env():
    # DeepSpeed's setup.py imports torch when DS_ACCELERATOR names an accelerator, and an isolated sdist build
    # has no torch: builds get the environment without it (the tests set it for the runs).
    return {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR" and not k.startswith("DS_BUILD_")}


def _run(command):
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_build_env())
    if done.returncode:
        sys.stderr.write(done.stdout[-6000:])
        raise SystemExit(f"failed ({done.returncode}): {' '.join(command)}")


def build(path, as_of, requirements, editable=None):
    """Create (or reuse) the environment at ``path``; ``editable``: a project folder installed with -e, no deps."""
    tool = installer()
    stamp = os.path.join(path, ".stepsync-env-" + stamp_of(list(requirements) + [editable or ""], as_of, tool))
    if os.path.exists(stamp):
        if editable:
            _install_editable(path, editable)
        return path
    shutil.rmtree(path, ignore_errors=True)
    python = os.path.join(path, "bin", "python")
    wheel = local_torch_wheel()
    if tool == "uv":
        uv = uv_command()
        _run([*uv, "venv", "-q", "--seed", "-p", sys.executable, path])
        dated = ["--exclude-newer", f"{as_of}T23:59:59Z"]
        pinned = [r.split("==")[0].split("[")[0] for r in requirements if "==" in r]  # exact: the date is for the rest
        for name in (*TORCH_DEPENDENCIES, *pinned):
            dated += ["--exclude-newer-package", f"{name}=2100-01-01T00:00:00Z"]
        torch = [wheel] if wheel else []
        if not wheel:  # pip knows where this machine keeps the CPU build
            _run([python, "-m", "pip", "install", "-q", f"torch=={TORCH}"])
        _run([*uv, "pip", "install", "-q", "-p", python, *dated, *torch, *requirements])
    else:
        _run([sys.executable, "-m", "venv", path])
        pip = [python, "-m", "pip", "install", "-q"]
        _run(pip + ["--upgrade", "pip", "setuptools<81", "wheel"])
        _run(pip + [wheel or f"torch=={TORCH}"])
        _run(pip + ["--no-build-isolation", *requirements])
    if editable:
        _install_editable(path, editable)
    open(stamp, "w").close()
    return path


def tools(path, requirements):
    """An environment of ``requirements`` only (no torch), reused while they stay the same."""
    tool = installer()
    stamp = os.path.join(path, ".stepsync-env-" + stamp_of(list(requirements), "tools", tool))
    if os.path.exists(stamp):
        return path
    shutil.rmtree(path, ignore_errors=True)
    python = os.path.join(path, "bin", "python")
    if tool == "uv":
        _run([*uv_command(), "venv", "-q", "-p", sys.executable, path])
        _run([*uv_command(), "pip", "install", "-q", "-p", python, *requirements])
    else:
        _run([sys.executable, "-m", "venv", path])
        _run([python, "-m", "pip", "install", "-q", *requirements])
    open(stamp, "w").close()
    return path


def _install_editable(path, project):
    """Install ``project`` -e, no dependencies; again whenever its setup.cfg changes (entry points, packages)."""
    with open(os.path.join(project, "setup.cfg"), "rb") as handle:
        stamp = os.path.join(path, ".stepsync-editable-" + hashlib.sha256(handle.read()).hexdigest()[:16])
    if os.path.exists(stamp):
        return
    python = os.path.join(path, "bin", "python")
    uv = uv_command()
    installer_args = [*uv, "pip", "install", "-q", "-p", python] if uv else [python, "-m", "pip", "install", "-q"]
    _run([*installer_args, "--no-deps", "--no-build-isolation", "-e", project])
    for old in (n for n in os.listdir(path) if n.startswith(".stepsync-editable-")):
        os.remove(os.path.join(path, old))
    open(stamp, "w").close()


def stack(name):
    """Build the test stack ``name`` of tests/harness/matrix.py into .stacks/NAME, with stepsync installed -e."""
    from harness import matrix as support  # pure Python: no torch, no transformers

    spec = support.spec(name)
    return build(os.path.join(ROOT, ".stacks", name), spec.as_of, spec.requirements(), editable=ROOT)


def main(argv):
    if len(argv) >= 3 and argv[0] == "build":
        print(build(argv[1], argv[2], argv[3:]))
        return 0
    if len(argv) == 2 and argv[0] == "pins":
        from harness import matrix as support

        print(", ".join(r.replace("==", " ") for r in support.spec(argv[1]).requirements() if "==" in r))
        return 0
    if len(argv) == 2 and argv[0] == "tests":
        from harness import matrix as support

        print(" ".join(support.tests_of(argv[1])))
        return 0
    if len(argv) >= 3 and argv[0] == "tools":
        print(tools(argv[1], argv[2:]))
        return 0
    if len(argv) >= 2 and argv[0] == "lanes":  # lanes N NAME...: one line of stack names per lane
        from harness import matrix as support

        for lane in support.lanes(argv[2:], int(argv[1])):
            print(" ".join(lane))
        return 0
    if argv == ["stack", "--list"]:
        from harness import matrix as support

        print(" ".join(s.name for s in support.every_stack()))
        return 0
    if len(argv) == 2 and argv[0] == "stack":
        try:
            print(stack(argv[1]))
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
