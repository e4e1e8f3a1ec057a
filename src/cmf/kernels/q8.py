"""Fused kernels for ``q8_row`` and ``q8_2f``: int8 rows read in place from the mapped file.

``q8_row``: y[r] = s[r]·Σ_c q[r,c]·x[c]. ``q8_2f``: w = q·s[r]·col[c], so the column field is
folded into the vector once per call (x' = x·col) and the same kernel runs. Four rows share
each load of x (the loop is bound by loads: one x load per four int8→f32 FMAs instead of one):
the row-dot families' one body, :mod:`.rows`. Row scales are converted to f32 once at prepare
time (4 bytes per row).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..format.constants import Dtype
from ._base import FusedLinear
from . import gemm
from ._jit import PARALLEL, SERIAL, int8_f32, threads
from ._jit import chunk as _chunk
from .blas import TRANS, sgemm
from .registry import family
from .rows import ALL_ROWS, row_dots_all, row_dots_par


@numba.njit(**SERIAL)
def q8_dequant(q, s, col, rows, out):  # pragma: no cover - compiled
    """out[i] = q[rows[i]]·s (·col for q8_2f), in the codec's evaluation order."""
    n = q.shape[1]
    two_f = col.shape[0] == n and n > 0
    for i in range(rows.shape[0]):
        r = rows[i]
        sr = s[r]
        if two_f:
            for k in range(n):
                out[i, k] = (int8_f32(q[r, k]) * sr) * col[k]
        else:
            for k in range(n):
                out[i, k] = int8_f32(q[r, k]) * sr


@numba.njit(**PARALLEL)
def q8_dequant_par(q, s, col, rows, out, nt):  # pragma: no cover - compiled
    n = rows.shape[0]
    step = (n + nt - 1) // nt
    for j in prange(nt):
        i0 = min(n, j * step)
        i1 = min(n, i0 + step)
        q8_dequant(q, s, col, rows[i0:i1], out[i0:i1])


@family(Dtype.Q8_ROW, Dtype.Q8_2F)
class Q8Linear(FusedLinear):
    """``q8_row`` / ``q8_2f`` (the column field multiplies x once per call)."""

    group_family = "rows:q8"

    def _gemm(self, a: int, w64: bool, X: np.ndarray, Y: np.ndarray, nt: int) -> None:
        """Y = X @ W.T for a block of tokens through the per-thread sgemm (kernels/gemm.py)."""
        k = X.shape[1]
        q8_gemm(a, w64, self.q, self.s, self.col, self.all_rows, X, Y,
                gemm.bufs("gemm-f", nt, gemm.step_rows(k, 16), k), nt)

    fused_max_t = 16  # measured crossover with dequantize + sgemm: T ~ 16-32 (benchmarks/quant.py)
    rows_exact = True  # rows.row_dots: one row's dot products, the same for every batch size

    def __init__(self, tensor) -> None:  # noqa: ANN001
        super().__init__(tensor)
        rows, cols = self.out_features, self.in_features
        data = tensor.numpy()
        self.q = data[:rows * cols].view(np.int8).reshape(rows, cols)
        self.s = data[rows * cols:rows * cols + 2 * rows].view("<f2").astype(np.float32)
        if tensor.dtype == Dtype.Q8_2F:
            off = rows * cols + 2 * rows
            self.col = data[off:off + 2 * cols].view("<f2").astype(np.float32)
        else:
            self.col = np.zeros(0, np.float32)
        self.all_rows = np.arange(rows, dtype=np.int64)

    def _matmul(self, X, Y, par):
        self._matmul_rows(ALL_ROWS, X, Y, par)

    def _matmul_rows(self, rows, X, Y, par):
        if par:
            row_dots_par(self.q, 0, self.s, self.col, X, Y, rows, threads())
        else:
            row_dots_all(self.q, 0, self.s, self.col, X, Y, rows)

    def group_arrays(self) -> tuple:
        """(rows, kind, scales, column field): what the grouped decode products take (:mod:`.rows`)."""
        return self.q, 0, self.s, self.col

    def _dequant(self, r0, r1, out, par):
        self._dequant_rows(self.all_rows[r0:r1], out, par)

    def _dequant_rows(self, rows, out, par):
        if par:
            q8_dequant_par(self.q, self.s, self.col, rows, out, threads())
        else:
            q8_dequant(self.q, self.s, self.col, rows, out)


# -- prefill: dequantize + sgemm per numba thread (kernels/gemm.py drives it)


@numba.njit(**PARALLEL)
def q8_gemm(addr, ilp64, q, s, col, rows, X, Y, bufs, nt):  # pragma: no cover - compiled
    """q8_row / q8_2f: dequantize R rows (the codec's evaluation order), then sgemm."""
    T, k = X.shape
    n = rows.shape[0]
    R = bufs.shape[1]
    for j in prange(nt):
        buf = bufs[j]
        r0, r1 = _chunk(n, nt, j, 16)
        r = r0
        while r < r1:
            e = min(r1, r + R)
            q8_dequant(q, s, col, rows[r:e], buf)
            sgemm(addr, ilp64, TRANS, T, e - r, k, X, k, buf, k, Y[:, r:], n)
            r = e
