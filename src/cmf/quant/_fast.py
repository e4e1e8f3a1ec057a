"""numba decoders for whole tensors: parallel over rows (or groups), one pass, no temporaries.

Each function writes into a preallocated float32 array and computes exactly what the numpy
decoders compute (same operations, same order, no fastmath), so results are bit-identical; the
tests compare the two. numba has no f16 type, so f16 values go through a 65536-entry table.
Scale ladders (q4tp/q2tp) are expanded beforehand (``ladder.q4tp_ladder``): exp2 must be the
one table every encoder and decoder shares, not whatever exp2f LLVM links.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_OPTS = {"parallel": True, "cache": True, "nogil": True}


@njit(**_OPTS)
def f16_decode(src, table, out):  # pragma: no cover - compiled
    """src: uint8 (2n,) little-endian f16 -> out (n,)."""
    n = out.shape[0]
    for i in prange(n):
        out[i] = table[np.int64(src[2 * i]) | (np.int64(src[2 * i + 1]) << 8)]


@njit(**_OPTS)
def bf16_decode(src, out):  # pragma: no cover - compiled
    """src: uint8 (2n,) little-endian bf16 -> out viewed as uint32 (n,)."""
    n = out.shape[0]
    for i in prange(n):
        out[i] = (np.uint32(src[2 * i]) << 16) | (np.uint32(src[2 * i + 1]) << 24)


@njit(**_OPTS)
def q8_decode(q, scales, col, out):  # pragma: no cover - compiled
    """q: int8 (rows, cols); scales (rows,); col (cols,) or empty for q8_row."""
    rows, cols = q.shape
    two_f = col.shape[0] == cols and cols > 0
    for r in prange(rows):
        s = scales[r]
        if two_f:
            for c in range(cols):
                out[r, c] = (np.float32(q[r, c]) * s) * col[c]
        else:
            for c in range(cols):
                out[r, c] = np.float32(q[r, c]) * s


@njit(**_OPTS)
def q4_groups_decode(packed, scales, out):  # pragma: no cover - compiled
    """packed: uint8 (G, 16) nibbles; scales (G,); out (G, 32)."""
    for g in prange(packed.shape[0]):
        s = scales[g]
        for k in range(16):
            b = packed[g, k]
            out[g, 2 * k] = np.float32(np.int32(b & 15) - 8) * s
            out[g, 2 * k + 1] = np.float32(np.int32(b >> 4) - 8) * s


@njit(**_OPTS)
def q4_tiles_decode(tiles, table, out):  # pragma: no cover - compiled
    """tiles: uint8 (G, 18) = [f16 scale][16 B nibbles]; out (G, 32)."""
    for g in prange(tiles.shape[0]):
        s = table[np.int64(tiles[g, 0]) | (np.int64(tiles[g, 1]) << 8)]
        for k in range(16):
            b = tiles[g, 2 + k]
            out[g, 2 * k] = np.float32(np.int32(b & 15) - 8) * s
            out[g, 2 * k + 1] = np.float32(np.int32(b >> 4) - 8) * s


@njit(**_OPTS)
def ladder_decode(planes, codes, ladder, values, out):  # pragma: no cover - compiled
    """q4tp/q2tp. planes: uint8 (rows, gpr, P); codes: uint8 (rows, cb); ladder (rows, 32);
    values: (256, 32 // P) f32 table of a plane byte's weights (before scaling); out (rows, gpr·32)."""
    rows, gpr, per = planes.shape
    k = values.shape[1]
    for r in prange(rows):
        for g in range(gpr):
            bit = 5 * g
            byte = bit >> 3
            word = np.int64(codes[r, byte])
            if byte + 1 < codes.shape[1]:
                word |= np.int64(codes[r, byte + 1]) << 8
            s = ladder[r, (word >> (bit & 7)) & 31]
            base = g * 32
            for j in range(per):
                b = planes[r, g, j]
                for i in range(k):
                    out[r, base + j * k + i] = values[b, i] * s


@njit(**_OPTS)
def vbit_decode(data, widths, starts, scales_off, table, cols, out):  # pragma: no cover - compiled
    """MSB-first rows of widths 3..8 starting at ``starts[r]`` (absolute byte offsets)."""
    rows = widths.shape[0]
    gpr = cols // 32
    for r in prange(rows):
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


@njit(**_OPTS)
def q1_decode(tiles, table, out):  # pragma: no cover - compiled
    """tiles: uint8 (G, 6) = [f16 scale][4 B sign bits, LSB-first]; out (G, 32)."""
    for g in prange(tiles.shape[0]):
        s = table[np.int64(tiles[g, 0]) | (np.int64(tiles[g, 1]) << 8)]
        for j in range(4):
            b = tiles[g, 2 + j]
            for k in range(8):
                out[g, 8 * j + k] = np.float32(2 * ((b >> k) & 1) - 1) * s


@njit(**_OPTS)
def q1t_decode(tiles, table, lut, out):  # pragma: no cover - compiled
    """tiles: uint8 (G, 9) = [f16 scale][7 B base-3]; lut (256, 5) ternary digits; out (G, 32)."""
    for g in prange(tiles.shape[0]):
        s = table[np.int64(tiles[g, 0]) | (np.int64(tiles[g, 1]) << 8)]
        for k in range(32):
            out[g, k] = lut[tiles[g, 2 + k // 5], k % 5] * s
