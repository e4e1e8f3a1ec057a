"""Fused kernels for ``q8_row`` and ``q8_2f``: int8 rows read in place from the mapped file.

``q8_row``: y[r] = s[r]·Σ_c q[r,c]·x[c]. ``q8_2f``: w = q·s[r]·col[c], so the column field is
folded into the vector once per call (x' = x·col) and the same kernel runs. Four rows share
each load of x (the loop is bound by loads: one x load per four int8→f32 FMAs instead of one):
the row-dot families' one body, :mod:`.rows`. Row scales are converted to f32 once at prepare
time (4 bytes per row).
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import prange

from ..format.constants import Dtype
from ._base import FusedLinear
from . import gemm, q8i
from ._jit import PARALLEL, SERIAL, int8_f32, threads
from ._jit import chunk as _chunk
from .blas import TRANS, sgemm
from .registry import family
from .rows import ALL_ROWS, fold_cols, row_dots_all, row_dots_par


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

    @property
    def group_family(self) -> str | None:
        """Exact: the row-dot kernels'. Int8 activations: ``q8i`` for q8_row (a q8_2f matrix folds its
        own column field into x, so it runs its own product)."""
        if not self.int8:
            return "rows:q8"
        return None if self.col.size else "q8i"

    def _gemm(self, a: int, w64: bool, X: np.ndarray, Y: np.ndarray, nt: int) -> None:
        """Y = X @ W.T for a block of tokens through the per-thread sgemm (kernels/gemm.py)."""
        k = X.shape[1]
        q8_gemm(a, w64, self.q, self.s, self.col, self.all_rows, X, Y,
                gemm.bufs("gemm-f", nt, gemm.step_rows(k, 16), k), nt)

    fused_max_t = 16  # measured crossover with dequantize + sgemm: T ~ 16-32 (benchmarks/quant.py)
    rows_exact = True  # rows.row_dots: one row's dot products, the same for every batch size
    # With int8 activations every block of tokens takes the integer kernel: prefill included (SmolLM2
    # pp512 1074 t/s against 515 through dequantize + sgemm, docs/PERFORMANCE.md).
    INT8_MAX_T = 1 << 62

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
        self._blocks: np.ndarray | None = None  # q8i's block layout, packed on first int8 use
        self._lock = threading.Lock()
        self.use_int8_activations(False)

    # -- int8 activations (kernels/q8i.py) ----------------------------------------------------------
    def use_int8_activations(self, on: bool = True) -> bool:
        """Products with activations quantized to int8 per group of 32 (:mod:`.q8i`): integer
        dot products over a repacked copy of the rows (as large as the payload, made on first
        use), every batch size through the same per-(row, vector) arithmetic. Results within
        ~1e-2 relative of the exact product. Returns the new setting."""
        self.int8 = bool(on)
        self.fused_max_t = self.INT8_MAX_T if self.int8 else Q8Linear.fused_max_t
        self._int8_op: q8i.Int8Group | None = None
        return self.int8

    def int8_mats(self) -> tuple:
        """(packed blocks, f32 row scales, rows): a matrix of a :class:`~.q8i.Int8Group`."""
        if self._blocks is None:
            with self._lock:
                if self._blocks is None:
                    self._blocks = q8i.pack(self.q, threads())
        return self._blocks, self.s, self.out_features

    def _int8_x(self, X: np.ndarray) -> np.ndarray:
        return q8i.whole_groups(fold_cols(np.ascontiguousarray(X, dtype=np.float32), self.col),
                                -(-self.in_features // q8i.GROUP))

    def _matmul(self, X, Y, par):
        if self.int8:
            if self._int8_op is None:
                self._int8_op = q8i.Int8Group([self.int8_mats()], self.in_features)
            fn, args = self._int8_op.bind(self._int8_x(X), Y, threads() if par else 1)
            fn(*args)
            return
        self._matmul_rows(ALL_ROWS, X, Y, par)

    def _matmul_rows(self, rows, X, Y, par):
        if self.int8 and rows.size:
            blocks, slot = np.unique(rows // q8i.ROWS, return_inverse=True)
            Xq = self._int8_x(X)
            Yb = np.empty((X.shape[0], blocks.size * q8i.ROWS), np.float32)
            xq, xc, d = q8i.buffers(Xq.shape[0], Xq.shape[1] // q8i.GROUP)
            q8i.listed_blocks(self.int8_mats()[0], self.s, Xq, xq, xq.view(np.int32), xc, d, blocks, Yb)
            Y[...] = Yb[:, slot * q8i.ROWS + rows % q8i.ROWS]
            return
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
