"""File modes of outputs written under a temporary name and renamed into place.

``tempfile.mkstemp`` creates its file 0600. Renamed over the target, that mode would make a model
unreadable to every other account (a server running as its own user), unlike a file made with a
plain ``open(path, "w")``. Every writer that renames a temp file into place calls
:func:`apply_output_mode` on it first: a new target gets ``0o666 & ~umask``, a rewrite of an
existing target keeps that file's mode.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

__all__ = ["apply_output_mode", "current_umask", "output_mode"]

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux ≥ 4.7)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # Elsewhere the only API sets it; the lock keeps two of our threads from racing on it.
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def output_mode(target: str | os.PathLike) -> int:
    """The permission bits ``target`` should get: its current ones if it exists, else 0o666 & ~umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return 0o666 & ~current_umask()


def apply_output_mode(fd_or_path: int | str | os.PathLike, target: str | os.PathLike) -> None:
    """Give the temp file ``fd_or_path`` (an open descriptor or a path) the mode ``target`` should have."""
    mode = output_mode(Path(target))
    if isinstance(fd_or_path, int):
        os.fchmod(fd_or_path, mode)
    else:
        os.chmod(fd_or_path, mode)
