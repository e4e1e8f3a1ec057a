"""Decode products for a batch of sequences: several mat-vecs of B inputs in one parallel region.

The server's decode step multiplies B token vectors (one per sequence) by every matrix. Read
once per step, each weight serves all B rows: every thread takes its chunk of rows of every
matrix — the same chunks as the one-token :class:`~cmf.kernels.gemv.MatvecGroup` — and for each
group of four rows (a quarter of the chunk apart, so the prefetchers see four long streams) it
computes the dot products with all B inputs while the rows sit in L1. Each (row, input) sum is
the one-token kernel's ``_dot4`` on the same data, so a sequence's products are bit-for-bit those
it gets alone, whatever else is in the batch. q8, f16/bf16 and f32 run here; other families run
their LinearOps one after another (their batched path: no such guarantee past ``fused_max_t``).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from . import _jit
from ._jit import PARALLEL, SERIAL
from ._jit import chunk as _chunk
from .gemv import NO_ACT, MatvecGroup, _cvt, _dot4
from .q8 import _fold
from .vmath import gated


@numba.njit(**SERIAL)
def spread_rows_batch(w, kind, s, X, Y, r0, r1):  # pragma: no cover - compiled
    """Y[t, r] = (w[r]·X[t])·s[r] for r in [r0, r1) and every t (s empty: no scale), grouped as
    ``gemv.spread_rows`` groups them."""
    L = (r1 - r0) // 4
    T = X.shape[0]
    scaled = s.shape[0] > 0
    for j in range(L):
        ra = r0 + j
        for t in range(T):
            a, b, c, d = _dot4(w, kind, ra, ra + L, ra + 2 * L, ra + 3 * L, X[t])
            if scaled:
                a *= s[ra]
                b *= s[ra + L]
                c *= s[ra + 2 * L]
                d *= s[ra + 3 * L]
            Y[t, ra] = a
            Y[t, ra + L] = b
            Y[t, ra + 2 * L] = c
            Y[t, ra + 3 * L] = d
    for r in range(r0 + 4 * L, r1):
        wr = w[r]
        for t in range(T):
            x = X[t]
            a = np.float32(0)
            for k in range(x.shape[0]):
                a += _cvt(wr[k], kind) * x[k]
            Y[t, r] = a * s[r] if scaled else a


@numba.njit(**SERIAL)
def _act_rows(Y, width, act, i0, i1):  # pragma: no cover - compiled
    """Y[t, i] = act(Y[t, i])·Y[t, width + i] for i in [i0, i1) and every t (``gemv.apply_act``'s
    element function)."""
    for t in range(Y.shape[0]):
        for i in range(i0, i1):
            Y[t, i] = gated(Y[t, i], Y[t, width + i], act)


@numba.njit(**SERIAL)
def _batch_chunk(ws, kind, ss, cols, X, Y, offs, nt, j, act, width):  # pragma: no cover - compiled
    for m in range(len(ws)):
        r0, r1 = _chunk(ws[m].shape[0], nt, j, 4)
        spread_rows_batch(ws[m], kind, ss[m], _fold(X, cols[m]), Y[:, offs[m]:], r0, r1)
    if act >= 0:
        r0, r1 = _chunk(width, nt, j, 4)
        _act_rows(Y, width, act, r0, r1)


@numba.njit(**PARALLEL)
def rows_group_batch(ws, kind, ss, cols, X, Y, offs, nt, act, width):  # pragma: no cover - compiled
    """Every matrix of ``ws`` (one dtype family) times every row of X, one chunk of rows per thread."""
    for j in prange(nt):
        _batch_chunk(ws, kind, ss, cols, X, Y, offs, nt, np.int64(j), act, width)


@numba.njit(**SERIAL)
def rows_group_batch_serial(ws, kind, ss, cols, X, Y, offs, act, width):  # pragma: no cover - compiled
    """:func:`rows_group_batch` on the calling thread."""
    _batch_chunk(ws, kind, ss, cols, X, Y, offs, 1, 0, act, width)


class BatchGroup:
    """:class:`~cmf.kernels.gemv.MatvecGroup` for B inputs: ``Y[b] = group(X[b])`` (the matrices'
    outputs side by side, or the gated activation ``act(W_0·x)·(W_1·x)`` in the first half)."""

    def __init__(self, ops: list, act: str | None = None) -> None:
        self.group = MatvecGroup(ops, act)
        fam = self.group.family
        self.direct = fam is not None and (fam in ("q8", "f32") or fam.startswith("half"))
        self.out_features = self.group.out_features
        self.width = self.group.width

    @property
    def ops(self) -> list:
        return self.group.ops

    def __call__(self, X: np.ndarray, nt: int | None = None) -> np.ndarray:
        """X: [B, in] float32 → [B, out_features] float32 (a new array)."""
        g = self.group
        nt = _jit.threads() if nt is None else nt
        X = np.ascontiguousarray(X, dtype=np.float32)
        Y = np.empty((X.shape[0], g.out_features), np.float32)
        if not self.direct:
            for o, off, n in zip(g.ops, g.offs, g.sizes):
                Y[:, off:off + n] = o(X)
            if g.act != NO_ACT:
                _act_rows(Y, g.width, g.act, 0, g.width)
            return Y
        if nt > 1 and g.work < _jit.PARALLEL_MIN_BYTES:  # MatvecGroup.bind's rule: the same row chunks
            nt = 1
        if nt > 1:
            rows_group_batch(*g._tup, X, Y, g._offs, nt, g.act, g.width)
        else:
            rows_group_batch_serial(*g._tup, X, Y, g._offs, g.act, g.width)
        return Y


__all__ = ["BatchGroup", "rows_group_batch", "spread_rows_batch"]
