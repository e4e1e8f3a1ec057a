"""The writer's files: the spool that payloads stream into, and the atomic assembly of the
final file beside its target (temp file, fsync, rename, folder fsync). REFERENCE_NOTES §1.4
alignment rules live here too, with the directory record they fill in."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .atomic import apply_output_mode
from .constants import LARGE_TENSOR_ALIGN, LARGE_TENSOR_BYTES, TENSOR_ALIGN, Dtype
from .errors import IoError


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def tensor_alignment(nbytes: int, packed: bool = False) -> int:
    """Alignment of a payload relative to data_off: 4096 for ≥ 16 KiB (the reference writers'
    page alignment), else 64 — or 64 for every payload when ``packed`` (spec §4's own rule, which
    a file written to a size budget uses: the pages' padding goes to weights instead)."""
    return LARGE_TENSOR_ALIGN if nbytes >= LARGE_TENSOR_BYTES and not packed else TENSOR_ALIGN


def data_span(sizes: Iterable[int], packed: bool = False) -> int:
    """Bytes of a data section holding payloads of these sizes in this order (each placed at its
    :func:`tensor_alignment` relative to data_off, as the writer places them)."""
    off = 0
    for n in sizes:
        off = align_up(off, tensor_alignment(n, packed)) + n
    return off


@dataclass(frozen=True)
class Entry:
    """A directory record to be written."""

    name: str
    dtype: Dtype
    shape: tuple[int, ...]
    off: int  # relative to data_off
    nbytes: int
    hash: int



def fsync_dir(path: Path) -> None:
    """fsync a folder so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def copy_range(src_fd: int, dst_fd: int, length: int, start: int = 0) -> None:
    """Copy ``length`` bytes from src offset ``start`` to the current end of dst (kernel-side if possible)."""
    done = 0
    while done < length:
        n = 0
        try:
            n = os.copy_file_range(src_fd, dst_fd, length - done, start + done)
        except (AttributeError, OSError):
            chunk = os.pread(src_fd, min(length - done, 1 << 24), start + done)
            n = os.write(dst_fd, chunk)
        if n <= 0:
            raise IoError(f"short copy at byte {done} of {length}")
        done += n


class Spool:
    """A temporary data blob: payloads appended at their aligned relative offsets."""

    def __init__(self, folder: Path, stem: str, base: int = 0, packed: bool = False) -> None:
        fd, name = tempfile.mkstemp(prefix=f".{stem}.", suffix=".spool" if not base else ".tmp", dir=folder)
        self.fd, self.path = fd, Path(name)
        self.base = base  # direct mode: payloads already sit at their final offset (base = data_off)
        self.size = 0
        self.entries: list[Entry] = []
        self.estimate = 0
        self.packed = packed  # every payload on 64 bytes (tensor_alignment)

    def add(self, name: str, dtype: Dtype, shape: tuple[int, ...], view: memoryview, h: int) -> Entry:
        off = align_up(self.size, tensor_alignment(len(view), self.packed))
        if off > self.size:
            os.pwrite(self.fd, bytes(off - self.size), self.base + self.size)
        written = 0
        while written < len(view):
            written += os.pwrite(self.fd, view[written:], self.base + off + written)
        self.size = off + len(view)
        entry = Entry(name, dtype, shape, off, len(view), h)
        self.entries.append(entry)
        return entry

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


def write_temp(target: Path, head: bytes, data_off: int, spool: Spool | None, tail: Iterable[bytes]) -> Path:
    """Write head, zero pad to data_off, the spool's data, then ``tail`` into a synced temp file
    beside ``target``; returns its path (removed again on any error)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp_path = Path(tmp)
    try:
        os.write(fd, head + bytes(data_off - len(head)))
        if spool is not None and spool.size:
            copy_range(spool.fd, fd, spool.size, spool.base)
        for blob in tail:
            mv = memoryview(blob)
            while len(mv):
                mv = mv[os.write(fd, mv):]
        apply_output_mode(fd, target)  # mkstemp made it 0600
        os.fsync(fd)
        os.close(fd)
        fd = -1
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp_path.unlink(missing_ok=True)
        raise
    return tmp_path


def write_file_atomic(target: Path, head: bytes, data_off: int, spool: Spool | None,
                      tail: Iterable[bytes]) -> None:
    """Write head, zero pad to data_off, the spool's data, then ``tail`` under a temp name; rename."""
    tmp_path = write_temp(target, head, data_off, spool, tail)
    try:
        os.replace(tmp_path, target)
        fsync_dir(target.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
