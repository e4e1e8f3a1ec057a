"""Fused kernels for ``vbit`` and ``vbit_ro``: variable 3–8-bit rows read in place.

Each row has one width b; ``w = (u - L)·s`` with ``L = 2^(b-1) - 1`` and an f16 scale per
32-group, so a group contributes ``s·(Σ u·x - L·Σx)`` with ``Σx`` per group computed once per
call. Widths 8 and 4 read whole bytes / nibbles in vectorized loops (4-bit codes are MSB-first:
the high nibble is the even weight); widths 3, 5 and 6 unpack 8 codes from ``b`` bytes at a time
as one big-endian integer. Row starts come from the validated layout (vbit: prefix sums of the
row widths, vbit_ro: its offset table), kept as one int64 per row.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..format.constants import GROUP
from ..format.dtypes import vbit_layout
from ._base import FusedLinear
from ._jit import PARALLEL, SERIAL, byte_f32, f16_at, hi_nibble, lo_nibble, scratch, threads


@numba.njit(**SERIAL)
def vbit_rows(data, widths, starts, soff, X, xe, xo, xs, Y, rows, i0, i1):  # pragma: no cover
    """Y[:, i] = X @ W[rows[i]] for i in [i0, i1)."""
    T, n = X.shape
    gpr = n // GROUP
    for i in range(i0, i1):
        r = rows[i]
        b = np.int64(widths[r])
        level = np.float32((1 << (b - 1)) - 1)
        mask = np.int64((1 << b) - 1)
        pos = starts[r]
        sbase = soff + 2 * r * gpr
        for t in range(T):
            acc = np.float32(0)
            # slices (not offset arithmetic) give LLVM indices it can prove non-negative,
            # which it needs before it vectorizes a loop
            if b == 8:
                for g in range(gpr):
                    seg = data[pos + g * GROUP:pos + (g + 1) * GROUP]
                    xg = X[t, g * GROUP:(g + 1) * GROUP]
                    d = np.float32(0)
                    for k in range(GROUP):
                        d += byte_f32(seg[k]) * xg[k]
                    acc += (d - level * xs[t, g]) * f16_at(data, sbase + 2 * g)
            elif b == 4:
                for g in range(gpr):
                    seg = data[pos + g * 16:pos + (g + 1) * 16]
                    eg = xe[t, g * 16:(g + 1) * 16]
                    og = xo[t, g * 16:(g + 1) * 16]
                    d = np.float32(0)
                    for k in range(16):
                        v = seg[k]
                        d += hi_nibble(v) * eg[k]
                        d += lo_nibble(v) * og[k]
                    acc += (d - level * xs[t, g]) * f16_at(data, sbase + 2 * g)
            else:
                for g in range(gpr):
                    seg = data[pos + g * 4 * b:pos + (g + 1) * 4 * b]
                    xg = X[t, g * GROUP:(g + 1) * GROUP]
                    d = np.float32(0)
                    for j in range(4):  # 8 codes = b bytes, big-endian bit order
                        word = np.int64(0)
                        for q in range(b):
                            word = (word << 8) | np.int64(seg[j * b + q])
                        for m in range(8):
                            u = (word >> (b * (7 - m))) & mask
                            d += np.float32(u) * xg[8 * j + m]
                    acc += (d - level * xs[t, g]) * f16_at(data, sbase + 2 * g)
            Y[t, i] = acc


@numba.njit(**PARALLEL)
def vbit_rows_par(data, widths, starts, soff, X, xe, xo, xs, Y, rows, nt):  # pragma: no cover
    n = rows.shape[0]
    step = (n + nt - 1) // nt
    for j in prange(nt):
        i0 = min(n, j * step)
        vbit_rows(data, widths, starts, soff, X, xe, xo, xs, Y, rows, i0, min(n, i0 + step))


@numba.njit(**SERIAL)
def split_even_odd(X, xe, xo, xs):  # pragma: no cover - compiled
    """xe/xo: even/odd features of X; xs[t, g] = Σ of group g."""
    T, n = X.shape
    for t in range(T):
        for g in range(n // GROUP):
            tot = np.float32(0)
            for k in range(16):
                a = X[t, g * GROUP + 2 * k]
                b = X[t, g * GROUP + 2 * k + 1]
                xe[t, g * 16 + k] = a
                xo[t, g * 16 + k] = b
                tot += a + b
            xs[t, g] = tot


class VbitLinear(FusedLinear):
    """``vbit`` / ``vbit_ro``."""

    fused_max_t = 4

    def __init__(self, tensor) -> None:  # noqa: ANN001
        super().__init__(tensor)
        self.data = tensor.numpy()
        from ..format.constants import Dtype

        widths, self.soff, starts = vbit_layout(self.data, tensor.shape, row_offsets=tensor.dtype == Dtype.VBIT_RO,
                                                name=tensor.name)
        self.widths = widths
        self.starts = np.ascontiguousarray(starts[:-1])
        self.all_rows = np.arange(self.out_features, dtype=np.int64)

    def _matmul(self, X, Y, par):
        self._matmul_rows(self.all_rows, X, Y, par)

    def _matmul_rows(self, rows, X, Y, par):
        T, n = X.shape
        xe = scratch("vbit-xe", (T, n // 2))
        xo = scratch("vbit-xo", (T, n // 2))
        xs = scratch("vbit-xs", (T, n // GROUP))
        split_even_odd(X, xe, xo, xs)
        args = (self.data, self.widths, self.starts, self.soff, X, xe, xo, xs, Y, rows)
        if par:
            vbit_rows_par(*args, threads())
        else:
            vbit_rows(*args, 0, rows.size)
