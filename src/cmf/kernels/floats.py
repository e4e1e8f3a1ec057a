"""Float matrices: ``f32`` through BLAS on the mapped view; ``f16`` and ``bf16`` fused.

f32 needs no decoding, so the product is numpy's sgemv/sgemm straight on the zero-copy view;
only the row-restricted product has a kernel (it reads just the selected rows). f16 and bf16
convert in registers (f16 by the CPU's conversion instruction where there is one) and share
each x load between four rows, like the q8 kernel (both run :mod:`.rows`' one body).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..format.constants import Dtype
from ._base import FusedLinear, as_batch
from . import gemm
from ._jit import PARALLEL, SERIAL, bf16_to_f32, f16_to_f32, parallel_for, threads
from ._jit import chunk as _chunk
from .blas import TRANS, sgemm
from .registry import family
from .rows import ALL_ROWS, EMPTY, row_dots_all, row_dots_par

F32, F16, BF16 = 0, 1, 2


@numba.njit(inline="always")
def _cvt(v, kind):  # pragma: no cover - compiled
    if kind == F16:
        return f16_to_f32(v)
    return bf16_to_f32(v)


@numba.njit(**SERIAL)
def half_dequant(w, kind, rows, out):  # pragma: no cover - compiled
    n = w.shape[1]
    for i in range(rows.shape[0]):
        wr = w[rows[i]]
        for k in range(n):
            out[i, k] = _cvt(wr[k], kind)


@numba.njit(**PARALLEL)
def half_dequant_par(w, kind, rows, out, nt):  # pragma: no cover - compiled
    n = rows.shape[0]
    step = (n + nt - 1) // nt
    for j in prange(nt):
        i0 = min(n, j * step)
        i1 = min(n, i0 + step)
        half_dequant(w, kind, rows[i0:i1], out[i0:i1])


@family(Dtype.F32)
class F32Linear(FusedLinear):
    """f32: BLAS on the zero-copy view of the mapped bytes."""

    group_family = "rows:f32"

    def _gemm(self, a: int, w64: bool, X: np.ndarray, Y: np.ndarray, nt: int) -> None:
        """Y = X @ W.T for a block of tokens through the per-thread sgemm (kernels/gemm.py)."""
        f32_gemm(a, w64, self.w, X, Y, nt)

    fused_max_t = 1 << 62  # BLAS handles every batch size itself
    rows_exact = True  # fused() runs rows.row_dots: one row's dot products whatever the batch

    def __init__(self, tensor) -> None:  # noqa: ANN001
        super().__init__(tensor)
        self.w = tensor.numpy().view("<f4").reshape(self.out_features, self.in_features)

    def _matmul(self, X, Y, par):
        np.dot(X, self.w.T, out=Y)

    def fused(self, x: np.ndarray) -> np.ndarray:
        """The row kernel for any batch (``_matmul`` is BLAS, whose rows depend on the batch shape)."""
        X, _ = as_batch(x, self.in_features)
        Y = np.empty((X.shape[0], self.out_features), np.float32)
        if Y.size and parallel_for(self.work * X.shape[0]):
            row_dots_par(self.w, F32, EMPTY, EMPTY, X, Y, ALL_ROWS, threads())
        elif Y.size:
            row_dots_all(self.w, F32, EMPTY, EMPTY, X, Y, ALL_ROWS)
        return Y

    def _matmul_rows(self, rows, X, Y, par):
        if X.shape[0] > 4:  # a prefill: copying the rows once is cheaper than T gathered passes
            np.dot(X, self.w[rows].T, out=Y)
        elif par:
            row_dots_par(self.w, F32, EMPTY, EMPTY, X, Y, rows, threads())
        else:
            row_dots_all(self.w, F32, EMPTY, EMPTY, X, Y, rows)

    def group_arrays(self) -> tuple:
        """(rows, kind, scales, column field): what the grouped decode products take (:mod:`.rows`)."""
        return self.w, F32, EMPTY, EMPTY

    def _dequant(self, r0, r1, out, par):
        out[...] = self.w[r0:r1]

    def _dequant_rows(self, rows, out, par):
        np.take(self.w, rows, axis=0, out=out)


@family(Dtype.F16, Dtype.BF16)
class HalfLinear(FusedLinear):
    """f16 / bf16: converted in registers, never widened in memory."""

    @property
    def group_family(self) -> str:
        return f"rows:half{self.kind}"

    def _gemm(self, a: int, w64: bool, X: np.ndarray, Y: np.ndarray, nt: int) -> None:
        """Y = X @ W.T for a block of tokens through the per-thread sgemm (kernels/gemm.py)."""
        k = X.shape[1]
        half_gemm(a, w64, self.w, self.kind, self.all_rows, X, Y,
                  gemm.bufs("gemm-f", nt, gemm.step_rows(k, 16), k), nt)

    fused_max_t = 8  # measured crossover with dequantize + sgemm: T ~ 8-10 (benchmarks/quant.py)
    rows_exact = True  # rows.row_dots: one row's dot products, the same for every batch size

    def __init__(self, tensor) -> None:  # noqa: ANN001
        super().__init__(tensor)
        self.kind = F16 if tensor.dtype == Dtype.F16 else BF16
        self.w = tensor.numpy().view("<u2").reshape(self.out_features, self.in_features)
        self.all_rows = np.arange(self.out_features, dtype=np.int64)

    def _matmul(self, X, Y, par):
        self._matmul_rows(ALL_ROWS, X, Y, par)

    def _matmul_rows(self, rows, X, Y, par):
        if par:
            row_dots_par(self.w, self.kind, EMPTY, EMPTY, X, Y, rows, threads())
        else:
            row_dots_all(self.w, self.kind, EMPTY, EMPTY, X, Y, rows)

    def group_arrays(self) -> tuple:
        """(rows, kind, scales, column field): what the grouped decode products take (:mod:`.rows`)."""
        return self.w, self.kind, EMPTY, EMPTY

    def _dequant(self, r0, r1, out, par):
        self._dequant_rows(self.all_rows[r0:r1], out, par)

    def _dequant_rows(self, rows, out, par):
        if par:
            half_dequant_par(self.w, self.kind, rows, out, threads())
        else:
            half_dequant(self.w, self.kind, rows, out)


# -- prefill: dequantize + sgemm per numba thread (kernels/gemm.py drives it)


@numba.njit(**PARALLEL)
def f32_gemm(addr, ilp64, w, X, Y, nt):  # pragma: no cover - compiled
    """Y = X @ w.T with w the mapped f32 rows: one sgemm per thread on its rows."""
    T, k = X.shape
    n = w.shape[0]
    for j in prange(nt):
        r0, r1 = _chunk(n, nt, j, 16)
        if r1 > r0:
            sgemm(addr, ilp64, TRANS, T, r1 - r0, k, X, k, w[r0:], k, Y[:, r0:], n)


@numba.njit(**PARALLEL)
def half_gemm(addr, ilp64, w, kind, rows, X, Y, bufs, nt):  # pragma: no cover - compiled
    """f16/bf16: convert R rows into the thread's buffer, then sgemm."""
    T, k = X.shape
    n = rows.shape[0]
    R = bufs.shape[1]
    for j in prange(nt):
        buf = bufs[j]
        r0, r1 = _chunk(n, nt, j, 16)
        r = r0
        while r < r1:
            e = min(r1, r + R)
            half_dequant(w, kind, rows[r:e], buf)
            sgemm(addr, ilp64, TRANS, T, e - r, k, X, k, buf, k, Y[:, r:], n)
            r = e
