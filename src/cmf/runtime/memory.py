"""Resident memory: give back the mapped pages of 4-bit payloads once their tiles are repacked.

The 4-bit kernels copy each 64-row tile into a vectorizable layout the first time a product
needs it (kernels/q4.py) and from then on read only the copy (rows past the last whole tile
excepted). The mapped source pages they read while packing stay in the process's resident set,
so without this a 4-bit model would hold its weights twice (measured: 108 MiB file, ~200 MiB
resident). :class:`PackedSourceReleaser` drops the source rows of packed tiles from the mapping
(``madvise(MADV_DONTNEED)``: the file is read-only and shared, so a later read faults the same
bytes back in from the page cache — correct, only slower) layer by layer, so the peak exceeds
the final figure by about one layer.
"""

from __future__ import annotations

import logging
import mmap
import weakref

import numpy as np

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def _ranges(op) -> list[tuple[np.ndarray, int]]:  # noqa: ANN001 - a kernels.tiled.TiledLinear
    """(source array, bytes per row) of each repacked per-row source of ``op``."""
    out = []
    for a in (op.src, op.scs, op.cs, op.params):
        if a.ndim >= 2 and a.shape[0] == op.out_features and a.size:
            out.append((a, a.nbytes // a.shape[0]))
    return out


class PackedSourceReleaser:
    """Tracks, per 4-bit LinearOp, which packed tiles' source rows were already released."""

    def __init__(self, file) -> None:  # noqa: ANN001 - a CmfFile
        self._maps = [(p.u8.ctypes.data, p.u8.size, p.mm) for p in file._parts if getattr(p, "mm", None) is not None]
        self._done: "weakref.WeakKeyDictionary[object, np.ndarray]" = weakref.WeakKeyDictionary()
        self.released = 0  # bytes given back so far

    def _mapping(self, addr: int):  # noqa: ANN202
        for base, size, mm in self._maps:
            if base <= addr < base + size:
                return base, mm
        return None, None

    def release(self, ops) -> int:  # noqa: ANN001 - LinearOps
        """Release the source pages of tiles packed since the last call; returns bytes released."""
        from ..kernels.q4 import R
        from ..kernels.tiled import TiledLinear

        total = 0
        for op in ops:
            op = getattr(op, "tiled", op)  # q1t: the tiles inside its Q1Linear
            if not isinstance(op, TiledLinear) or not op.ntiles:
                continue
            done = self._done.get(op)
            if done is None:
                done = self._done[op] = np.zeros(op.ntiles, bool)
            new = np.flatnonzero((op.ready != 0) & ~done)
            if new.size == 0:
                continue
            done[new] = True
            # runs of consecutive newly packed tiles
            cuts = np.flatnonzero(np.diff(new) != 1) + 1
            for run in np.split(new, cuts):
                r0, r1 = int(run[0]) * R, (int(run[-1]) + 1) * R
                for arr, per_row in _ranges(op):
                    total += self._drop(arr.ctypes.data + r0 * per_row, (r1 - r0) * per_row)
        self.released += total
        return total

    def _drop(self, addr: int, length: int) -> int:
        base, mm = self._mapping(addr)
        if mm is None:
            return 0
        start = -(-(addr - base) // PAGE) * PAGE  # whole pages inside the range only
        end = (addr - base + length) // PAGE * PAGE
        if end <= start:
            return 0
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (AttributeError, OSError, ValueError) as exc:  # pragma: no cover - platform without madvise
            log.debug("madvise(DONTNEED) failed: %s", exc)
            return 0
        return end - start
