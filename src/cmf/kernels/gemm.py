"""Prefill products ``Y[T, out] = X[T, in] @ W.T`` for blocks of tokens: dequantize + sgemm per thread.

Each numba thread owns one contiguous chunk of output rows. It dequantizes ``R`` rows at a time
into its own buffer (sized to stay in its L2) and multiplies them with single-threaded OpenBLAS
sgemm (``kernels/blas.py``), writing straight into its column block of ``Y`` (``ldc = out``): no
transposed result, no second thread pool, no f32 copy of the matrix. f32 weights are multiplied
in place (each thread's mapped rows are its operand). The 4-bit family dequantizes whole 64-row tiles
transposed (contiguous on both sides, see q4.py) and multiplies them untransposed — on CPUs
without VNNI; with it, its blocks run the integer tile loop instead (``q4.block_par``).

f32 goes this way too although numpy's sgemm on the mapped view would need no kernel: OpenBLAS's
own threads keep spinning ~0.1 s after each call and starve the numba regions that follow
(measured: f32 prefill-512 268 t/s through np.dot, norms and attention 3-10x slower). The row
split changes OpenBLAS's edge blocking, so f32 results differ from the reference path's
``x @ W.T`` in the last bits. vbit and q1 rows are decoded by the codecs' own
row-range decoders (``quant/_fast.py``). Where numpy's BLAS has no reachable ``cblas_sgemm``
(``SGEMM.addr == 0``), :func:`matmul` falls back to the LinearOp's own batched path.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..format.constants import GROUP
from ..quant import F16_TABLE, TERNARY_LUT, q1_range, q1t_range, vbit_range

from ._jit import PARALLEL, PARALLEL_ORDERED, SERIAL_ORDERED, scratch, threads
from ._jit import chunk as _chunk
from .blas import NO_TRANS, SGEMM, TRANS, sgemm, single_threaded
from .floats import F32Linear, HalfLinear, half_dequant
from .q4 import R as TILE_R
from .q4 import decode_rows, tiles_dequant_t
from .q1 import Q1T, Q1Linear, overlay_rows
from .q8 import Q8Linear, q8_dequant
from .tiled import TiledLinear
from .vbit import VbitLinear

# Bytes of dequantized f32 rows per thread and step: half of a 2 MB L2 (the tile is still cached
# when sgemm packs it). Measured on the benchmark model: 256 KB 162-173, 512 KB 173-180, 1 MB
# 178-180, 4 MB 177-181 GFLOP/s (numpy's own sgemm on the f32 matrix: 186).
STEP_BYTES = 1 << 20


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


@numba.njit(**PARALLEL_ORDERED)
def tiled_gemm(addr, ilp64, ntiles, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, X, Y, bufs,
               nt):  # pragma: no cover - compiled
    """4-bit family: whole 64-row tiles dequantized transposed ([in, m·64]), then sgemm."""
    T, k = X.shape
    n = Y.shape[1]
    per = bufs.shape[2] // TILE_R  # tiles per step
    for j in prange(nt):
        buf = bufs[j]
        t0, t1 = _chunk(ntiles, nt, j, 1)
        t = t0
        while t < t1:
            e = min(t1, t + per)
            tiles_dequant_t(t, e, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, buf)
            sgemm(addr, ilp64, NO_TRANS, T, (e - t) * TILE_R, k, X, k, buf, bufs.shape[2], Y[:, t * TILE_R:], n)
            t = e


@numba.njit(**SERIAL_ORDERED)
def tiled_tail(addr, ilp64, tail, kind, src, scs, cs, params, exp2tab, X, Y, buf):  # pragma: no cover
    """Rows past the last whole tile: decoded from the stored layout, then one sgemm."""
    T, k = X.shape
    m = tail.shape[0]
    decode_rows(tail, kind, src, scs, cs, params, exp2tab, buf)
    sgemm(addr, ilp64, TRANS, T, m, k, X, k, buf, k, Y[:, tail[0]:], Y.shape[1])


def _bufs(name: str, nt: int, rows: int, cols: int) -> np.ndarray:
    return scratch(name, (nt, rows, cols))


def _step_rows(in_features: int, align: int) -> int:
    r = STEP_BYTES // max(4 * in_features, 1)
    return max(align, r // align * align)


def supported(op) -> bool:  # noqa: ANN001
    """Whether :func:`matmul` has a threaded sgemm path for this LinearOp."""
    return bool(SGEMM.addr) and isinstance(op, (F32Linear, HalfLinear, Q8Linear, TiledLinear, VbitLinear, Q1Linear))


def matmul(op, X: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:  # noqa: ANN001
    """``X[T, in] @ W.T`` for a block of tokens, into ``out`` [T, out] when given (C-contiguous).

    Uses the per-thread dequantize + sgemm kernels above when the op's family has one, else
    the op's own product."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    if not supported(op) or X.ndim != 2 or X.shape[0] == 0 or op.in_features == 0:
        Y = op(X)
        if out is None:
            return Y
        out[...] = Y
        return out
    T, k = X.shape
    n = op.out_features
    Y = np.empty((T, n), np.float32) if out is None else out
    nt = threads()
    a, w64 = SGEMM.addr, SGEMM.ilp64
    with single_threaded():
        if isinstance(op, F32Linear):
            f32_gemm(a, w64, op.w, X, Y, nt)
        elif isinstance(op, HalfLinear):
            half_gemm(a, w64, op.w, op.kind, op.all_rows, X, Y, _bufs("gemm-f", nt, _step_rows(k, 16), k), nt)
        elif isinstance(op, Q8Linear):
            q8_gemm(a, w64, op.q, op.s, op.col, op.all_rows, X, Y, _bufs("gemm-f", nt, _step_rows(k, 16), k), nt)
        elif isinstance(op, VbitLinear):
            vbit_gemm(a, w64, op.data, op.widths, op.starts, op.soff, F16_TABLE, X, Y,
                      _bufs("gemm-f", nt, _step_rows(k, 16), k), nt)
        elif isinstance(op, Q1Linear):
            q1_gemm(a, w64, op.kind, op.tiles, F16_TABLE, TERNARY_LUT, op.ptr, op.ent, X, Y,
                    _bufs("gemm-f", nt, _step_rows(k, 16), k), nt)
        else:
            if op.ntiles:
                per = max(1, _step_rows(k, TILE_R) // TILE_R)
                tiled_gemm(a, w64, op.ntiles, *op._args(), X, Y, _bufs("gemm-t", nt, k, per * TILE_R), nt)
            if op.tail.size:
                buf = scratch("gemm-tail", (op.tail.size, k))
                tiled_tail(a, w64, op.tail, op.kind, op.src, op.scs, op.cs, op.params, op.exp2tab, X, Y, buf)
    return Y


__all__ = ["matmul", "supported"]
