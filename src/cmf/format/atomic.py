"""File modes of outputs written under a temporary name and renamed into place.

``tempfile.mkstemp`` creates its file 0600. Renamed over the target, that mode would make a model
unreadable to every other account (a server running as its own user), unlike a file made with a
plain ``open(path, "w")``. Every writer that renames a temp file into place calls
:func:`apply_output_mode` on it first: a new target gets ``0o666 & ~umask``, a rewrite of an
existing target keeps that file's mode.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .errors import IoError

__all__ = ["apply_output_mode", "check_writable", "current_umask", "io_error", "output_mode"]

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


def io_error(exc: OSError, what: str) -> "IoError":
    """A typed IoError for ``exc`` (errno kept); ``what`` says what failed and what is left, with
    ``{reason}`` where the OS's reason goes."""
    from .errors import IoError

    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        reason = "no space left on the device"
    err = IoError(what.replace("{reason}", reason))
    err.errno = exc.errno  # strerror stays unset: OSError.__str__ would print it instead of the message
    return err


def check_writable(target: str | os.PathLike, *, in_place: bool = False) -> None:
    """Raise IoError now, before any work, when ``target`` cannot be written.

    In place: the file must open for writing. Otherwise its folder must take a new file, probed
    by creating and removing one (``os.access`` answers yes to root on a folder it could not
    write through ACLs or on some network mounts; the probe is what the writer will do)."""
    import tempfile

    target = Path(target)
    try:
        if in_place:
            os.close(os.open(target, os.O_RDWR))
        else:
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=target.parent)
            os.close(fd)
            os.unlink(name)
    except FileNotFoundError:
        raise  # the callers report a missing file or folder in their own words
    except OSError as exc:
        where = target if in_place else target.parent
        raise io_error(exc, f"{where}: cannot write {'the file' if in_place else 'into this folder'} "
                            f"({{reason}}); nothing was done") from None
