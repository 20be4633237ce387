"""The pip command that installs stepsync's extras from where this stepsync came from: its clone (a ``setup.cfg``
beside the package), or the folder or wheel pip recorded (``direct_url.json``); the package name only where pip
installed it from an index. Every install hint stepsync prints comes from here."""
from __future__ import annotations

import json
import os
from typing import Optional


def source() -> Optional[str]:
    """The clone, folder or wheel this stepsync was installed from, or None (an index, or unknown)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # stepsync/core/ -> root
    if os.path.isfile(os.path.join(root, "setup.cfg")):
        return root
    from importlib import metadata  # 15-20 ms: paid only where a hint is printed, never by `import stepsync`

    try:
        url = json.loads(metadata.distribution("stepsync").read_text("direct_url.json") or "{}").get("url", "")
    except (metadata.PackageNotFoundError, ValueError, AttributeError):
        return None
    return url[len("file://"):] if url.startswith("file://") else None


# torch first, as the README's Install says: its CPU build where there is no GPU (pip's default index holds the
# CUDA build, gigabytes), the default one where there is.
TORCH_INSTALL = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu (a machine without a "
                 "GPU; with one: pip install torch==2.13.0, or the torch your project uses)")


def training_install_hint(extra: str) -> str:
    """How to install what training with stepsync needs: torch, then stepsync's ``extra``."""
    return f"{TORCH_INSTALL}, then {install_hint(extra)}"


def install_hint(extra: Optional[str] = None) -> str:
    """``pip install '<where stepsync came from>[extra]'``."""
    where = source() or "stepsync"
    return f"pip install '{where}[{extra}]'" if extra else f"pip install '{where}'"
