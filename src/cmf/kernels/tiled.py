"""``TiledLinear``: the LinearOp of the 4-bit family (and q1t's base) over 64-row tiles.

The numba kernels it drives live in ``q4.py`` (the tile layout and why it exists are described
there); this module holds the Python side: choosing the stored sections of each dtype, the lazily
packed tile arrays (in huge pages), the activation mode, and the mat-vec / row / batched paths.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..format.constants import GROUP, Dtype
from . import _base, gemm
from ._base import FusedLinear, TILE_BYTES
from ._jit import PARALLEL_ORDERED, SERIAL_ORDERED, huge_zeros, scratch, threads
from ._jit import chunk as _chunk
from .blas import NO_TRANS, TRANS, sgemm
from .ladder_scales import DECODED_SCALES
from .q4 import (BLOCK_PIECES, EXACT_PIECES, block_par, matvec, matvec_par, tiles_dequant_t, tiles_dequant_t_par,
                 tiles_par, tiles_run)
from .q4_stored import CODE_BYTES, F16_SCALES, KIND_F16, KIND_Q1T, KIND_Q2TP, KIND_Q4TP, R, WIDTH, ZERO, decode_rows
from .registry import family
from .xprep import fill_x


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.setflags(write=False)
    return v


def _exp2_table() -> np.ndarray:
    from ..quant import exp2_f16_table  # the exp2 every q4tp/q2tp encoder and decoder shares

    return exp2_f16_table()


@family(Dtype.Q4_BLOCK, Dtype.Q4_TILED, Dtype.Q4TP, Dtype.Q2TP)
class TiledLinear(FusedLinear):
    """q4_block (``in % 32 == 0``), q4_tiled, q4tp and q2tp through 64-row tiles; also the base
    of q1t (its overlay is added by ``q1.Q1Linear``)."""

    @classmethod
    def accepts(cls, dtype, shape: tuple[int, ...]) -> bool:  # noqa: ANN001 - a Dtype
        """q4_block groups may straddle rows: the reference path decodes those few matrices."""
        return not (dtype == Dtype.Q4_BLOCK and shape[1] % GROUP)

    @property
    def group_family(self) -> str:
        return f"tiled:{self.width}"

    def group_arrays(self) -> tuple:
        """What gemv.tiled_group takes of each matrix: (kind, planes, f16 scales, code words,
        ladder bases, ladder params, exp2 table, ready flags, stored source, stored scales,
        code scales, tail rows)."""
        return (self.kind, self.planes, self.sc, self.cw, self.lad, self.params, self.exp2tab, self.ready,
                self.src, self.scs, self.cs, self.tail)

    def _gemm(self, a: int, w64: bool, X: np.ndarray, Y: np.ndarray, nt: int) -> None:
        """Y = X @ W.T for a block of tokens through the per-thread sgemm (kernels/gemm.py)."""
        k = X.shape[1]
        if self.ntiles:
            per = max(1, gemm.step_rows(k, R) // R)
            tiled_gemm(a, w64, self.ntiles, *self._args(), X, Y, gemm.bufs("gemm-t", nt, k, per * R), nt)
        if self.tail.size:
            buf = scratch("gemm-tail", (self.tail.size, k))
            tiled_tail(a, w64, self.tail, self.kind, self.src, self.scs, self.cs, self.params, self.exp2tab, X, Y, buf)

    # Batches up to fused_max_t tokens run the decode loop (one token at a time, the weights
    # streamed with prefetch), larger ones the block loop (q4.block_par) or, where it is slower (``q4.BLOCK_PIECES``),
    # dequantize + sgemm. Crossovers measured on the benchmark model's gate/up matrices from
    # DRAM: block against the decode loop T ≈ 6, exact (T = 4 1.04×, 8 0.93×, 16 0.85× the time)
    # and int8 (1.05×, 0.86×, 0.74×); dequantize + sgemm against the decode loop T ~ 24-32
    # (benchmarks/quant.py).
    fused_max_t = 16
    BLOCK_MIN_T = 7

    def __init__(self, tensor) -> None:  # noqa: ANN001
        super().__init__(tensor)
        rows, cols = self.out_features, self.in_features
        gpr = cols // GROUP
        data = tensor.numpy()
        d = tensor.dtype
        # Placeholders are read-only like the mapped payload views, so every dtype runs the same
        # compiled specialization of each kernel (numba types read-only arrays separately).
        none8 = _readonly(np.zeros((0, 0, 0), np.uint8))
        self.params = _readonly(np.zeros((0, 2), np.uint16))
        self.exp2tab = _readonly(np.zeros(1, np.float32))
        self.cs = _readonly(np.zeros((0, 0), np.uint8))
        data = _readonly(data)
        if d == Dtype.Q4_TILED:
            rec = data.reshape(rows, gpr, 18)
            # whole records (C-contiguous, like every other source here: one compiled variant)
            self.kind, self.src, self.scs = KIND_F16, rec, rec
        elif d == Dtype.Q4_BLOCK:
            G = rows * gpr
            self.kind = KIND_F16
            self.src = data[:16 * G].reshape(rows, gpr, 16)
            self.scs = data[16 * G:18 * G].reshape(rows, gpr, 2)
        elif d == Dtype.Q1T:
            self.kind, self.scs = KIND_Q1T, none8
            self.src = data[:9 * rows * gpr].reshape(rows, gpr, 9)
        else:
            width = 16 if d == Dtype.Q4TP else 8
            a = rows * gpr * width
            self.kind = KIND_Q4TP if d == Dtype.Q4TP else KIND_Q2TP
            self.src = data[:a].reshape(rows, gpr, width)
            self.scs = none8
            self.params = data[a:a + 4 * rows].view("<u2").reshape(rows, 2)
            self.cs = data[a + 4 * rows:].reshape(rows, (5 * gpr + 7) // 8)
            self.exp2tab = _exp2_table()
        self.width = WIDTH[self.kind]
        # int8, pieces (int8 pieces x is split into for the fused products, 0: float32), fused_max_t
        self.use_int8_activations(False)
        self.phases = GROUP // self.width
        self.zero = np.float32(ZERO[self.kind])
        self.ntiles = rows // R
        nt = self.ntiles
        # zero pages, in huge pages (_jit.huge_zeros): nothing is resident until a tile is packed
        self.planes = huge_zeros((nt, gpr, self.width // 4, R, 4), np.uint8)
        f16 = F16_SCALES[self.kind]
        # f16 bits, or a ladder's scales decoded as float32 bits (two uint16 a row; ladder_scales.DECODED_SCALES)
        self.sc = huge_zeros((nt, gpr, R) if f16 else (nt, gpr, 2 * R) if DECODED_SCALES else (0, 0, 0), np.uint16)
        self.cw = huge_zeros((0 if f16 or DECODED_SCALES else nt * gpr * CODE_BYTES,), np.uint8)  # codes' bit planes
        self.lad = huge_zeros((0 if f16 else nt, 2, R), np.float32)  # per row: 2^lo, ratio
        self.ready = np.zeros(nt, np.uint8)
        self.all_tiles = np.arange(nt, dtype=np.int64)
        self.tail = np.arange(nt * R, rows, dtype=np.int64)

    def _args(self) -> tuple:
        return (self.kind, self.planes, self.sc, self.cw, self.lad, self.params, self.exp2tab, self.ready,
                self.src, self.scs, self.cs)

    def use_int8_activations(self, on: bool = True) -> bool:
        """Run the fused products (decode, small batches) with activations quantized to int8 per
        group of 32, as llama.cpp does for its 4-bit types: integer dot products, ~2× faster on
        CPUs with VNNI, results within ~1e-2 relative of the exact product (``quantize_x``).
        On CPUs with an integer dot (VNNI, AVX2) blocks of tokens (prefill) take int8
        activations too, in the integer block loop; elsewhere they stay exact (dequantize +
        sgemm). Returns the new setting."""
        self.int8 = bool(on)
        self.pieces = 1 if self.int8 else EXACT_PIECES
        self.block = self.pieces in BLOCK_PIECES  # blocks of tokens through q4.block_par
        self.fused_max_t = self.BLOCK_MIN_T - 1 if self.block else TiledLinear.fused_max_t
        return self.int8

    def _split(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        T = X.shape[0]
        gpr = self.in_features // GROUP
        i8, n = (T, 0) if self.pieces else (0, T)
        xs = scratch("q4-xs", (T, gpr * max(self.pieces, 1)))
        xp = scratch("q4-xp", (n, self.phases, gpr, self.width))
        q8 = scratch("q4-xq", self.x8_shape(i8), np.int8)
        xd = scratch("q4-xd", (i8, gpr))
        fill_x(X, xp, xs, q8, xd, self.zero)
        return xp, xs, q8.reshape(i8, gpr * max(self.pieces, 1) * GROUP).view(np.int32), xd

    def x8_shape(self, T: int, pieces: int | None = None) -> tuple[int, ...]:
        """Shape of T vectors of int8 activations (``pieces`` of each, default this op's) as
        ``quantize_x`` lays them out."""
        K = max(self.pieces if pieces is None else pieces, 1)
        return (T, self.in_features // GROUP, K, GROUP // (4 * self.phases), self.phases, 4)

    def _decode(self, rows: np.ndarray, out: np.ndarray) -> None:
        decode_rows(rows, self.kind, self.src, self.scs, self.cs, self.params, self.exp2tab, out)

    def _tiles(self, tiles: np.ndarray, parts: tuple, Y, par: bool) -> None:
        if par and tiles.size > 1:
            tiles_par(tiles, *self._args(), *parts, Y, threads())
        else:
            tiles_run(tiles, 0, tiles.size, *self._args(), *parts, Y)

    def _matmul(self, X, Y, par):
        if par and self.ntiles > 1:
            matvec_par(X, self.all_tiles, self.tail, *self._args(), Y, threads(), self.pieces)
        else:
            matvec(X, self.all_tiles, self.tail, *self._args(), Y, self.pieces)

    def _matmul_rows(self, rows, X, Y, par):
        tile_of = rows // R
        in_tiles = tile_of < self.ntiles
        if in_tiles.any():
            tiles, slot = np.unique(tile_of[in_tiles], return_inverse=True)
            Yt = scratch("q4-rows", (X.shape[0], tiles.size * R))
            self._tiles(tiles, self._split(X), Yt, par and tiles.size > 1)
            Y[:, in_tiles] = Yt[:, slot * R + rows[in_tiles] % R]
        if not in_tiles.all():
            extra = rows[~in_tiles]
            w = scratch("q4-tail", (extra.size, self.in_features))
            self._decode(extra, w)
            Y[:, ~in_tiles] = X @ w.T

    def _dequant(self, r0, r1, out, par):
        self._decode(np.arange(r0, r1, dtype=np.int64), out)

    def _dequant_rows(self, rows, out, par):
        self._decode(rows, out)

    def _batched(self, X, rows):
        if rows is not None or not self.ntiles:
            return super()._batched(X, rows)
        if self.block:
            # Integer tile products over the token block (q4.block_par), x in this op's pieces
            # (three exact, one with int8 activations): each tile's bytes are read once and
            # multiplied by every token from cache, with VNNI's four products per lane — 1.3×
            # (exact) and 2× (int8) the dequantize + sgemm below on the benchmark model's
            # matrices, the same values as the decode step's product of each token.
            X = np.ascontiguousarray(X, dtype=np.float32)
            Y = np.empty((X.shape[0], self.out_features), np.float32)
            block_par(X, self.all_tiles, self.tail, *self._args(), Y, threads(), self.pieces)
            return Y
        if gemm.supported(self):
            return gemm.matmul(self, X)
        # whole tiles, dequantized transposed ([in, k·R]) so BLAS reads them as W.T
        T = X.shape[0]
        Yt = np.empty((self.out_features, T), np.float32)
        per = max(1, TILE_BYTES // (4 * R * max(self.in_features, 1)))
        buf = scratch("q4-dequant", (self.in_features, per * R))
        par = _base.DEQUANT_PARALLEL and threads() > 1
        Xt = X.T
        for t0 in range(0, self.ntiles, per):
            t1 = min(self.ntiles, t0 + per)
            w = buf[:, :(t1 - t0) * R]
            if par and t1 - t0 > 1:
                tiles_dequant_t_par(t0, t1, *self._args(), w, threads())
            else:
                tiles_dequant_t(t0, t1, *self._args(), w)
            np.dot(w.T, Xt, out=Yt[t0 * R:t1 * R])
        if self.tail.size:
            w = scratch("q4-tail", (self.tail.size, self.in_features))
            self._decode(self.tail, w)
            np.dot(w, Xt, out=Yt[self.ntiles * R:])
        return np.ascontiguousarray(Yt.T)


# -- prefill: dequantize + sgemm per numba thread (kernels/gemm.py drives it)


@numba.njit(**PARALLEL_ORDERED)
def tiled_gemm(addr, ilp64, ntiles, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, X, Y, bufs,
               nt):  # pragma: no cover - compiled
    """4-bit family: whole 64-row tiles dequantized transposed ([in, m·64]), then sgemm."""
    T, k = X.shape
    n = Y.shape[1]
    per = bufs.shape[2] // R  # tiles per step
    for j in prange(nt):
        buf = bufs[j]
        t0, t1 = _chunk(ntiles, nt, j, 1)
        t = t0
        while t < t1:
            e = min(t1, t + per)
            tiles_dequant_t(t, e, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, buf)
            sgemm(addr, ilp64, NO_TRANS, T, (e - t) * R, k, X, k, buf, bufs.shape[2], Y[:, t * R:], n)
            t = e


@numba.njit(**SERIAL_ORDERED)
def tiled_tail(addr, ilp64, tail, kind, src, scs, cs, params, exp2tab, X, Y, buf):  # pragma: no cover
    """Rows past the last whole tile: decoded from the stored layout, then one sgemm."""
    T, k = X.shape
    m = tail.shape[0]
    decode_rows(tail, kind, src, scs, cs, params, exp2tab, buf)
    sgemm(addr, ilp64, TRANS, T, m, k, X, k, buf, k, Y[:, tail[0]:], Y.shape[1])
