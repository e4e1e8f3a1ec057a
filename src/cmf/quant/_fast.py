"""numba decoders for whole tensors: one pass, no temporaries, parallel only when it pays.

Each function writes into a preallocated float32 array and computes exactly what the numpy
decoders compute (same operations, same order, no fastmath), so results are bit-identical; the
tests compare the two. numba has no f16 type: f16 scales go through a 65536-entry table, whole
f16 tensors through the exact register conversion of ``cmf.numba_prims`` (it vectorizes).
Scale ladders (q4tp/q2tp) are expanded beforehand (``ladder.q4tp_ladder``): exp2 must be the
one table every encoder and decoder shares, not whatever exp2f LLVM links.

Every decoder is a serial body over a range of its outer index (rows or groups) plus a parallel
driver that gives each thread one contiguous range. Starting a parallel region costs ~10-15 µs
on an idle machine and milliseconds on a loaded one (a range waits for a descheduled thread):
a 64×64 matrix took 2.7 ms that way. Outputs under ``PARALLEL_MIN`` floats therefore run the
serial body directly (a few µs). The public names keep their signatures.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from ..numba_prims import expand_nibbles, f16_to_f32  # exact conversions in registers

F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_SER = {"cache": True, "nogil": True}
_PAR = {"parallel": True, "cache": True, "nogil": True}

PARALLEL_MIN = 1 << 18  # output floats (1 MB) below which one thread decodes the whole tensor


def _threads(n_out: int) -> int:
    """Threads for a decode of ``n_out`` floats: 1 (serial body, no parallel region) when small."""
    return numba.get_num_threads() if n_out >= PARALLEL_MIN else 1


# -- f16 / bf16 ---------------------------------------------------------------------------------

@njit(**_SER)
def _f16_range(src, table, out, lo, hi):  # pragma: no cover - compiled
    # slices, so the loop index starts at 0: LLVM then knows it is never negative and drops
    # numba's wrap-around fix-up from the loop body
    # ``table`` is kept in the signature; the conversion is the CPU's (exact, as the table)
    a = src[2 * lo:2 * hi]
    o = out[lo:hi]
    for i in range(hi - lo):
        o[i] = f16_to_f32(np.uint16(a[2 * i]) | (np.uint16(a[2 * i + 1]) << np.uint16(8)))


@njit(**_PAR)
def _f16_par(src, table, out, nt):  # pragma: no cover - compiled
    n = out.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _f16_range(src, table, out, min(n, c * step), min(n, (c + 1) * step))


def f16_decode(src: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    """src: uint8 (2n,) little-endian f16 -> out (n,)."""
    nt = _threads(out.shape[0])
    if nt > 1:
        _f16_par(src, table, out, nt)
    else:
        _f16_range(src, table, out, 0, out.shape[0])


@njit(**_SER)
def _bf16_range(src, out, lo, hi):  # pragma: no cover - compiled
    a = src[2 * lo:2 * hi]
    o = out[lo:hi]
    for i in range(hi - lo):
        o[i] = (np.uint32(a[2 * i]) << 16) | (np.uint32(a[2 * i + 1]) << 24)


@njit(**_PAR)
def _bf16_par(src, out, nt):  # pragma: no cover - compiled
    n = out.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _bf16_range(src, out, min(n, c * step), min(n, (c + 1) * step))


def bf16_decode(src: np.ndarray, out: np.ndarray) -> None:
    """src: uint8 (2n,) little-endian bf16 -> out viewed as uint32 (n,)."""
    nt = _threads(out.shape[0])
    if nt > 1:
        _bf16_par(src, out, nt)
    else:
        _bf16_range(src, out, 0, out.shape[0])


# -- q8 -----------------------------------------------------------------------------------------

@njit(**_SER)
def _q8_range(q, scales, col, out, lo, hi):  # pragma: no cover - compiled
    cols = q.shape[1]
    two_f = col.shape[0] == cols and cols > 0
    for r in range(lo, hi):
        s = scales[r]
        if two_f:
            for c in range(cols):
                out[r, c] = (np.float32(q[r, c]) * s) * col[c]
        else:
            for c in range(cols):
                out[r, c] = np.float32(q[r, c]) * s


@njit(**_PAR)
def _q8_par(q, scales, col, out, nt):  # pragma: no cover - compiled
    n = q.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _q8_range(q, scales, col, out, min(n, c * step), min(n, (c + 1) * step))


def q8_decode(q: np.ndarray, scales: np.ndarray, col: np.ndarray, out: np.ndarray) -> None:
    """q: int8 (rows, cols); scales (rows,); col (cols,) or empty for q8_row."""
    nt = _threads(out.size)
    if nt > 1:
        _q8_par(q, scales, col, out, nt)
    else:
        _q8_range(q, scales, col, out, 0, q.shape[0])


# -- 4-bit groups -------------------------------------------------------------------------------

@njit(**_SER)
def _q4_groups_range(packed, scales, out, lo, hi):  # pragma: no cover - compiled
    # one group per expand_nibbles: a shuffle interleaves the two nibble vectors (the per-weight
    # loop left LLVM to interleave 32 scalar stores: 9.6 GB/s on 2 threads)
    p = packed.reshape(-1)
    o = out.reshape(-1)
    for g in range(lo, hi):
        expand_nibbles(p, 16 * g, scales[g], o, 32 * g)


@njit(**_PAR)
def _q4_groups_par(packed, scales, out, nt):  # pragma: no cover - compiled
    n = packed.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _q4_groups_range(packed, scales, out, min(n, c * step), min(n, (c + 1) * step))


def q4_groups_decode(packed: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """packed: uint8 (G, 16) nibbles; scales (G,); out (G, 32)."""
    nt = _threads(out.size)
    if nt > 1:
        _q4_groups_par(packed, scales, out, nt)
    else:
        _q4_groups_range(packed, scales, out, 0, packed.shape[0])


@njit(**_SER)
def _q4_tiles_range(tiles, table, out, lo, hi):  # pragma: no cover - compiled
    t = tiles.reshape(-1)
    o = out.reshape(-1)
    for g in range(lo, hi):
        s = table[np.int64(tiles[g, 0]) | (np.int64(tiles[g, 1]) << 8)]
        expand_nibbles(t, 18 * g + 2, s, o, 32 * g)


@njit(**_PAR)
def _q4_tiles_par(tiles, table, out, nt):  # pragma: no cover - compiled
    n = tiles.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _q4_tiles_range(tiles, table, out, min(n, c * step), min(n, (c + 1) * step))


def q4_tiles_decode(tiles: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    """tiles: uint8 (G, 18) = [f16 scale][16 B nibbles]; out (G, 32)."""
    nt = _threads(out.size)
    if nt > 1:
        _q4_tiles_par(tiles, table, out, nt)
    else:
        _q4_tiles_range(tiles, table, out, 0, tiles.shape[0])


# -- q4tp / q2tp --------------------------------------------------------------------------------

@njit(**_SER)
def _ladder_range(planes, codes, ladder, values, out, lo, hi):  # pragma: no cover - compiled
    gpr, per = planes.shape[1], planes.shape[2]
    k = values.shape[1]
    flat = planes.reshape(-1)
    oflat = out.reshape(-1)
    cols = out.shape[1]
    for r in range(lo, hi):
        for g in range(gpr):
            bit = 5 * g
            byte = bit >> 3
            word = np.int64(codes[r, byte])
            if byte + 1 < codes.shape[1]:
                word |= np.int64(codes[r, byte + 1]) << 8
            s = ladder[r, (word >> (bit & 7)) & 31]
            if per == 16:  # nibbles: (q - 8)·s, exactly values[b, i]·s without the table gather
                expand_nibbles(flat, (r * gpr + g) * 16, s, oflat, r * cols + g * 32)
            else:
                o = out[r, g * 32:(g + 1) * 32]
                p = planes[r, g]
                for j in range(per):
                    b = p[j]
                    for i in range(k):
                        o[j * k + i] = values[b, i] * s


@njit(**_PAR)
def _ladder_par(planes, codes, ladder, values, out, nt):  # pragma: no cover - compiled
    n = planes.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _ladder_range(planes, codes, ladder, values, out, min(n, c * step), min(n, (c + 1) * step))


def ladder_decode(planes: np.ndarray, codes: np.ndarray, ladder: np.ndarray, values: np.ndarray,
                  out: np.ndarray) -> None:
    """q4tp/q2tp. planes: uint8 (rows, gpr, P); codes: uint8 (rows, cb); ladder (rows, 32);
    values: (256, 32 // P) f32 table of a plane byte's weights (before scaling); out (rows, gpr·32)."""
    nt = _threads(out.size)
    if nt > 1:
        _ladder_par(planes, codes, ladder, values, out, nt)
    else:
        _ladder_range(planes, codes, ladder, values, out, 0, planes.shape[0])


# -- vbit ---------------------------------------------------------------------------------------

@njit(**_SER)
def _vbit_range(data, widths, starts, scales_off, table, cols, out, lo, hi):  # pragma: no cover
    gpr = cols // 32
    for r in range(lo, hi):
        b = np.int64(widths[r])
        level = np.int64((1 << (b - 1)) - 1)
        mask = np.int64((1 << b) - 1)
        pos = starts[r]
        acc = np.int64(0)
        nbits = np.int64(0)
        for g in range(gpr):
            so = scales_off + 2 * (r * gpr + g)
            s = table[np.int64(data[so]) | (np.int64(data[so + 1]) << 8)]
            for i in range(32):
                while nbits < b:
                    acc = ((acc << 8) | np.int64(data[pos])) & 0xFFFFFFFF
                    pos += 1
                    nbits += 8
                u = (acc >> (nbits - b)) & mask
                nbits -= b
                out[r, g * 32 + i] = np.float32(u - level) * s


@njit(**_PAR)
def _vbit_par(data, widths, starts, scales_off, table, cols, out, nt):  # pragma: no cover
    n = widths.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _vbit_range(data, widths, starts, scales_off, table, cols, out, min(n, c * step), min(n, (c + 1) * step))


def vbit_decode(data: np.ndarray, widths: np.ndarray, starts: np.ndarray, scales_off: int, table: np.ndarray,
                cols: int, out: np.ndarray) -> None:
    """MSB-first rows of widths 3..8 starting at ``starts[r]`` (absolute byte offsets)."""
    nt = _threads(out.size)
    if nt > 1:
        _vbit_par(data, widths, starts, scales_off, table, cols, out, nt)
    else:
        _vbit_range(data, widths, starts, scales_off, table, cols, out, 0, widths.shape[0])


# -- q1 / q1t -----------------------------------------------------------------------------------

@njit(**_SER)
def _q1_range(tiles, table, out, lo, hi):  # pragma: no cover - compiled
    for g in range(lo, hi):
        s = table[np.int64(tiles[g, 0]) | (np.int64(tiles[g, 1]) << 8)]
        for j in range(4):
            b = tiles[g, 2 + j]
            for k in range(8):
                out[g, 8 * j + k] = np.float32(2 * ((b >> k) & 1) - 1) * s


@njit(**_PAR)
def _q1_par(tiles, table, out, nt):  # pragma: no cover - compiled
    n = tiles.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _q1_range(tiles, table, out, min(n, c * step), min(n, (c + 1) * step))


def q1_decode(tiles: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    """tiles: uint8 (G, 6) = [f16 scale][4 B sign bits, LSB-first]; out (G, 32)."""
    nt = _threads(out.size)
    if nt > 1:
        _q1_par(tiles, table, out, nt)
    else:
        _q1_range(tiles, table, out, 0, tiles.shape[0])


@njit(**_SER)
def _q1t_range(tiles, table, lut, out, lo, hi):  # pragma: no cover - compiled
    for g in range(lo, hi):
        s = table[np.int64(tiles[g, 0]) | (np.int64(tiles[g, 1]) << 8)]
        for k in range(32):
            out[g, k] = lut[tiles[g, 2 + k // 5], k % 5] * s


@njit(**_PAR)
def _q1t_par(tiles, table, lut, out, nt):  # pragma: no cover - compiled
    n = tiles.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _q1t_range(tiles, table, lut, out, min(n, c * step), min(n, (c + 1) * step))


def q1t_decode(tiles: np.ndarray, table: np.ndarray, lut: np.ndarray, out: np.ndarray) -> None:
    """tiles: uint8 (G, 9) = [f16 scale][7 B base-3]; lut (256, 5) ternary digits; out (G, 32)."""
    nt = _threads(out.size)
    if nt > 1:
        _q1t_par(tiles, table, lut, out, nt)
    else:
        _q1t_range(tiles, table, lut, out, 0, tiles.shape[0])


# Row-range decoders the fused kernels reuse (cmf.kernels: vbit rows, q1/q1t groups), exported by
# cmf.quant under these public names.
vbit_range = _vbit_range
q1_range = _q1_range
q1t_range = _q1t_range
