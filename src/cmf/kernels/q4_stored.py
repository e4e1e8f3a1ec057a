"""The stored layouts of the 4-bit family as the tile kernels (``q4.py``) read them: codes and
scale bits from the mapped bytes, one tile's repack into the kernels' layout (``pack_tile``;
the layout is described in ``q4.py``), and rows decoded straight from the stored bytes
(``decode_rows``: tails past the last whole tile and batched row picks).
"""

from __future__ import annotations

import numba
import numpy as np

from ..format.constants import GROUP
from ._jit import SERIAL, crumb, f16_to_f32, hi_nibble, lo_nibble, put_word, word_at

R = 64  # rows per tile: four 16-lane vectors
CODE_BYTES = 40  # one tile-group's 64 five-bit codes as 5 bit planes of 64 bits (bit i = row i; group_scales)
KIND_F16, KIND_Q4TP, KIND_Q2TP, KIND_Q1T = 0, 1, 2, 3  # q1t: ternary digits as crumbs t + 1
# Per kind (indexed by it, in the kernels and in ``tiled.TiledLinear`` alike): bytes of a
# tile-group's codes per row (16 nibbles or 8 crumbs), the code of a zero weight, and whether a
# group's scale is stored as f16 bits (else rebuilt from its 5-bit ladder code).
WIDTH = (16, 16, 8, 8)
ZERO = (8.0, 8.0, 1.5, 1.0)
F16_SCALES = (True, False, False, True)


@numba.njit(**SERIAL)
def code(cs, row, g):  # pragma: no cover - compiled
    """5-bit code of group g of ``row`` (LSB-first stream, one byte-aligned block per row)."""
    bit = 5 * g
    byte = bit >> 3
    word = np.int64(cs[row, byte])
    if byte + 1 < cs.shape[1]:
        word |= np.int64(cs[row, byte + 1]) << 8
    return (word >> (bit & 7)) & 31


@numba.njit(inline="always")
def le16(a, row, g, k):  # pragma: no cover - compiled
    """The little-endian uint16 at bytes k, k + 1 of group g of ``row`` (an f16 scale's bits)."""
    return np.uint16(a[row, g, k]) | (np.uint16(a[row, g, k + 1]) << np.uint16(8))


@numba.njit(inline="always")
def q1t_code(src, row, g, w):  # pragma: no cover - compiled
    """Weight w of a q1t group as t + 1 (0, 1, 2 for −1, 0, +1): base-3 digit w % 5 of byte
    w // 5 (0 → 0, 1 → +1, 2 → −1, as the codec's TERNARY_LUT)."""
    digit = (np.int64(src[row, g, 2 + w // 5]) // (3 ** (w % 5))) % 3
    return 1 if digit == 0 else (2 if digit == 1 else 0)


@numba.njit(**SERIAL)
def pack_tile_q1t(t, src, planes, sc):  # pragma: no cover - compiled
    """Tile t of a q1t base (groups of ``[f16 s][7 B base-3]``): each weight as the crumb t + 1,
    four to a byte like q2tp's planes, and the scale's f16 bits."""
    gpr = planes.shape[1]
    for i in range(R):
        row = t * R + i
        for g in range(gpr):
            sc[t, g, i] = le16(src, row, g, 0)
            for k in range(8):
                v = 0
                for q in range(4):
                    v |= q1t_code(src, row, g, 4 * k + q) << (2 * q)
                planes[t, g, k >> 2, i, k & 3] = np.uint8(v)


@numba.njit(**SERIAL)
def pack_tile(t, kind, src, scs, cs, params, exp2tab, planes, sc, cw, cw_first, lad):  # pragma: no cover - compiled
    """Copy tile t from the stored layout: planes, then f16 scale bits, or the codes (bit planes,
    into ``cw`` from tile-group ``cw_first`` on: t·groups for the whole matrix's array, 0 for one
    tile's scratch) and each row's ladder base ``lad[t] = (2^lo, ratio)``.

    The ladder base is looked up here, once: per product it meant two dependent loads per row
    (the row's params in the mapped file, then ``exp2tab`` at a scattered index) that the weight
    stream had evicted from cache: ~0.5 µs a tile measured cold; storing the base made q4tp
    decode 4–5% faster. Only final values are stored, so packing the same tile twice at once is
    harmless."""
    if kind == KIND_Q1T:
        pack_tile_q1t(t, src, planes, sc)
        return
    gpr = planes.shape[1]
    words = planes.shape[2]
    rec = src.shape[2]
    off = rec - 4 * words  # q4_tiled records: [f16 scale][16 B], the nibbles at byte 2
    # a word at a time (unaligned 32-bit loads and stores): byte by byte it ran at ~1 GB/s, a
    # tenth of a second of the first prompt of a 100 MB model
    for g in range(gpr):
        for w in range(words):
            dst = ((t * gpr + g) * words + w) * R * 4
            for i in range(R):
                put_word(planes, dst + 4 * i, word_at(src, ((t * R + i) * gpr + g) * rec + off + 4 * w))
    if kind == KIND_F16:
        for i in range(R):
            row = t * R + i
            for g in range(gpr):
                sc[t, g, i] = le16(scs, row, g, 0)
        return
    for i in range(R):
        lad[t, 0, i] = exp2tab[params[t * R + i, 0]]
        lad[t, 1, i] = exp2tab[params[t * R + i, 1]]
    codes = np.empty(R, np.int64)
    for g in range(gpr):
        for i in range(R):
            c = code(cs, t * R + i, g)
            if kind == KIND_Q2TP:  # store rung - 1; 31 (never a live rung - 1) marks a dead group
                c = c - 1 if c > 0 else 31
            codes[i] = c
        base = (cw_first + g) * CODE_BYTES
        for p in range(5):
            for j in range(R // 8):
                v = 0
                for m in range(8):
                    v |= ((codes[8 * j + m] >> p) & 1) << m
                # each byte is written once with its final value: a second thread packing the
                # same tile concurrently (two Python threads, same op) rewrites identical bytes
                cw[base + 8 * p + j] = np.uint8(v)


@numba.njit(**SERIAL)
def decode_rows(rows, kind, src, scs, cs, params, exp2tab, out):  # pragma: no cover - compiled
    """Rows from the stored layout (exactly the codec's values): tails and batched row picks
    (q1t: the base only; its overlay is the caller's)."""
    gpr = src.shape[1]
    if kind == KIND_Q1T:
        for i in range(rows.shape[0]):
            for g in range(gpr):
                s = f16_to_f32(le16(src, rows[i], g, 0))
                for w in range(GROUP):
                    out[i, g * GROUP + w] = np.float32(q1t_code(src, rows[i], g, w) - 1) * s
        return
    width = WIDTH[kind]
    off = src.shape[2] - width
    per = GROUP // width  # weights per byte: 2 (nibbles) or 4 (crumbs)
    rung = np.empty(33, np.float32)
    for i in range(rows.shape[0]):
        row = rows[i]
        if kind != KIND_F16:
            rung[0] = 0
            rung[1] = exp2tab[params[row, 0]]
            ratio = exp2tab[params[row, 1]]
            for c in range(2, 33):
                rung[c] = rung[c - 1] * ratio
        for g in range(gpr):
            if kind == KIND_F16:
                s = f16_to_f32(le16(scs, row, g, 0))
            elif kind == KIND_Q4TP:
                s = rung[code(cs, row, g) + 1]
            else:
                s = rung[code(cs, row, g)]
            base = g * GROUP
            for k in range(width):
                b = src[row, g, off + k]
                if per == 2:
                    out[i, base + 2 * k] = (lo_nibble(b) - np.float32(8)) * s
                    out[i, base + 2 * k + 1] = (hi_nibble(b) - np.float32(8)) * s
                else:
                    for q in range(4):
                        out[i, base + 4 * k + q] = (crumb(b, q) - np.float32(1.5)) * s
