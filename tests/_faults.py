"""A fault-injecting file layer for tests: disk full (ENOSPC), EIO and read-only folders.

``Faults(folder)`` patches the os-level calls the writers use (``os.write``, ``os.pwrite``,
``os.copy_file_range``, ``os.fsync``, ``os.open``) so that, for files inside ``folder`` only,
writes fail once ``budget`` bytes have been written, ``fsync`` fails, or opening for writing
fails as on a read-only mount. Everything else (the reader's mmap, other folders) is untouched,
so the code under test runs unchanged up to the fault.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest


class Faults:
    """Inject OSError(``err``) into writes under ``folder`` (see the module docstring)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path, *, budget: int | None = None,
                 fsync: bool = False, readonly: bool = False, err: int = errno.ENOSPC) -> None:
        self.folder = str(Path(folder).resolve())
        self.budget, self.fsync_fails, self.readonly, self.err = budget, fsync, readonly, err
        self.written = 0
        self.hits = 0
        real = {n: getattr(os, n) for n in ("write", "pwrite", "copy_file_range", "fsync", "open")}
        self.real = real

        def inside_fd(fd: int) -> bool:
            try:
                return os.readlink(f"/proc/self/fd/{fd}").startswith(self.folder + "/")
            except OSError:
                return False

        def charge(fd: int, n: int) -> int:
            """Bytes allowed of ``n`` (raises once the budget is spent)."""
            if self.budget is None or not inside_fd(fd):
                return n
            left = self.budget - self.written
            if left <= 0:
                self.hits += 1
                raise OSError(self.err, os.strerror(self.err))
            n = min(n, left)
            self.written += n
            return n

        def write(fd, data):
            n = charge(fd, len(memoryview(data)))
            return real["write"](fd, memoryview(data)[:n])

        def pwrite(fd, data, offset):
            n = charge(fd, len(memoryview(data)))
            return real["pwrite"](fd, memoryview(data)[:n], offset)

        def copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
            n = charge(dst, count)
            return real["copy_file_range"](src, dst, n, offset_src, offset_dst)

        def fsync(fd):
            if self.fsync_fails and inside_fd(fd):
                self.hits += 1
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real["fsync"](fd)

        def open_(path, flags, mode=0o777, *, dir_fd=None):
            writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            if self.readonly and writing and str(Path(path).resolve()).startswith(self.folder + "/"):
                self.hits += 1
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real["open"](path, flags, mode, dir_fd=dir_fd)

        for name, fn in (("write", write), ("pwrite", pwrite), ("copy_file_range", copy_file_range),
                         ("fsync", fsync), ("open", open_)):
            monkeypatch.setattr(os, name, fn)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of ``folder`` (names starting with '.' included) with its bytes."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
