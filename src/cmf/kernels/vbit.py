"""Fused kernels for ``vbit`` and ``vbit_ro``: variable 3–8-bit rows read in place.

Each row has one width b; ``w = (u - L)·s`` with ``L = 2^(b-1) - 1`` and an f16 scale per
32-group, so a group contributes ``s·(Σ u·x - L·Σx)`` with ``Σx`` per group computed once per
call. The per-row loop is an LLVM IR kernel per width (``_ir.vbit_dot{3,5,6,8}``: 16 codes
unpacked at a time by constant byte shuffles and per-lane shifts; width 4, the common one,
``_ir.vbit_dot4p``: x deinterleaved per group once per call, so a group's high and low nibbles
are its codes and ``(u - L)`` is formed on the integers). Row starts come from the
validated layout (vbit: prefix sums of the row widths, vbit_ro: its offset table), kept as one
int64 per row.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..format.constants import GROUP, Dtype
from ..format.dtypes import vbit_layout
from ..quant import F16_TABLE, vbit_range
from ._base import FusedLinear
from ._ir import vbit_dot3, vbit_dot4p, vbit_dot5, vbit_dot6, vbit_dot8
from . import gemm
from ._jit import PARALLEL, SERIAL, threads
from ._jit import chunk as _chunk
from .blas import TRANS, sgemm
from .registry import family


@numba.njit(**SERIAL)
def vbit_rows(data, widths, starts, soff, X, xs, xp, Y, rows, i0, i1):  # pragma: no cover - compiled
    """Y[:, i] = X @ W[rows[i]] for i in [i0, i1); one IR row kernel per width (width 4 reads
    ``xp``, X deinterleaved per group by :func:`pair_x`; the others X and its group sums)."""
    T, n = X.shape
    gpr = n // GROUP
    for i in range(i0, i1):
        r = rows[i]
        b = widths[r]
        level = np.float32((1 << (np.int64(b) - 1)) - 1)
        pos = starts[r]
        sbase = soff + 2 * r * gpr
        for t in range(T):
            x = X[t]
            z = xs[t]
            if b == 4:
                acc = vbit_dot4p(data, pos, sbase, gpr, xp[t])
            elif b == 5:
                acc = vbit_dot5(data, pos, sbase, gpr, x, z, level)
            elif b == 3:
                acc = vbit_dot3(data, pos, sbase, gpr, x, z, level)
            elif b == 6:
                acc = vbit_dot6(data, pos, sbase, gpr, x, z, level)
            else:
                acc = vbit_dot8(data, pos, sbase, gpr, x, z, level)
            Y[t, i] = acc


@numba.njit(**PARALLEL)
def vbit_rows_par(data, widths, starts, soff, X, Y, rows, nt):  # pragma: no cover
    """vbit_rows over one contiguous chunk of ``rows`` per thread (group sums computed first)."""
    xs = group_sums(X)
    xp = pair_x(X)
    n = rows.shape[0]
    step = (n + nt - 1) // nt
    for j in prange(nt):
        i0 = min(n, j * step)
        vbit_rows(data, widths, starts, soff, X, xs, xp, Y[:, 0:], rows, i0, min(n, i0 + step))  # as the group products


@numba.njit(**SERIAL)
def vbit_rows_all(data, widths, starts, soff, X, Y, rows):  # pragma: no cover - compiled
    """vbit_rows over every given row, in one call (group sums included)."""
    vbit_rows(data, widths, starts, soff, X, group_sums(X), pair_x(X), Y[:, 0:], rows, np.int64(0), rows.shape[0])


@numba.njit(**SERIAL)
def group_sums(X):  # pragma: no cover - compiled
    """xs[t, g] = Σ of X[t] over group g."""
    T, n = X.shape
    xs = np.empty((T, n // GROUP), np.float32)
    for t in range(T):
        for g in range(n // GROUP):
            tot = np.float32(0)
            for k in range(GROUP):
                tot += X[t, g * GROUP + k]
            xs[t, g] = tot
    return xs


@numba.njit(**SERIAL)
def pair_x(X):  # pragma: no cover - compiled
    """X with each 32-group deinterleaved: the even features first, then the odd ones (the order
    of a width-4 group's high and low nibbles, ``_ir.vbit_dot4p``)."""
    T, n = X.shape
    out = np.empty_like(X)
    for t in range(T):
        for g in range(n // GROUP):
            base = g * GROUP
            for j in range(GROUP // 2):
                out[t, base + j] = X[t, base + 2 * j]
                out[t, base + GROUP // 2 + j] = X[t, base + 2 * j + 1]
    return out


@numba.njit(**SERIAL)
def vbit_dequant_rows(data, widths, starts, soff, table, rows, out):  # pragma: no cover - compiled
    """out[i] = row rows[i] as float32 through the codec's own row decoder (exact codec values)."""
    n = out.shape[1]
    gpr = n // GROUP
    for i in range(rows.shape[0]):
        r = rows[i]
        vbit_range(data, widths[r:r + 1], starts[r:r + 1], soff + 2 * r * gpr, table, n, out[i:i + 1],
                          np.int64(0), np.int64(1))


@family(Dtype.VBIT, Dtype.VBIT_RO)
class VbitLinear(FusedLinear):
    """``vbit`` / ``vbit_ro``."""

    group_family = "vbit"

    def _gemm(self, a: int, w64: bool, X: np.ndarray, Y: np.ndarray, nt: int) -> None:
        """Y = X @ W.T for a block of tokens through the per-thread sgemm (kernels/gemm.py)."""
        k = X.shape[1]
        vbit_gemm(a, w64, self.data, self.widths, self.starts, self.soff, F16_TABLE, X, Y,
                  gemm.bufs("gemm-f", nt, gemm.step_rows(k, 16), k), nt)

    fused_max_t = 16  # measured crossover with dequantize + sgemm: T ~ 16-32 (benchmarks/quant.py)

    def __init__(self, tensor) -> None:  # noqa: ANN001
        super().__init__(tensor)
        self.data = tensor.numpy()
        from ..format.constants import Dtype

        widths, self.soff, starts = vbit_layout(self.data, tensor.shape, row_offsets=tensor.dtype == Dtype.VBIT_RO,
                                                name=tensor.name)
        self.widths = widths
        self.starts = np.ascontiguousarray(starts[:-1])
        self.all_rows = np.arange(self.out_features, dtype=np.int64)

    def _dequant(self, r0, r1, out, par):
        # the codec's numba decoder on a row range: pass it the rows' widths/starts/scales from r0
        gpr = self.in_features // GROUP
        vbit_range(self.data, self.widths[r0:r1], self.starts[r0:r1], self.soff + 2 * r0 * gpr,
                          F16_TABLE, self.in_features, out, 0, r1 - r0)

    def _dequant_rows(self, rows, out, par):
        # not the codec's validating decode_rows: an embedding lookup per decoded token (~2 ms)
        vbit_dequant_rows(self.data, self.widths, self.starts, self.soff, F16_TABLE, rows, out)

    def group_arrays(self) -> tuple:
        """(data, widths, starts, scale offset): what the grouped decode products take (gemv.vbit_group)."""
        return self.data, self.widths, self.starts, np.int64(self.soff)

    def _matmul(self, X, Y, par):
        self._matmul_rows(self.all_rows, X, Y, par)

    def _matmul_rows(self, rows, X, Y, par):
        args = (self.data, self.widths, self.starts, self.soff, X, Y, rows)
        if par:
            vbit_rows_par(*args, threads())
        else:
            vbit_rows_all(*args)


# -- prefill: dequantize + sgemm per numba thread (kernels/gemm.py drives it)


@numba.njit(**PARALLEL)
def vbit_gemm(addr, ilp64, data, widths, starts, soff, table, X, Y, bufs, nt):  # pragma: no cover - compiled
    """vbit / vbit_ro: R rows at a time through the codec's row-range decoder, then sgemm."""
    T, k = X.shape
    n = widths.shape[0]
    R = bufs.shape[1]
    gpr = k // GROUP
    for j in prange(nt):
        buf = bufs[j]
        r0, r1 = _chunk(n, nt, j, 16)
        r = r0
        while r < r1:
            e = min(r1, r + R)
            vbit_range(data, widths[r:e], starts[r:e], soff + 2 * r * gpr, table, k, buf, np.int64(0), e - r)
            sgemm(addr, ilp64, TRANS, T, e - r, k, X, k, buf, k, Y[:, r:], n)
            r = e
