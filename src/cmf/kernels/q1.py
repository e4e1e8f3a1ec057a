"""Fused kernels for ``q1``, ``q1s`` and ``q1t``.

q1: a group is ``[f16 s][4 B sign bits]``; the 32 bits become a lane mask selecting x
(``_ir.q1_dot``: ``Σ s·(2·bit - 1)·x = s·(2·Σ_{bit} x - Σx)``). q1s adds its sparse f16
overlay afterwards: an outlier replaces the base value, so its row gains ``(v - base)·x[c]``.
q1t: a group is ``[f16 s][7 B base-3]``; ``_ir.q1t_dot`` decodes its 32 digits in one vector pass
(multiply-high division by powers of 3); its per-row overlay entries are added to the base, as the
codec does.

Overlay entries are read in place (q1s: 6-byte ``[u32 flat index][f16]``, q1t: 4-byte
``[u16 column][f16]``); only the per-row entry ranges (one int64 per row) are computed at
prepare time. A q1s overlay whose indices are not strictly increasing (legal, but no encoder
writes one) is first rewritten sorted, keeping the last value per index as decoding does.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..format.constants import GROUP, Dtype
from ..format.dtypes import numel, q1s_overlay_count, q1t_row_ptr
from ..quant import F16_TABLE, TERNARY_LUT, q1_range, q1t_range
from ._base import FusedLinear
from ._ir import q1_dot, q1t_dot
from . import gemm
from ._jit import PARALLEL, SERIAL, chunk, f16_at, threads
from ._jit import chunk as _chunk
from .blas import TRANS, sgemm
from .q4 import R as TILE_R
from .registry import family
from .tiled import TiledLinear
from .vbit import group_sums

Q1, Q1S, Q1T = int(Dtype.Q1), int(Dtype.Q1S), int(Dtype.Q1T)

@numba.njit(inline="always")
def _q1t_entry(ent, e):  # pragma: no cover - compiled
    """(column, value) of q1t overlay entry e: ``[u16 column][f16 value]``."""
    p = 4 * e
    return np.int64(ent[p]) | (np.int64(ent[p + 1]) << 8), f16_at(ent, p + 2)


@numba.njit(inline="always")
def _q1s_entry(ent, e):  # pragma: no cover - compiled
    """(flat index, value) of q1s overlay entry e: ``[u32 flat index][f16 value]``."""
    p = 6 * e
    flat = (np.int64(ent[p]) | (np.int64(ent[p + 1]) << 8) | (np.int64(ent[p + 2]) << 16)
            | (np.int64(ent[p + 3]) << 24))
    return flat, f16_at(ent, p + 4)


@numba.njit(**SERIAL)
def q1_rows(kind, tiles, ptr, ent, X, xs, Y, rows, i0, i1):  # pragma: no cover - compiled
    """Y[:, i] = X @ W[rows[i]] for i in [i0, i1); ``ptr``/``ent`` describe the overlay,
    ``xs[t, g]`` = Σ of X[t] over group g (q1/q1s)."""
    T, n = X.shape
    gpr = tiles.shape[1]
    tflat = tiles.reshape(-1)
    for i in range(i0, i1):
        r = rows[i]
        for t in range(T):
            x = X[t]
            if kind == Q1T:
                acc = q1t_dot(tflat, r * gpr * 9, gpr, x)
            else:
                acc = q1_dot(tflat, r * gpr * 6, gpr, x, xs[t])
            for e in range(ptr[r], ptr[r + 1]):
                if kind == Q1T:
                    c, v = _q1t_entry(ent, e)
                    acc += v * x[c]
                else:  # q1s: the overlay replaces the base weight
                    flat, v = _q1s_entry(ent, e)
                    c = flat - r * n
                    tg = tiles[r, c // GROUP]
                    k = c % GROUP
                    bit = (np.int64(tg[2 + k // 8]) >> (k % 8)) & 1
                    base = f16_at(tg, 0) * np.float32(2 * bit - 1)
                    acc += (v - base) * x[c]
            Y[t, i] = acc


@numba.njit(**PARALLEL)
def q1_rows_par(kind, tiles, ptr, ent, X, Y, rows, nt):  # pragma: no cover - compiled
    """q1_rows over one contiguous chunk of ``rows`` per thread (group sums computed first)."""
    xs = group_sums(X)
    for j in prange(nt):
        i0, i1 = chunk(rows.shape[0], nt, j, 1)
        q1_rows(kind, tiles, ptr, ent, X, xs, Y[:, 0:], rows, i0, i1)  # the group products' layout and types


@numba.njit(**SERIAL)
def q1_rows_all(kind, tiles, ptr, ent, X, Y, rows):  # pragma: no cover - compiled
    """q1_rows over every given row, in one call."""
    q1_rows(kind, tiles, ptr, ent, X, group_sums(X), Y[:, 0:], rows, np.int64(0), rows.shape[0])


@numba.njit(**SERIAL)
def overlay_rows(kind, ptr, ent, r0, r1, cols, out):  # pragma: no cover - compiled
    """Apply rows r0..r1's overlay entries to their decoded base in ``out`` (row r at r - r0):
    q1s entries replace the base value, q1t entries are added to it."""
    for r in range(r0, r1):
        for e in range(ptr[r], ptr[r + 1]):
            if kind == Q1T:
                c, v = _q1t_entry(ent, e)
                out[r - r0, c] += v
            else:
                flat, v = _q1s_entry(ent, e)
                out[r - r0, flat - r * cols] = v


@numba.njit(**SERIAL)
def overlay_products(ptr, ent, rows, X, Y, i0, i1):  # pragma: no cover - compiled
    """Y[t, i] += Σ_e v_e·X[t, c_e] over the q1t overlay entries of row rows[i], i in [i0, i1)
    (added to the base products of the tiled kernels, as the codec adds them to the decoded base)."""
    for i in range(i0, i1):
        r = rows[i]
        for e in range(ptr[r], ptr[r + 1]):
            c, v = _q1t_entry(ent, e)
            for t in range(X.shape[0]):
                Y[t, i] += v * X[t, c]


@numba.njit(**PARALLEL)
def overlay_products_par(ptr, ent, rows, X, Y, nt):  # pragma: no cover - compiled
    """overlay_products over one contiguous chunk of ``rows`` per thread."""
    for j in prange(nt):
        i0, i1 = chunk(rows.shape[0], nt, j, 1)
        overlay_products(ptr, ent, rows, X, Y, i0, i1)


def _q1s_overlay(data: np.ndarray, shape: tuple[int, int], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(per-row entry ranges, entry bytes) of a q1s payload, entries strictly increasing."""
    rows, cols = shape
    count = q1s_overlay_count(data, shape, name)
    base = 6 * (numel(shape) // GROUP)
    ent = data[base + 4:base + 4 + 6 * count]
    idx = ent.reshape(count, 6)[:, :4].copy().view("<u4").ravel().astype(np.int64)
    if count > 1 and not np.all(np.diff(idx) > 0):
        # decode assigns in entry order, so the last entry of a repeated index wins
        idx, first_rev = np.unique(idx[::-1], return_index=True)
        ent = np.ascontiguousarray(ent.reshape(count, 6)[count - 1 - first_rev]).reshape(-1)
    ptr = np.searchsorted(idx, np.arange(rows + 1, dtype=np.int64) * cols).astype(np.int64)
    return ptr, ent


@family(Dtype.Q1, Dtype.Q1S, Dtype.Q1T)
class Q1Linear(FusedLinear):
    """``q1`` / ``q1s`` / ``q1t``."""

    @property
    def group_family(self) -> str | None:
        return "q1" if self.tiled is None else None  # q1t runs its tiles (and overlay) itself

    def group_arrays(self) -> tuple:
        """(kind, sign tiles, overlay row pointers, overlay entries): what gemv.q1_group takes."""
        return np.int64(self.kind), self.tiles, self.ptr, self.ent

    def _gemm(self, a: int, w64: bool, X: np.ndarray, Y: np.ndarray, nt: int) -> None:
        """Y = X @ W.T for a block of tokens through the per-thread sgemm (kernels/gemm.py)."""
        k = X.shape[1]
        q1_gemm(a, w64, self.kind, self.tiles, F16_TABLE, TERNARY_LUT, self.ptr, self.ent, X, Y,
                gemm.bufs("gemm-f", nt, gemm.step_rows(k, 16), k), nt)

    fused_max_t = 16  # measured crossover with dequantize + sgemm: T ~ 16-32 (benchmarks/quant.py)

    def __init__(self, tensor) -> None:  # noqa: ANN001
        super().__init__(tensor)
        rows, cols = self.out_features, self.in_features
        # 1-bit and ternary kernels compute as long per weight as q8's do per byte: judged by
        # their 6-10 bytes per 32 weights, every attention matrix of the benchmark model ran on
        # one thread (q, k, v, o: 2.1 of 7.5 ms a decoded token)
        self.work = rows * cols
        gpr = cols // GROUP
        data = tensor.numpy()
        self.kind = int(tensor.dtype)
        if self.kind == Q1T:
            self.tiles = data[:9 * rows * gpr].reshape(rows, gpr, 9)
            self.ptr = q1t_row_ptr(data, tensor.shape, tensor.name)
            self.ent = data[9 * rows * gpr + 4 * (rows + 1):]
        else:
            self.tiles = data[:6 * rows * gpr].reshape(rows, gpr, 6)
            if self.kind == Q1S:
                self.ptr, self.ent = _q1s_overlay(data, (rows, cols), tensor.name)
            else:
                self.ptr = np.zeros(rows + 1, np.int64)
                self.ent = np.zeros(0, np.uint8)
        self.all_rows = np.arange(rows, dtype=np.int64)
        # q1t decode products run on the base repacked into 64-row crumb tiles (tiled.TiledLinear:
        # 10 B per 32 weights against the stored 9, the mapped pages given back once packed), with
        # the integer kernels there; the overlay is added afterwards. Prefill keeps q1_gemm.
        self.tiled = TiledLinear(tensor) if self.kind == Q1T and rows >= TILE_R else None
        self.has_overlay = bool(self.ptr.size) and int(self.ptr[-1]) > 0

    @property
    def int8(self) -> bool:
        """Whether the fused products take int8 activations (q1t tiles only)."""
        return self.tiled is not None and self.tiled.int8

    def use_int8_activations(self, on: bool = True) -> bool:
        """q1t: int8 activations in the tiled products (``TiledLinear.use_int8_activations``)."""
        return self.tiled.use_int8_activations(on) if self.tiled is not None else False

    def _batched(self, X, rows):
        # Without an overlay, prefill also runs on the crumb tiles (tiled_gemm packs what decode
        # has not): the base is then read from the file once, and its pages stay given back
        # instead of faulting in again beside the tiles (+59 MB peak on the benchmark model).
        if rows is None and self.tiled is not None and not self.has_overlay:
            return self.tiled._batched(X, None)
        return super()._batched(X, rows)

    def _dequant(self, r0, r1, out, par):
        gpr = self.in_features // GROUP
        tiles = self.tiles[r0:r1].reshape(-1, self.tiles.shape[2])
        groups = out.reshape(-1, GROUP)
        if self.kind == Q1T:
            q1t_range(tiles, F16_TABLE, TERNARY_LUT, groups, 0, (r1 - r0) * gpr)
        else:
            q1_range(tiles, F16_TABLE, groups, 0, (r1 - r0) * gpr)
        overlay_rows(self.kind, self.ptr, self.ent, r0, r1, self.in_features, out)

    def _matmul(self, X, Y, par):
        if self.tiled is not None:
            self.tiled._matmul(X, Y, par)
            self._add_overlay(self.all_rows, X, Y, par)
        else:
            self._matmul_rows(self.all_rows, X, Y, par)

    def _add_overlay(self, rows, X, Y, par):
        """q1t on tiles: the overlay entries of ``rows`` added to the base products in Y."""
        if not self.has_overlay:
            return
        if par:
            overlay_products_par(self.ptr, self.ent, rows, X, Y, threads())
        else:
            overlay_products(self.ptr, self.ent, rows, X, Y, 0, rows.shape[0])

    def _matmul_rows(self, rows, X, Y, par):
        if self.tiled is not None:
            self.tiled._matmul_rows(rows, X, Y, par)
            self._add_overlay(rows, X, Y, par)
            return
        args = (self.kind, self.tiles, self.ptr, self.ent, X, Y, rows)
        if par:
            q1_rows_par(*args, threads())
        else:
            q1_rows_all(*args)


# -- prefill: dequantize + sgemm per numba thread (kernels/gemm.py drives it)


@numba.njit(**PARALLEL)
def q1_gemm(addr, ilp64, kind, tiles, table, lut, ptr, ent, X, Y, bufs, nt):  # pragma: no cover - compiled
    """q1 / q1s / q1t: R rows through the codec's group decoders (+ the q1s/q1t overlay), then sgemm."""
    T, k = X.shape
    n = tiles.shape[0]
    R = bufs.shape[1]
    gpr = k // GROUP
    for j in prange(nt):
        buf = bufs[j]
        r0, r1 = _chunk(n, nt, j, 16)
        r = r0
        while r < r1:
            e = min(r1, r + R)
            groups = buf[:e - r].reshape(-1, GROUP)
            src = tiles[r:e].reshape(-1, tiles.shape[2])
            if kind == Q1T:
                q1t_range(src, table, lut, groups, 0, (e - r) * gpr)
            else:
                q1_range(src, table, groups, 0, (e - r) * gpr)
            overlay_rows(kind, ptr, ent, r, e, k, buf)
            sgemm(addr, ilp64, TRANS, T, e - r, k, X, k, buf, k, Y[:, r:], n)
            r = e
