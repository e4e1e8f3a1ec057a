"""The ladder's group scales for the 4-bit tile kernels (``q4.py``): packing a tile and marking it
ready, each row's powers, and which form a packed tile's scales take.

A q4tp/q2tp scale is its row's base 2^lo times the powers ratio^(2^p) whose bit p is set in the
group's 5-bit code, multiplied in plane order (``_jit.group_scales``). Three forms give the same
bits: merge-masked multiplies (AVX-512), the plane-mask table's multiply or fma form (targets
without mask registers, ``_jit._rungs_by_table``), and the scales decoded once when the tile is
packed and kept as float32 (:data:`DECODED_SCALES`).
"""

from __future__ import annotations

import logging
import os

import numba
import numpy as np

from ._jit import DECODED, FMA_SCALES, MASK_REGS, SERIAL_ORDERED, group_scales
from .q4_stored import CODE_BYTES, F16_SCALES, R, pack_tile

log = logging.getLogger(__name__)


def _decoded_scales() -> bool:
    """``CMF_LADDER_SCALES`` (``decoded`` or ``ladder``) when set, else decoded exactly where the
    target has no mask registers."""
    forced = os.environ.get("CMF_LADDER_SCALES", "").strip().lower()
    if forced in ("decoded", "ladder"):
        return forced == "decoded"
    if forced:
        log.warning("CMF_LADDER_SCALES=%s is not 'decoded' or 'ladder'; choosing automatically", forced)
    return not MASK_REGS


# Whether q4tp/q2tp tiles keep their group scales decoded (float32, 256 bytes a tile-group of 1 KB
# of nibbles, where the codes' bit planes took 40) from the time they are packed, instead of
# rebuilding them from the 5-bit ladder codes in every product. With AVX-512's mask registers the
# rebuild is five merge-masked multiplies per 16 rows and costs less than the extra bytes; without
# them (AVX2, AVX-VNNI, NEON) it is ~30 vector operations per 8 rows on the ports the integer dot
# needs, and the decoded scales make a tile-group from L2 1.24x and all of a model's products from
# DRAM 1.11-1.14x faster with their own prefetch (docs/PERFORMANCE.md, "The ladder's scales
# decoded once"); natively they are level from DRAM. The values are group_scales' own (the same
# bits as either form), so results do not change.
DECODED_SCALES = _decoded_scales()


@numba.njit(**SERIAL_ORDERED)
def powers(t, lad, t0, pw):  # pragma: no cover - compiled
    """Per row of tile t (its packed ladder base ``lad[t]``): t0 = 2^lo and pw[p] = ratio^(2^p),
    the ratio multiplied in one factor at a time like the codec's ladder, so rung
    c = t0·Π pw[p]^bit_p(c) is within a few ulps of the ladder's iterated product.

    The chain of 15 dependent multiplies runs across the 64 rows at once (straight-line code
    over a row index, which LLVM vectorizes; no reassociation, so the same products in the same
    order): one row at a time it cost ~60 cycles a row, 1.3 µs a tile — as much as the tile's
    whole product for a 1024-wide matrix."""
    for i in range(R):
        t0[i] = lad[t, 0, i]
        r = lad[t, 1, i]
        pw[i] = r
        v = r * r
        pw[R + i] = v  # r^2
        v = v * r
        v = v * r
        pw[2 * R + i] = v  # r^4
        for _ in range(4):
            v = v * r
        pw[3 * R + i] = v  # r^8
        for _ in range(8):
            v = v * r
        pw[4 * R + i] = v  # r^16


# group_scales' mode per kind: f16 bits, the ladder, the ladder with code 31 as a dead group
SCALE_MODE = (0, 1, 2, 0)
# ``ready[t]``: 0 not packed yet, 1 packed, 2 packed and its ladder takes group_scales' fma form,
# 3 packed with its ladder's scales decoded (DECODED_SCALES)
PACKED, PACKED_FMA, PACKED_DECODED = 1, 2, 3


@numba.njit(**SERIAL_ORDERED)
def increments_exact(t, lad):  # pragma: no cover - compiled
    """Whether tile t's ladder allows group_scales' fma form (targets without mask registers):
    every power P has d = P − 1 exact in float32 (so v + v·d is v·P before rounding), and no
    partial product can overflow (an infinite v would turn the fma form's v + v·0 into NaN where
    v·1.0 stays infinite). True for every ladder a codec writes (P ≥ 1, well inside range); a
    crafted file's extreme or NaN ladder keeps the multiply form, with the same bits."""
    t0 = np.empty(R, np.float32)
    pw = np.empty(5 * R, np.float32)
    powers(t, lad, t0, pw)
    for i in range(R):
        top = abs(np.float64(t0[i]))
        for p in range(5):
            power = pw[p * R + i]
            if np.float64(power) - 1.0 != np.float64(power - np.float32(1)):
                return False
            top *= max(1.0, abs(np.float64(power)))
        if not top < 1e38:  # NaN too
            return False
    return True


@numba.njit(**SERIAL_ORDERED)
def pack(t, kind, src, scs, cs, params, exp2tab, planes, sc, cw, lad, ready):  # pragma: no cover - compiled
    """pack_tile, then tile t's ready mark: PACKED, PACKED_FMA where the fma form applies, or
    PACKED_DECODED once a ladder's scales are decoded into ``sc`` (sized for them by
    ``TiledLinear`` where :data:`DECODED_SCALES`). Decoded tiles need their codes only here, so
    they go to a scratch of one tile and ``cw`` can be empty."""
    gpr = planes.shape[1]
    ladder = not F16_SCALES[kind]
    decoded = ladder and sc.shape[2] == 2 * R
    if ladder and not decoded and cw.size < (t + 1) * gpr * CODE_BYTES:
        raise ValueError("ladder codes array too small for the tile")  # never written out of bounds
    codes = np.empty(gpr * CODE_BYTES if decoded else 0, np.uint8)
    pack_tile(t, kind, src, scs, cs, params, exp2tab, planes, sc, codes if decoded else cw, 0 if decoded else t * gpr,
              lad)
    if decoded:
        decode_scales(t, kind, sc, codes, lad)
        ready[t] = PACKED_DECODED
    else:
        ready[t] = PACKED_FMA if FMA_SCALES and ladder and increments_exact(t, lad) else PACKED


@numba.njit(**SERIAL_ORDERED)
def decode_scales(t, kind, sc, codes, lad):  # pragma: no cover - compiled
    """Tile t's ladder scales from its bit-plane ``codes`` (one tile's, group g at 40·g), built by
    group_scales straight into ``sc[t, g]`` as float32 bits (two uint16 a row) for its mode
    DECODED. Once per tile, so the plain multiply form: the fma form gives the same bits and
    would need ``increments_exact``'s second pass over the powers."""
    t0 = np.empty(R, np.float32)
    pw = np.empty(5 * R, np.float32)
    mode = ladder_mode(t, kind, lad, False, t0, pw)
    for g in range(sc.shape[1]):
        group_scales(sc, codes, g, t0, pw, sc[t, g].view(np.float32), mode)  # (sc not read in a ladder mode)


@numba.njit(**SERIAL_ORDERED)
def ladder_mode(t, kind, lad, fma, t0, pw):  # pragma: no cover - compiled
    """group_scales' mode for a ladder (or f16) tile t with ``t0``/``pw`` filled for a ladder
    kind: the powers themselves, or with ``fma`` the increments power − 1 (modes 3 and 4)."""
    mode = SCALE_MODE[kind]
    if F16_SCALES[kind]:
        return mode
    powers(t, lad, t0, pw)
    if not fma:
        return mode
    for k in range(5 * R):
        pw[k] = pw[k] - np.float32(1)
    return mode + 2


@numba.njit(**SERIAL_ORDERED)
def scale_mode(t, kind, lad, ready, t0, pw):  # pragma: no cover - compiled
    """group_scales' mode for packed tile t: DECODED for a tile whose scales are kept decoded
    (nothing to prepare), else :func:`ladder_mode`'s."""
    if ready[t] == PACKED_DECODED:
        return DECODED
    return ladder_mode(t, kind, lad, ready[t] == PACKED_FMA, t0, pw)
