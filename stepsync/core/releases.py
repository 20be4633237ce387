"""What a framework's releases do, asked of the framework: its packages name the release table that says how it
counts (the Trainer's rows, with accelerate's and DeepSpeed's, or Lightning's), and its descriptor adds what its
own loop fixes. The adapters and the command line ask here, never which framework it is."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Optional

from .frameworks import Framework
from .lightning_versions import LightningStack, lightning_behaviour_of
from .versions import Stack, StackBehaviour, assumed_release, behaviour_of, installed_version

Versions = Mapping[str, Optional[str]]

# The name a package was also published under, read where the first is not installed.
ALSO_PUBLISHED_AS = {"lightning": "pytorch-lightning"}


def _release(versions: Versions, package: str) -> str:
    return versions.get(package) or assumed_release(package)


def _transformers_rows(versions: Versions) -> StackBehaviour:
    return behaviour_of(Stack(_release(versions, "transformers"), _release(versions, "accelerate"),
                              _release(versions, "deepspeed")))


def _lightning_rows(versions: Versions) -> StackBehaviour:
    return lightning_behaviour_of(LightningStack(_release(versions, "lightning"), _release(versions, "deepspeed")))


# Each table by the name a framework's ``releases`` gives it.
RELEASE_TABLES: Dict[str, Callable[[Versions], StackBehaviour]] = {
    "transformers": _transformers_rows, "lightning": _lightning_rows}


def installed_versions(packages: Iterable[str]) -> Dict[str, Optional[str]]:
    """The installed release of each package (under the name it was also published as), None where none is."""
    return {package: installed_version(package) or (
        installed_version(ALSO_PUBLISHED_AS[package]) if package in ALSO_PUBLISHED_AS else None)
        for package in packages}


def behaviour_at(framework: Framework, versions: Versions) -> StackBehaviour:
    """What the releases of ``framework``'s packages in ``versions`` do, run by it (a package missing there counts as
    :func:`~stepsync.core.versions.assumed_release` says; packages it does not name are not read). Raises
    :class:`~stepsync.core.errors.UnsupportedVersion` below the oldest release covered."""
    named = {package: versions.get(package) for package in framework.packages}
    return framework.applied_to(RELEASE_TABLES[framework.releases](named))


def installed_behaviour(framework: Framework) -> StackBehaviour:
    """What the installed releases do, run by ``framework``."""
    return behaviour_at(framework, installed_versions(framework.packages))
