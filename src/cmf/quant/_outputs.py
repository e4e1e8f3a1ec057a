"""Memory for large decode outputs, recycled once every array over it has died.

Why: a fresh 64 MB array costs more than decoding into it. The kernel zeroes each page on first
touch (about 5 ms for 64 MB here, with or without huge pages), while the decoders write the
same 64 MB in 1.5-3 ms. Code that decodes tensor after tensor (export, requant, quant-report,
``CmfFile.array`` in a loop) drops each result before it asks for the next, so the pages of the
dead output are handed to the next one of a fitting size instead of back to the kernel.

Safety: a block is reused only after the root array carved from it is garbage, and numpy makes
every view, reshape and slice of an output keep that root alive, so memory a caller can still
reach is never handed out twice. Contents are undefined, as with ``np.empty``: the decoders
overwrite every element.

Bounds: only outputs of at least ``MIN_BYTES`` come from here (numpy's own caches serve small
ones well); at most ``CACHED_BLOCKS`` dead blocks and ``CMF_DECODE_CACHE_MB`` (default 256) MB
wait for reuse, oldest dropped first; ``CMF_DECODE_CACHE_MB=0`` turns recycling off. ``clear()``
returns every waiting block to the kernel.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref

import numpy as np

log = logging.getLogger(__name__)

MIN_BYTES = 4 << 20
CACHED_BLOCKS = 4
_HUGE = 2 << 20

_lock = threading.Lock()
_free: list[mmap.mmap] = []  # dead blocks, oldest first


def _budget() -> int:
    """Bytes of dead blocks kept for reuse (``CMF_DECODE_CACHE_MB``, default 256)."""
    try:
        return max(0, int(os.environ.get("CMF_DECODE_CACHE_MB", "256"))) << 20
    except ValueError:
        return 256 << 20


def _new_block(nbytes: int) -> mmap.mmap:
    size = (nbytes + _HUGE - 1) // _HUGE * _HUGE
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:  # as numpy does for large arrays: fewer faults and TLB misses
            block.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # pragma: no cover - kernel without THP
            pass
    return block


def _take(nbytes: int) -> mmap.mmap | None:
    """The smallest dead block that holds ``nbytes`` without wasting more than half of it."""
    with _lock:
        best = None
        for i, block in enumerate(_free):
            if nbytes <= len(block) <= 2 * nbytes and (best is None or len(block) < len(_free[best])):
                best = i
        return _free.pop(best) if best is not None else None


def _give_back(block: mmap.mmap) -> None:
    budget = _budget()
    with _lock:
        _free.append(block)
        while _free and (len(_free) > CACHED_BLOCKS or sum(len(b) for b in _free) > budget):
            _free.pop(0)  # dropping the last reference unmaps it


def empty(shape: int | tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    """An uninitialized C-contiguous array, from a recycled block when it is large enough."""
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes < MIN_BYTES or _budget() == 0:
        return np.empty(shape, dtype)
    block = _take(nbytes)
    if block is None:
        try:
            block = _new_block(nbytes)
        except (OSError, ValueError) as exc:  # pragma: no cover - out of address space
            log.debug("decode output block of %d bytes: %s; using np.empty", nbytes, exc)
            return np.empty(shape, dtype)
    root = np.frombuffer(block, np.uint8, count=nbytes)
    # every view of the result keeps ``root`` alive (numpy collapses bases to it), so the block
    # comes back only when nothing can reach it
    weakref.finalize(root, _give_back, block)
    return root.view(dtype).reshape(shape)


def cached_bytes() -> int:
    """Bytes of dead blocks now waiting for reuse."""
    with _lock:
        return sum(len(b) for b in _free)


def clear() -> None:
    """Return every waiting block to the kernel."""
    with _lock:
        _free.clear()
