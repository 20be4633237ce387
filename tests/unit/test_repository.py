"""The repository's own text speaks of the project as it is: every path it cites exists, and no history (which
issue, which session, what an earlier version did) is told in code, tests, scripts, notebook or README."""
import os
import re
import subprocess

from harness.paths import REPO

TEXT = (".py", ".md", ".ipynb", ".sh", ".cfg", ".toml")
HISTORY = re.compile(r"\bissues? \d{1,3}\b|previous (?:stop|session)|this session|the seed\b|earlier measurement|"
                     r"in brackets|lent to this|no GPU was lent", re.IGNORECASE)


def repository_text():
    listed = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO).stdout.split()
    for name in listed:
        if name.endswith(TEXT) or name.startswith(".ci/"):
            path = os.path.join(REPO, name)
            if os.path.isfile(path):
                yield name, open(path, errors="replace").read()


def test_every_cited_package_path_exists():
    """Every ``stepsync/....py`` that the code, tests, scripts, notebook or README name is a real file."""
    cited = {}
    for name, text in repository_text():
        for path in re.findall(r"\b(?:stepsync|tests|scripts|probes|benchmarks)/[\w/]+\.(?:py|sh|json)\b", text):
            cited.setdefault(path, name)
    missing = {path: where for path, where in cited.items() if not os.path.isfile(os.path.join(REPO, path))}
    assert cited and missing == {}


def test_no_history_words():
    told = [f"{name}: {match.group(0)!r}" for name, text in repository_text() for match in HISTORY.finditer(text)
            if name != "tests/unit/test_repository.py"]
    assert told == []


def test_every_test_file_has_a_name_of_its_own():
    """The test folders are not packages: two test files of one name would collide when pytest imports them."""
    listed = subprocess.run(["git", "ls-files", "tests"], capture_output=True, text=True, cwd=REPO).stdout.split()
    names = [os.path.basename(name) for name in listed if os.path.basename(name).startswith("test_")]
    assert sorted(set(names)) == sorted(names)


def test_every_relative_link_in_the_docs_resolves():
    """README.md and docs/*.md link each other and the repository's files: every such link names a real file."""
    pages = [name for name, _ in repository_text() if name == "README.md" or (name.startswith("docs/")
                                                                               and name.endswith(".md"))]
    assert "README.md" in pages and len(pages) > 5
    broken = []
    for name in pages:
        text = open(os.path.join(REPO, name)).read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = os.path.normpath(os.path.join(REPO, os.path.dirname(name), target.split("#")[0]))
            if not os.path.exists(path):
                broken.append(f"{name}: {target}")
    assert broken == []


def test_the_landing_page_is_short_and_links_every_docs_page():
    readme = open(os.path.join(REPO, "README.md")).read()
    assert len(readme.splitlines()) <= 200
    listed = subprocess.run(["git", "ls-files", "docs"], capture_output=True, text=True, cwd=REPO).stdout.split()
    assert listed and all(f"({page})" in readme for page in listed if page.endswith(".md"))


def test_the_map_of_tests_names_every_module_of_the_core_and_the_run():
    text = open(os.path.join(REPO, "tests", "README.md")).read()
    rows = dict(re.findall(r"^\| `(stepsync/[\w/]+\.py)` \| (.+) \|$", text, re.M))
    modules = sorted(f"stepsync/{folder}/{name}" for folder in ("core", "engine")
                     for name in os.listdir(os.path.join(REPO, "stepsync", folder))
                     if name.endswith(".py") and name != "__init__.py")
    assert sorted(rows) == modules
    named = {path for cell in rows.values() for path in re.findall(r"`([\w/]+\.py)`", cell)}
    assert named and all(os.path.isfile(os.path.join(REPO, "tests", path)) for path in named), named
