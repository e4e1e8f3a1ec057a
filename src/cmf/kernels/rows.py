"""The one row-range body of the row-dot families: ``q8_row`` / ``q8_2f``, ``f16`` / ``bf16``, ``f32``.

Every product of these dtypes runs :func:`row_dots` (or its paired form, :func:`row_dots_pairs`)
over a range of an index of rows: the LinearOps' fused path (blocks of tokens up to
``fused_max_t``, the row-restricted products of task masks), the one-token grouped decode
(``gemv.MatvecGroup``) and the server's batched decode (``gemv_batch.BatchGroup``). Each (row,
vector) sum is ``dot_ir``'s one summation order, so a row's value is the same in every one of them,
for any batch size and on every CPU with fused multiply-add.

Why four rows a quarter of the range apart: four *adjacent* rows are four short streams inside
one or two 4 KB pages, which the hardware prefetchers never lock on to (measured 8 GB/s from DRAM
on 2 threads); four rows a quarter range apart are four long sequential streams (36 GB/s). Each
group of four rows is read once for every vector of the block while it sits in L1.

The weights ``w`` are the mapped rows (int8 codes, f32, or f16/bf16 bits with ``kind``); ``s`` the
per-row scales (empty: none); ``col`` q8_2f's column field, folded into the vectors once per call
(empty: none).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ._jit import PARALLEL, SERIAL
from .dot_ir import dot1, dot4, dot22

EMPTY = np.zeros(0, np.float32)  # "no scales" / "no column field"
ALL_ROWS = np.zeros(0, np.int64)  # as ``rows``: every row, in order (no index array read beside the weights)


@numba.njit(inline="always")
def _row(rows, i):  # pragma: no cover - compiled
    """The weight row of output i: rows[i], or i itself for the empty index (:data:`ALL_ROWS`).
    (An index array read beside the weights is four more streams per thread: SmolLM2 q8 decode
    on 2 threads measured 122-164 against 157-171 t/s with it.)"""
    return i if rows.shape[0] == 0 else rows[i]


@numba.njit(**SERIAL)
def fold_cols(X, col):  # pragma: no cover - compiled
    """X·col (a copy) when there is a column field, else X itself."""
    if col.shape[0] == 0:
        return X
    out = np.empty_like(X)
    for t in range(X.shape[0]):
        for k in range(X.shape[1]):
            out[t, k] = X[t, k] * col[k]
    return out


@numba.njit(**SERIAL)
def row_dots(w, kind, s, X, Y, rows, i0, i1):  # pragma: no cover - compiled
    """Y[t, i] = (w[rows[i]]·X[t])·s[rows[i]] for i in [i0, i1) and every t (s empty: no scale;
    ``rows`` empty: row i itself), four rows at a time taken a quarter of the range apart."""
    L = (i1 - i0) // 4
    T = X.shape[0]
    scaled = s.shape[0] > 0
    for j in range(L):
        ia = i0 + j
        ib, ic, id_ = ia + L, ia + 2 * L, ia + 3 * L
        ra, rb, rc, rd = _row(rows, ia), _row(rows, ib), _row(rows, ic), _row(rows, id_)
        wa, wb, wc, wd = w[ra], w[rb], w[rc], w[rd]
        for t in range(T):
            a, b, c, d = dot4(wa, wb, wc, wd, X[t], kind)
            if scaled:
                a *= s[ra]
                b *= s[rb]
                c *= s[rc]
                d *= s[rd]
            Y[t, ia] = a
            Y[t, ib] = b
            Y[t, ic] = c
            Y[t, id_] = d
    for i in range(i0 + 4 * L, i1):
        r = _row(rows, i)
        wr = w[r]
        for t in range(T):
            a = dot1(wr, X[t], kind)
            Y[t, i] = a * s[r] if scaled else a


@numba.njit(**SERIAL)
def _pair(w, kind, s, X, Y, rows, ia, ib):  # pragma: no cover - compiled
    """Rows rows[ia] and rows[ib] (ia == ib for a lone row) times every vector, two per pass."""
    T = X.shape[0]
    ra, rb = _row(rows, ia), _row(rows, ib)
    wa, wb = w[ra], w[rb]
    scaled = s.shape[0] > 0
    sa = s[ra] if scaled else np.float32(1)
    sb = s[rb] if scaled else np.float32(1)
    t = 0
    while t < T:
        u = min(t + 1, T - 1)  # an odd last vector is paired with itself
        a0, b0, a1, b1 = dot22(wa, wb, X[t], X[u], kind)
        if scaled:
            a0 *= sa
            b0 *= sb
            a1 *= sa
            b1 *= sb
        Y[t, ia] = a0
        Y[t, ib] = b0
        Y[u, ia] = a1
        Y[u, ib] = b1
        t += 2


@numba.njit(**SERIAL)
def row_dots_pairs(w, kind, s, X, Y, rows, i0, i1):  # pragma: no cover - compiled
    """:func:`row_dots` through :func:`~cmf.kernels.dot_ir.dot22`: each weight block converted
    once for two vectors (the same rows grouped the same way, the same values)."""
    L = (i1 - i0) // 4
    for j in range(L):
        ia = i0 + j
        _pair(w, kind, s, X, Y, rows, ia, ia + L)
        _pair(w, kind, s, X, Y, rows, ia + 2 * L, ia + 3 * L)
    for i in range(i0 + 4 * L, i1):
        _pair(w, kind, s, X, Y, rows, i, i)


@numba.njit(**SERIAL)
def row_dots_all(w, kind, s, col, X, Y, rows):  # pragma: no cover - compiled
    """:func:`row_dots` over every given row (every row for :data:`ALL_ROWS`), the column field
    folded into X first."""
    n = rows.shape[0] if rows.shape[0] else w.shape[0]
    row_dots(w, kind, s, fold_cols(X, col), Y, rows, 0, n)


@numba.njit(**PARALLEL)
def row_dots_par(w, kind, s, col, X, Y, rows, nt):  # pragma: no cover - compiled
    """:func:`row_dots_all` with one contiguous chunk of ``rows`` per thread (``nt`` threads)."""
    X = fold_cols(X, col)
    n = rows.shape[0] if rows.shape[0] else w.shape[0]
    step = ((n + nt - 1) // nt + 3) // 4 * 4
    for j in prange(nt):
        i0 = min(n, j * step)
        row_dots(w, kind, s, X, Y, rows, i0, min(n, i0 + step))


__all__ = ["ALL_ROWS", "EMPTY", "fold_cols", "row_dots", "row_dots_all", "row_dots_pairs", "row_dots_par"]
