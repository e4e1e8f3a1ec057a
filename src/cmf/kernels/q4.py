"""Fused kernels for the 4-bit and ladder family: ``q4_block``, ``q4_tiled``, ``q4tp``, ``q2tp``.

Why a repack: in the stored layouts the 32 weights of a group sit in 16 (or 8) consecutive
bytes of one row, so a per-row kernel needs a horizontal sum per group and LLVM vectorizes it
badly (measured ~3.4 GB/s). Here the bytes are regrouped once into tiles of ``R = 64`` rows:
``planes[tile, group, word, row, byte]`` — a row's group split into 4-byte words (4 of them for
nibbles, 2 for crumbs), and for each word the 64 rows' words one after another. So 16 rows'
words are one 64-byte load with a row per 32-bit lane: the integer kernels feed them to
``vpdpbusd`` as they are (``_ir.tile_dot_i8*``) and the float kernels extract codes from them
with shifts (``_jit.word_at`` / ``field32``); no reductions (each lane owns one row), and a
group's per-row scale multiplies 64 partial sums at once. (The layout before this one,
``[tile, group, byte, row]``, needed a byte gather of four shuffles per 16 rows and word for
the integer kernels: 1.5–1.6× slower from cache.)

Memory: the repacked copy is the payload's size. Planes keep their bytes (16 per group for q4,
8 for q2tp); q4_block/q4_tiled keep the f16 scale bits (2 bytes per group); q4tp/q2tp keep their
5-bit codes as five bit planes per 64 rows (40 bytes per tile-group, the stored density) and
each row's ladder base ``lad[tile] = (2^lo, ratio)`` as two float32 where the file has two uint16
table indices (4 bytes a row more; the mapped params are given back with the rest of the source,
``runtime/memory.py``). Per tile, each row's ratio^(2^p) is expanded into a small scratch, and a
scale is built by multiplying in the powers whose code bit is set (``_jit.group_scales``: lane
masks, no per-row gather). On targets without mask registers the scales are instead built once,
when the tile is packed, and kept as float32 (:data:`DECODED_SCALES`: 256 bytes per tile-group
of 1 KB of nibbles, where the bit planes, then not kept, took 40). Rows past the last whole tile
(``rows % 64``) are not repacked; they are decoded from the mapped bytes on every call. Tiles are
packed lazily, the first time a product needs them, so rows that a mask never selects are never
read.

Sums use ``Σ(q - z)·x = Σ q·x - z·Σx`` with ``z·Σx`` computed once per call and group (z = 8
for nibbles, 1.5 for q2tp crumbs); results agree with decode + numpy to ~2e-6 of max |y|
(measured up to in = 16384, positive and outlier inputs included).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..format.constants import GROUP
from ._ir import DOT_PATH, INT_DOT, tile_dot_i8_crumbs, tile_dot_i8_nibbles, tile_dot_i8x3_crumbs, tile_dot_i8x3_nibbles
from ._jit import DECODED, PARALLEL_ORDERED, SERIAL, SERIAL_ORDERED, field32, group_scales, prefetch_at, word_at
from .ladder_scales import DECODED_SCALES, pack, scale_mode
from .q4_stored import CODE_BYTES, R, WIDTH, ZERO, decode_rows
from .xprep import fill_x, quantize_x


# The integer tile loop prefetches the planes this many bytes ahead (into L2). Each thread streams
# its tiles sequentially, but the hardware prefetchers stop at every 4 KB boundary, and a thread
# alternates between waiting for DRAM and computing; fetching a tile-group's lines 16 KB early
# overlaps the two: q4t/q4tp decode 1.10–1.24× (old and new code in one process, interleaved;
# 4 KB ahead gave 1.01–1.10×).
PREFETCH_AHEAD = 16384
FINE = np.float32(1 / 128 ** 2)  # unit of the three pieces' combined integer sum
# Exact mode runs the integer kernels on x split into three int8 pieces where the CPU has a
# hardware u8 x s8 dot (AVX-512 VNNI, AVX-VNNI, AVX2: kernels/int_dot.py; the portable form is
# slower than the float kernels); elsewhere x stays float32.
EXACT_PIECES = 3 if INT_DOT else 0
# The x pieces for which blocks of tokens (prefill) run the integer block loop (``block_par``)
# rather than dequantize + sgemm. With vpdpbusd on 512 bits both modes gain (1.2-1.3x exact, 2x
# int8); with AVX2's vpmaddubsw only one piece does: SmolLM2-135M q4tp prefill-512 exact 87-115
# t/s against 116-250 through sgemm, int8 175-228 against 130-218 (1 thread, 2026-12-01).
# AVX-VNNI (256-bit vpdpbusd) is not measured and takes the AVX2 choice.
BLOCK_PIECES = (1, 3) if DOT_PATH == "vnni512" else ((1,) if INT_DOT else ())


@numba.njit(**SERIAL)
def _prefetch_start(tiles, j0, j1, planes, sc, cw):  # pragma: no cover - compiled
    """Prefetch the first PREFETCH_AHEAD bytes of the planes a chunk of tiles starts with (and
    their scales or scale codes): the part the tile loop's own prefetch, always PREFETCH_AHEAD
    ahead, never covers. Requested at once, those lines arrive in parallel instead of as the
    loop's demand misses; a small product starts each thread on one (SmolLM2's o-projection is
    4-5 tiles a thread, 16 KB of them this start)."""
    gpr = planes.shape[1]
    tb = planes.shape[2] * 4 * planes.shape[3]  # bytes of a tile-group
    b0 = tiles[j0] * gpr * tb
    e = min(planes.size, b0 + PREFETCH_AHEAD, (tiles[j1 - 1] + 1) * gpr * tb)
    for off in range(b0, e, 64):
        prefetch_at(planes, off)
    n = (e - b0 + tb - 1) // tb  # tile-groups covered
    g0 = tiles[j0] * gpr
    if sc.size:
        st = sc.shape[2] * 2
        for off in range(g0 * st, min(sc.size * 2, (g0 + n) * st), 64):
            prefetch_at(sc, off)
    if cw.size:
        for off in range(g0 * CODE_BYTES, min(cw.size, (g0 + n) * CODE_BYTES), 64):
            prefetch_at(cw, off)


@numba.njit(**SERIAL_ORDERED)
def _tile(t, ti, kind, mode, planes, sc, cw, t0, pw, s, acc, xp, xs):  # pragma: no cover - compiled
    """acc[i] = row (t·R + i) · X[ti] for one packed tile.

    Four independent partial sums per row (a chain of 32 dependent multiply-adds would be bound
    by FMA latency). One vector at a time, with a 1-D accumulator: looping over the batch inside
    the group loop measured 45% slower (LLVM then reloads the x values on every iteration).
    Rewriting the nibble sum as Σ b·xe + hi·(xo - 16·xe) (b the whole byte) saves two
    instructions per byte (+10% speed) but its cancellation cost ~8e-6 of relative accuracy on
    positive inputs, too close to the 1e-5 contract: not used.
    """
    gpr = planes.shape[1]
    words = planes.shape[2]
    acc[:] = 0
    for g in range(gpr):
        group_scales(sc, cw, t * gpr + g, t0, pw, s, mode)
        z = xs[ti, g]
        tg = (t * gpr + g) * words * 4 * R  # byte offset of the tile-group; word w of row i at + 4(R·w + i)
        if words == 2:  # crumbs: q2tp, q1t
            for i in range(R):
                a = np.float32(0)
                b = np.float32(0)
                c = np.float32(0)
                d = np.float32(0)
                for k in range(0, 8, 2):
                    wd = word_at(planes, tg + 4 * (R * (k >> 2) + i))
                    sh = 8 * (k & 3)
                    a += field32(wd, sh, 3) * xp[ti, 0, g, k]
                    a += field32(wd, sh + 2, 3) * xp[ti, 1, g, k]
                    b += field32(wd, sh + 4, 3) * xp[ti, 2, g, k]
                    b += field32(wd, sh + 6, 3) * xp[ti, 3, g, k]
                    c += field32(wd, sh + 8, 3) * xp[ti, 0, g, k + 1]
                    c += field32(wd, sh + 10, 3) * xp[ti, 1, g, k + 1]
                    d += field32(wd, sh + 12, 3) * xp[ti, 2, g, k + 1]
                    d += field32(wd, sh + 14, 3) * xp[ti, 3, g, k + 1]
                acc[i] += ((a + b) + (c + d) - z) * s[i]
        else:
            for i in range(R):
                a = np.float32(0)
                b = np.float32(0)
                c = np.float32(0)
                d = np.float32(0)
                for k in range(0, 16, 2):
                    wd = word_at(planes, tg + 4 * (R * (k >> 2) + i))
                    sh = 8 * (k & 3)
                    a += field32(wd, sh, 15) * xp[ti, 0, g, k]
                    b += field32(wd, sh + 4, 15) * xp[ti, 1, g, k]
                    c += field32(wd, sh + 8, 15) * xp[ti, 0, g, k + 1]
                    d += field32(wd, sh + 12, 15) * xp[ti, 1, g, k + 1]
                acc[i] += ((a + b) + (c + d) - z) * s[i]


@numba.njit(**SERIAL_ORDERED)
def tiles_run(tiles, j0, j1, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, xp, xs, xv, xd, Y):
    """Y[ti, j·R + i] = row (tiles[j]·R + i) · X[ti] for tile positions j in [j0, j1).

    ``xp[ti, phase, g, k]`` is X regrouped by the position of a weight within its byte (see
    ``split_x``); ``xs[ti, g]`` is the zero point times Σ of the group's x. With int8
    activations (``xv`` not empty, see ``quantize_x``) ``xp`` is unused and ``xs`` holds the
    zero point times Σ of the group's int8 values.
    """  # pragma: no cover - compiled
    i8 = xv.shape[0] > 0
    S = np.empty(R, np.int32)
    acc = np.empty(R, np.float32)
    s = np.empty(R, np.float32)
    t0 = np.empty(R, np.float32)
    pw = np.empty(5 * R, np.float32)
    gpr = planes.shape[1]
    width = 4 * planes.shape[2]
    per = xv.shape[1] // max(gpr, 1)  # packed int32 words of x per group
    three = xs.shape[1] == 3 * gpr
    if i8 and j1 > j0:
        _prefetch_start(tiles, j0, j1, planes, sc, cw)
    for j in range(j0, j1):
        t = tiles[j]
        if ready[t] == 0:
            pack(t, kind, src, scs, cs, params, exp2tab, planes, sc, cw, lad, ready)
        mode = scale_mode(t, kind, lad, ready, t0, pw)
        for ti in range(xs.shape[0]):
            if not i8:
                _tile(t, ti, kind, mode, planes, sc, cw, t0, pw, s, acc, xp, xs)
            else:
                # The integer tile product, written out here rather than in a helper: a numba
                # function taking arrays costs a reference-count call per array and call, which
                # per tile (two threads touching the same counters) was ~10% of the product.
                # Codes times int8 activations are summed exactly in int32
                # (``_ir.tile_dot_i8_*``), then acc[i] += s[i]·d·(S[i] − z·Σxq) per group. With x
                # in three pieces (exact mode) S is the pieces' combined integer sum
                # S_0·128² + S_1·128 + S_2 and the zero-point sums are combined the same way (in
                # float64, rounded once), so a group adds s[i]·d·(S − z)/128².
                xrow = ti * xv.shape[1]  # offsets into the whole (C-contiguous) xv
                acc[:] = 0
                for g in range(gpr):
                    group_scales(sc, cw, t * gpr + g, t0, pw, s, mode)
                    base = (t * gpr + g) * width * R
                    ahead = base + PREFETCH_AHEAD
                    if ahead < planes.size:  # the tile-group 16 KB ahead, into L2 (see PREFETCH_AHEAD)
                        for q in range(width):  # width·R bytes: width cache lines
                            prefetch_at(planes, ahead + 64 * q)
                        if DECODED_SCALES and mode == DECODED:  # and its scales (compiled only where used)
                            sa = (t * gpr + g) * 4 * R + PREFETCH_AHEAD // (width * R) * 4 * R
                            for q in range(4):
                                prefetch_at(sc, sa + 64 * q)
                    d = xd[ti, g]
                    if three:
                        if width == 16:
                            tile_dot_i8x3_nibbles(planes, base, xv, xrow + g * per, S)
                        else:
                            tile_dot_i8x3_crumbs(planes, base, xv, xrow + g * per, S)
                        zc = np.float32(np.float64(xs[ti, 3 * g]) * 16384.0 + np.float64(xs[ti, 3 * g + 1]) * 128.0
                                        + np.float64(xs[ti, 3 * g + 2]))
                        dc = d * FINE
                        for i in range(R):
                            acc[i] += s[i] * (dc * (np.float32(S[i]) - zc))
                    else:
                        if width == 16:
                            tile_dot_i8_nibbles(planes, base, xv, xrow + g * per, S)
                        else:
                            tile_dot_i8_crumbs(planes, base, xv, xrow + g * per, S)
                        z = xs[ti, g]
                        for i in range(R):
                            acc[i] += s[i] * (d * (np.float32(S[i]) - z))
            for i in range(R):
                Y[ti, j * R + i] = acc[i]


@numba.njit(**PARALLEL_ORDERED)
def tiles_par(tiles, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, xp, xs, xv, xd, Y, nt):
    """tiles_run over one contiguous chunk of the tile list per thread."""  # pragma: no cover
    n = tiles.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        j0 = min(n, c * step)
        j1 = min(n, j0 + step)
        tiles_run(tiles, j0, j1, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, xp, xs, xv, xd, Y)


@numba.njit(**SERIAL_ORDERED)
def tiles_block(tiles, j0, j1, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, xs, xv, xd, Y):
    """``tiles_run``'s integer product for a block of tokens (prefill): the same arithmetic for
    each token, but a tile's group scales are built once for all of them (``sg``), and its bytes,
    read from DRAM once, are multiplied from L1/L2 by every token. No prefetch: the next tile's
    fetch hides behind the block's arithmetic. Needs x as int8 pieces (``xv``).

    The group product is written out again rather than shared with ``tiles_run``: moved into an
    ``inline="always"`` helper for both, it made the decode loop 0.87× as fast (q4tp, in-process
    A/B), for the reason ``tiles_run`` gives."""  # pragma: no cover
    S = np.empty(R, np.int32)
    acc = np.empty(R, np.float32)
    s = np.empty(R, np.float32)
    t0 = np.empty(R, np.float32)
    pw = np.empty(5 * R, np.float32)
    gpr = planes.shape[1]
    sg = np.empty((gpr, R), np.float32)
    width = 4 * planes.shape[2]
    per = xv.shape[1] // max(gpr, 1)
    three = xs.shape[1] == 3 * gpr
    for j in range(j0, j1):
        t = tiles[j]
        if ready[t] == 0:
            pack(t, kind, src, scs, cs, params, exp2tab, planes, sc, cw, lad, ready)
        mode = scale_mode(t, kind, lad, ready, t0, pw)
        for g in range(gpr):
            group_scales(sc, cw, t * gpr + g, t0, pw, s, mode)
            for i in range(R):
                sg[g, i] = s[i]
        for ti in range(xs.shape[0]):
            xrow = ti * xv.shape[1]
            acc[:] = 0
            for g in range(gpr):
                base = (t * gpr + g) * width * R
                d = xd[ti, g]
                if three:
                    if width == 16:
                        tile_dot_i8x3_nibbles(planes, base, xv, xrow + g * per, S)
                    else:
                        tile_dot_i8x3_crumbs(planes, base, xv, xrow + g * per, S)
                    zc = np.float32(np.float64(xs[ti, 3 * g]) * 16384.0 + np.float64(xs[ti, 3 * g + 1]) * 128.0
                                    + np.float64(xs[ti, 3 * g + 2]))
                    dc = d * FINE
                    for i in range(R):
                        acc[i] += sg[g, i] * (dc * (np.float32(S[i]) - zc))
                else:
                    if width == 16:
                        tile_dot_i8_nibbles(planes, base, xv, xrow + g * per, S)
                    else:
                        tile_dot_i8_crumbs(planes, base, xv, xrow + g * per, S)
                    z = xs[ti, g]
                    for i in range(R):
                        acc[i] += sg[g, i] * (d * (np.float32(S[i]) - z))
            for i in range(R):
                Y[ti, j * R + i] = acc[i]


@numba.njit(**PARALLEL_ORDERED)
def block_par(X, tiles, tail, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, Y, nt, pieces):
    """``matvec_par`` for a block of tokens through :func:`tiles_block` (``pieces`` ≥ 1); the
    tokens' int8 pieces are made in parallel too (a 256-token block's took 3–9% of the product)."""
    T, k = X.shape  # pragma: no cover - compiled
    gpr = k // GROUP
    phases = GROUP // WIDTH[kind]
    xs = np.empty((T, gpr * pieces), np.float32)
    xd = np.empty((T, gpr), np.float32)
    q8 = np.empty((T, gpr, pieces, GROUP // (4 * phases), phases, 4), np.int8)
    zero = np.float32(ZERO[kind])
    per = (T + nt - 1) // nt
    for c in prange(nt):
        a = min(T, c * per)
        b = min(T, a + per)
        if b > a:
            quantize_x(X[a:b], q8[a:b], xd[a:b], xs[a:b], zero)
    xv = q8.reshape(T, gpr * pieces * GROUP).view(np.int32)
    n = tiles.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        j0 = min(n, c * step)
        j1 = min(n, j0 + step)
        tiles_block(tiles, j0, j1, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, xs, xv, xd, Y)
    _tail_rows(X, tail, kind, src, scs, cs, params, exp2tab, Y[:, 0:])  # 'A' layout, as the group products pass


@numba.njit(**SERIAL)
def _x_parts(X, kind, pieces):  # pragma: no cover - compiled
    """Regrouped x and zero-point sums for one call (``split_x``), or with ``pieces`` (1 or 3)
    x as int8 pieces (``quantize_x``; then xp is empty)."""
    T, n = X.shape
    gpr = n // GROUP
    phases = GROUP // WIDTH[kind]
    i8 = pieces > 0
    K = max(pieces, 1)
    xs = np.empty((T, gpr * K), np.float32)
    xd = np.empty((T if i8 else 0, gpr), np.float32)
    q8 = np.empty((T if i8 else 0, gpr, K, GROUP // (4 * phases), phases, 4), np.int8)
    xp = np.empty((0 if i8 else T, phases, gpr, GROUP // phases), np.float32)
    fill_x(X, xp, xs, q8, xd, np.float32(ZERO[kind]))
    return xp, xs, q8.reshape(q8.shape[0], gpr * K * GROUP).view(np.int32), xd


@numba.njit(**SERIAL)
def _tail_rows(X, tail, kind, src, scs, cs, params, exp2tab, Y):  # pragma: no cover - compiled
    """Rows past the last whole tile, decoded from the stored layout one at a time."""
    T, n = X.shape
    buf = np.empty((1, n), np.float32)
    one = np.empty(1, np.int64)
    for i in range(tail.shape[0]):
        one[0] = tail[i]
        decode_rows(one, kind, src, scs, cs, params, exp2tab, buf)
        for t in range(T):
            acc = np.float32(0)
            for k in range(n):
                acc += buf[0, k] * X[t, k]
            Y[t, tail[i]] = acc


@numba.njit(**SERIAL_ORDERED)
def matvec(X, tiles, tail, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, Y, pieces):
    """Y = X @ W.T over whole tiles and the tail rows: one call per product, no Python between."""
    xp, xs, xv, xd = _x_parts(X, kind, pieces)  # pragma: no cover - compiled
    Ya = Y[:, 0:]  # 'A' layout, as the group products pass it: one compiled tiles_run / _tail_rows
    tiles_run(tiles, np.int64(0), tiles.shape[0], kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, xp,
              xs, xv, xd, Ya)
    _tail_rows(X, tail, kind, src, scs, cs, params, exp2tab, Ya)


@numba.njit(**PARALLEL_ORDERED)
def matvec_par(X, tiles, tail, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, Y, nt, pieces):
    """``matvec`` with the tiles split across ``nt`` threads (tail rows after, on one)."""
    xp, xs, xv, xd = _x_parts(X, kind, pieces)  # pragma: no cover - compiled
    Ya = Y[:, 0:]  # 'A' layout, as in matvec
    n = tiles.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        j0 = min(n, c * step)
        j1 = min(n, j0 + step)
        tiles_run(tiles, j0, j1, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, xp, xs, xv, xd, Ya)
    _tail_rows(X, tail, kind, src, scs, cs, params, exp2tab, Ya)


@numba.njit(**SERIAL_ORDERED)
def tiles_dequant_t(t0, t1, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, out):
    """out[c, (t - t0)·R + i] = W[t·R + i, c] for tiles [t0, t1): transposed, so both the
    plane loads and the stores run contiguously across the 64 rows."""  # pragma: no cover
    gpr = planes.shape[1]
    words = planes.shape[2]
    s = np.empty(R, np.float32)
    base = np.empty(R, np.float32)
    pw = np.empty(5 * R, np.float32)
    zero = np.float32(ZERO[kind])
    for t in range(t0, t1):
        if ready[t] == 0:
            pack(t, kind, src, scs, cs, params, exp2tab, planes, sc, cw, lad, ready)
        mode = scale_mode(t, kind, lad, ready, base, pw)
        # a slice per tile: indices that LLVM can prove non-negative (no wrap-around fix-ups)
        ot = out[:, (t - t0) * R:(t - t0 + 1) * R]
        for g in range(gpr):
            group_scales(sc, cw, t * gpr + g, base, pw, s, mode)
            tg = (t * gpr + g) * words * 4 * R
            for w in range(words):
                if words == 4:
                    c0 = g * GROUP + 8 * w
                    for i in range(R):
                        wd = word_at(planes, tg + 4 * (R * w + i))
                        for h in range(8):
                            ot[c0 + h, i] = (field32(wd, 4 * h, 15) - np.float32(8)) * s[i]
                else:
                    c0 = g * GROUP + 16 * w
                    for i in range(R):
                        wd = word_at(planes, tg + 4 * (R * w + i))
                        for h in range(16):
                            ot[c0 + h, i] = (field32(wd, 2 * h, 3) - zero) * s[i]


@numba.njit(**PARALLEL_ORDERED)
def tiles_dequant_t_par(t0, t1, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs, out, nt):
    """tiles_dequant_t split across threads by tile."""  # pragma: no cover - compiled
    n = t1 - t0
    step = (n + nt - 1) // nt
    for c in prange(nt):
        a = min(t1, t0 + c * step)
        b = min(t1, a + step)
        if a < b:
            tiles_dequant_t(a, b, kind, planes, sc, cw, lad, params, exp2tab, ready, src, scs, cs,
                            out[:, (a - t0) * R:(b - t0) * R])
