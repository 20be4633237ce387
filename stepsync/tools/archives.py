"""torch's checkpoint files read without torch: each is a zip archive holding a pickle; the standard library
checks the archive and its checksums, and reads a count from the pickle's opcodes without running it."""
from __future__ import annotations

import os
import pickletools
import zipfile
from typing import Optional


def archive_problem(path: str, verify_data: bool) -> str:
    """Why ``path`` is not a whole torch archive (a zip with a ``data.pkl``), or ''. ``verify_data`` checks
    the checksum of every tensor too (it reads the whole file), not only of the pickle."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty (0 bytes): the save did not finish or the disk filled; resume from an earlier checkpoint"
        with zipfile.ZipFile(path) as archive:
            pickles = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
            if not pickles:
                return "not a torch checkpoint (no data.pkl in the archive)"
            end = max(info.header_offset + info.compress_size for info in archive.infolist())
            if end > size:
                return f"truncated ({size} of {end} bytes): the save did not finish; resume from an earlier checkpoint"
            damaged = archive.testzip() if verify_data else (archive.read(pickles[0]) and None)  # CRCs
            if damaged:
                return f"corrupt: {damaged} fails its checksum; resume from an earlier checkpoint"
    except zipfile.BadZipFile as exc:
        return f"corrupt or truncated ({exc}): the save did not finish or two writers wrote it at once; " \
               "resume from an earlier checkpoint"
    except (OSError, EOFError, ValueError) as exc:
        return f"unreadable ({exc})"
    return ""


def int_in_pickle(path: str, key: str) -> Optional[int]:
    """The integer stored under ``key`` in a torch archive's pickle, read from its opcodes (nothing is run)."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            ops = [(op.name, arg) for op, arg, _ in pickletools.genops(archive.read(name))
                   if op.name not in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")]
    except Exception:  # a file we cannot read gives no count; its problem is reported on its own
        return None
    for (_, arg), (op, value) in zip(ops, ops[1:]):
        if arg == key and op in ("BININT", "BININT1", "BININT2", "INT", "LONG1") and isinstance(value, int):
            return value
    return None
