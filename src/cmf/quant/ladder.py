"""Scale-ladder dtypes: ``q4tp`` (15) and ``q2tp`` (16).

Each row stores ``(f16 lo, f16 step)``; a tile's scale is rung ``code`` of the row's geometric
ladder ``t[c] = t[c-1]·exp2(step)``, ``t[0] = exp2(lo)`` (iterated f32 multiplies: the
normative decode form, REFERENCE_NOTES §1.8). Codes are 5 bits per group, LSB-first, one
byte-aligned block of ``ceil(5·gpr/8)`` bytes per row.

q4tp: ``[nibbles rows·gpr·16][params rows·4][codes]``; nibbles as q4_tiled.
q2tp: ``[2-bit plane rows·gpr·8][params][codes]``; weight 4k+j in bits 2j..2j+1 of byte k,
``w = (c2 - 1.5)·s``; rung 0 is an exact zero and rung c >= 1 is the q4tp ladder's c-1.

Two encoders write these bytes. ``encoder="reference"`` follows REFERENCE_NOTES §1.8 step by
step, vectorized over rows and groups; its ``search`` option (default on) is the reference's
``CMF_Q2TP_SEARCH`` switch. The default ``encoder="mse"`` builds each row's ladder from the
groups' error-minimising scales and picks the rung per group that minimises the group's weighted
squared error (``cmf.quant.mse``); lo/step are rounded to f16 before any code is chosen and the
levels are quantized against the reconstructed rung, as the spec requires.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..format.constants import GROUP, Dtype
from . import _fast, _outputs, mse
from .base import Buffer, Codec, as_bytes_array, as_f32, check_shape, require_2d, row_block, row_chunks, seq_sum
from .float import exp2_f16, f16_bits_to_f32, f16_scale_bits, f32_to_f16_bits, log2_f16
from .q4 import NIBBLE_LUT, pack_nibbles

Q4TP_LMAX = 31
Q2TP_LMAX = 30
_WALK = 64  # at most this many one-ULP increments of the f16 step (reference cap)
_TOP_FRACS = (1.0, 0.9, 0.8, 0.7)  # q2tp ladder-top candidates, in the reference's order
_MSE_TOP_FRACS = (1.0, 0.9, 0.8)  # q2tp ladder tops the mse encoder tries (scored by row error)
# mse rung window: rungs within this factor of a group's best scale are scored (a q4tp ladder's
# rungs are ~3% apart, so the window holds the optimum with room; q2tp's error curve is wider)
_Q4TP_WINDOW = 1.2
_Q2TP_WINDOW = 1.3

# byte -> its four 2-bit weights minus 1.5
CRUMB_LUT = (((np.arange(256)[:, None] >> (2 * np.arange(4))) & 3) - 1.5).astype(np.float32)


def code_bytes(gpr: int) -> int:
    """Bytes of one row's 5-bit code block."""
    return (5 * gpr + 7) // 8


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """(rows, gpr) codes 0..31 -> (rows, ceil(5·gpr/8)) bytes, LSB-first bit stream per row."""
    rows, gpr = codes.shape
    bits = ((codes.astype(np.uint8)[..., None] >> np.arange(5, dtype=np.uint8)) & 1).reshape(rows, 5 * gpr)
    return np.packbits(bits, axis=1, bitorder="little").reshape(rows, code_bytes(gpr))


def unpack_codes(cbytes: np.ndarray, gpr: int) -> np.ndarray:
    """(rows, ceil(5·gpr/8)) code bytes -> (rows, gpr) codes (int64)."""
    rows = cbytes.shape[0]
    padded = np.zeros((rows, cbytes.shape[1] + 1), np.uint16)
    padded[:, :-1] = cbytes
    bit = 5 * np.arange(gpr)
    byte = bit >> 3
    word = padded[:, byte] | (padded[:, byte + 1] << np.uint16(8))
    return ((word >> (bit & 7).astype(np.uint16)) & np.uint16(31)).astype(np.int64)


def q4tp_ladder(lo_h: np.ndarray, step_h: np.ndarray) -> np.ndarray:
    """Per-row ladders (rows, 32) from the f16 bit patterns of ``lo`` and ``step``.

    ``t[0] = exp2(lo)``, ``t[c] = t[c-1]·exp2(step)`` in f32, with exp2 as the C library's
    exp2f (see ``cmf.quant.float.exp2_f16``).
    """
    t0 = exp2_f16(np.asarray(lo_h, np.uint16).reshape(-1))
    ratio = exp2_f16(np.asarray(step_h, np.uint16).reshape(-1))
    t = np.empty((t0.size, 32), np.float32)
    t[:, 0] = t0
    with np.errstate(over="ignore", invalid="ignore"):  # crafted params may overflow: inf/NaN, no crash
        for c in range(1, 32):
            t[:, c] = t[:, c - 1] * ratio
    return t


def q2tp_ladder(lo_h: np.ndarray, step_h: np.ndarray) -> np.ndarray:
    """q2tp rungs (rows, 32): rung 0 = 0, rung c = q4tp rung c-1."""
    t = q4tp_ladder(lo_h, step_h)
    return np.concatenate([np.zeros((t.shape[0], 1), np.float32), t[:, :31]], axis=1)


def params_bits(params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, 2) u16 params -> (lo bits, step bits)."""
    return params[:, 0], params[:, 1]


# ---------------------------------------------------------------------------------------------
# encoder pieces (REFERENCE_NOTES §1.8, q4tp steps 1-7; q2tp extras)


def _lo_hi(lg: np.ndarray, dead: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    live = ~dead
    lo = np.where(live, lg, np.inf).min(axis=1, initial=np.inf).astype(np.float32)
    hi = np.where(live, lg, -np.inf).max(axis=1, initial=-np.inf).astype(np.float32)
    none = ~live.any(axis=1)
    if none.any():  # no live group: the ladder sits on the first group's (floored) scale
        first = lg[:, 0] if lg.shape[1] else np.zeros(lg.shape[0], np.float32)
        lo[none] = first[none]
        hi[none] = first[none]
    return lo, hi


def _walk_step(lo_r: np.ndarray, top: np.ndarray, lmax: int) -> np.ndarray:
    """f16 step bits: RNE of span/lmax, then ULP increments until rung lmax covers ``top``."""
    span = np.maximum(top - lo_r, np.float32(0))
    st_h = f32_to_f16_bits(span / np.float32(lmax)).astype(np.uint16)
    for _ in range(_WALK):
        st = f16_bits_to_f32(st_h)
        done = (st > 0) & (lo_r + np.float32(lmax) * st >= top)
        if done.all():
            break
        st_h = np.where(done, st_h, st_h + np.uint16(1)).astype(np.uint16)
    return st_h


def _nominal(lg: np.ndarray, lo_r: np.ndarray, st: np.ndarray, lmax: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.rint((lg - lo_r[:, None]) / st[:, None])
    c = np.clip(np.where(st[:, None] > 0, c, 0), 0, lmax)
    return c.astype(np.int64)


def _recip(s: np.ndarray) -> np.ndarray:
    safe = np.where(s > 0, s, np.float32(1))
    return np.where(s > 0, np.float32(1) / safe, np.float32(0)).astype(np.float32)


def _err4(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Per-group squared error of 4-bit rounding against scale ``s`` (reciprocal form)."""
    q = np.clip(np.rint(w * _recip(s)[..., None]), -8, 7)
    e = w - q * s[..., None]
    return seq_sum(e * e)


def _q2(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(w * _recip(s)[..., None] + np.float32(1.5)), 0, 3)


def _err2(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    e = w - (_q2(w, s) - np.float32(1.5)) * s[..., None]
    return seq_sum(e * e)


def _first_min(errs: list[np.ndarray], valid: list[np.ndarray], cands: list[np.ndarray]) -> np.ndarray:
    """Candidate with the first strictly smallest error (candidates in increasing order)."""
    best = np.full(errs[0].shape, np.inf, np.float32)
    pick = np.zeros(errs[0].shape, np.int64)
    for e, v, c in zip(errs, valid, cands):
        better = v & (e < best)
        best = np.where(better, e, best)
        pick = np.where(better, c, pick)
    return pick


def _take(t: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return np.take_along_axis(t, np.clip(codes, 0, 31), axis=1)


def _row_stats(w: np.ndarray, divisor: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps 1-3 common to both dtypes: lg, dead, lo bits, lo_r and hi per row."""
    absmax = np.abs(w).max(axis=2, initial=np.float32(0))
    dead = absmax == 0
    lg = log2_f16(f16_scale_bits(absmax / np.float32(divisor)))
    lo, hi = _lo_hi(lg, dead)
    lo_h = f32_to_f16_bits(lo).astype(np.uint16)
    return lg, dead, lo_h, f16_bits_to_f32(lo_h), hi


def encode_q4tp_rows(w: np.ndarray, search: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, gpr, 32) f32 -> (nibbles (rows, gpr, 16), params (rows, 2) u16, codes (rows, gpr))."""
    lg, dead, lo_h, lo_r, hi = _row_stats(w, 7)
    st_h = _walk_step(lo_r, hi, Q4TP_LMAX)
    st = f16_bits_to_f32(st_h)
    t = q4tp_ladder(lo_h, st_h)
    codes = np.where(dead, 0, _nominal(lg, lo_r, st, Q4TP_LMAX))
    if search:
        cands = [codes + d for d in (-2, -1, 0, 1)]
        valid = [(c >= 0) & (c <= Q4TP_LMAX) for c in cands]
        errs = [_err4(w, _take(t, c)) for c in cands]
        codes = np.where(dead, 0, _first_min(errs, valid, cands))
    s = _take(t, codes)
    q = np.clip(np.rint(w * _recip(s)[..., None]), -8, 7) + 8
    q[dead] = 8  # dead groups: 0x88 bytes
    return pack_nibbles(q), np.stack([lo_h, st_h], axis=1), codes


def encode_q2tp_rows(w: np.ndarray, search: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, gpr, 32) f32 -> (2-bit plane (rows, gpr, 8), params (rows, 2) u16, codes (rows, gpr))."""
    lg, dead, lo_h, lo_r, hi = _row_stats(w, 1.5)
    live = ~dead

    def ladder_for(top: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        st_h = _walk_step(lo_r, top, Q2TP_LMAX)
        st = f16_bits_to_f32(st_h)
        nom = 1 + _nominal(lg, lo_r, st, Q2TP_LMAX)  # st <= 0 gives rung 1
        return st_h, st, q2tp_ladder(lo_h, st_h), nom

    if not search:
        st_h, _, t, codes = ladder_for(hi)
    else:
        # (a) ladder-top search: score each top by the live groups' best error over rungs
        # nominal-2..nominal+2 (within 1..31); keep the first strictly smallest score.
        best_score = np.full(w.shape[0], np.inf, np.float32)
        st_h = np.zeros(w.shape[0], np.uint16)
        nom = np.zeros(lg.shape, np.int64)
        errs_kept: list[np.ndarray] = []
        for frac in _TOP_FRACS:
            top = lo_r + np.float32(frac) * (hi - lo_r)
            f_st_h, _, f_t, f_nom = ladder_for(top)
            cands = [f_nom + d for d in (-2, -1, 0, 1, 2)]
            valid = [(c >= 1) & (c <= 31) for c in cands]
            errs = [np.where(v, _err2(w, _take(f_t, c)), np.inf).astype(np.float32) for c, v in zip(cands, valid)]
            best = np.minimum.reduce(errs)
            score = seq_sum(np.where(live, best, np.float32(0)).astype(np.float32))
            better = score < best_score
            best_score = np.where(better, score, best_score)
            st_h = np.where(better, f_st_h, st_h)
            nom = np.where(better[:, None], f_nom, nom)
            errs_kept = errs if not errs_kept else [np.where(better[:, None], e, k)
                                                    for e, k in zip(errs, errs_kept)]
        t = q2tp_ladder(lo_h, st_h)
        # (b) per-group rung: candidates max(nom-2, 1)..min(nom+1, 31), errors from (a).
        cands = [nom + d for d in (-2, -1, 0, 1)]
        valid = [(c >= 1) & (c <= 31) for c in cands]
        codes = _first_min(errs_kept[:4], valid, cands)
    codes = np.where(dead, 0, codes)
    q = _q2(w, _take(t, codes))
    q[dead] = 2  # dead groups: 0xAA bytes, decode to exact 0
    q = q.astype(np.uint8).reshape(w.shape[0], w.shape[1], 8, 4)
    plane = q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)
    return plane.astype(np.uint8), np.stack([lo_h, st_h], axis=1), codes


def _mse_ladder(ideal: np.ndarray, lmax: int, top_frac: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(lo bits, step bits) of the rows' ladders over the groups' best scales (steps 2-3 of §1.8)."""
    dead = ideal == 0
    lg = log2_f16(f16_scale_bits(ideal))
    lo, hi = _lo_hi(lg, dead)
    lo_h = f32_to_f16_bits(lo).astype(np.uint16)
    lo_r = f16_bits_to_f32(lo_h)
    top = lo_r + np.float32(top_frac) * (hi - lo_r) if top_frac != 1.0 else hi
    return lo_h, _walk_step(lo_r, top.astype(np.float32), lmax)


def encode_q4tp_rows_mse(w: np.ndarray, wt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mse encoder of q4tp: (rows, gpr, 32) f32 and (gpr, 32) weights -> as ``encode_q4tp_rows``."""
    ideal = mse.ideal_scales(w, wt, two_bit=False)
    lo_h, st_h = _mse_ladder(ideal, Q4TP_LMAX)
    codes, q, _ = mse.best_rungs(w, wt, q4tp_ladder(lo_h, st_h), ideal, False, _Q4TP_WINDOW)
    return pack_nibbles(q), np.stack([lo_h, st_h], axis=1), codes


def encode_q2tp_rows_mse(w: np.ndarray, wt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mse encoder of q2tp: per row, the ladder top (of ``_MSE_TOP_FRACS``) with the least error."""
    ideal = mse.ideal_scales(w, wt, two_bit=True)
    best = None
    for frac in _MSE_TOP_FRACS:
        lo_h, st_h = _mse_ladder(ideal, Q2TP_LMAX, frac)
        codes, q, err = mse.best_rungs(w, wt, q2tp_ladder(lo_h, st_h), ideal, True, _Q2TP_WINDOW)
        if best is None:
            best = [err, st_h, codes, q]
            continue
        win = err < best[0]
        best = [np.where(win, err, best[0]), np.where(win, st_h, best[1]),
                np.where(win[:, None], codes, best[2]), np.where(win[:, None, None], q, best[3])]
    _, st_h, codes, q = best
    q = q.reshape(w.shape[0], w.shape[1], 8, 4)
    plane = q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)
    return plane.astype(np.uint8), np.stack([lo_h, st_h.astype(np.uint16)], axis=1), codes


class _LadderCodec(Codec):
    plane: int  # weight-plane bytes per group

    def _encode_rows(self, w: np.ndarray, enc: str, search: bool, wt: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError

    def encode(self, array: np.ndarray, search: bool | None = None, encoder: str | None = None,
               importance: np.ndarray | None = None) -> bytes:
        """Encode a 2-D matrix (``in % 32 == 0``).

        ``encoder``: ``"mse"`` (default) or ``"reference"``; ``search=False`` (reference only) is
        ``CMF_Q2TP_SEARCH=0``; ``importance`` (mse only): per input feature error weights.
        """
        w = as_f32(array)
        rows, cols = require_2d(self.id, w.shape)
        enc, imp = mse.options(encoder, importance, cols, search)
        gpr = cols // GROUP
        wt = mse.group_weights(imp, cols)
        wt = np.ascontiguousarray(np.broadcast_to(wt, (gpr, GROUP)))
        planes = np.empty((rows, gpr, self.plane), np.uint8)
        params = np.empty((rows, 2), np.uint16)
        codes = np.empty((rows, code_bytes(gpr)), np.uint8)
        for sl in row_chunks(rows, cols):
            blk = w[sl].reshape(-1, gpr, GROUP)
            planes[sl], params[sl], c = self._encode_rows(blk, enc, True if search is None else search, wt)
            codes[sl] = pack_codes(c)
        return planes.tobytes() + params.astype("<u2").tobytes() + codes.tobytes()

    def split(self, buf: Buffer, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validated planes: weights (rows, gpr, plane), params (rows, 2) u16, code bytes (rows, cb)."""
        shape = check_shape(shape)
        rows, cols = require_2d(self.id, shape)
        data = as_bytes_array(buf)
        self.validate(data, shape)
        gpr = cols // GROUP
        a = rows * gpr * self.plane
        planes = data[:a].reshape(rows, gpr, self.plane)
        params = data[a:a + 4 * rows].view("<u2").reshape(rows, 2)
        codes = data[a + 4 * rows:].reshape(rows, code_bytes(gpr))
        return planes, params, codes

    def scales(self, params: np.ndarray, codes: np.ndarray, gpr: int) -> np.ndarray:
        """Per-group scales (rows, gpr) from params and code bytes."""
        raise NotImplementedError

    def _values(self, planes: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _decode(self, planes: np.ndarray, params: np.ndarray, codes: np.ndarray) -> np.ndarray:
        rows, gpr = planes.shape[:2]
        vals = self._values(planes).reshape(rows, gpr, GROUP)
        vals *= self.scales(params, codes, gpr)[..., None]
        return vals.reshape(rows, gpr * GROUP)

    def ladder(self, params: np.ndarray) -> np.ndarray:
        """Per-row rung tables (rows, 32)."""
        raise NotImplementedError

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        planes, params, codes = self.split(buf, shape)
        out = _outputs.empty((planes.shape[0], planes.shape[1] * GROUP), np.float32)
        _fast.ladder_decode(planes, codes, self.ladder(params), self._table, out)
        return out

    def decode_rows(self, buf, shape, rows):
        planes, params, codes = self.split(buf, shape)
        _, _, rows = row_block(check_shape(shape), rows)
        return self._decode(planes[rows], params[rows], codes[rows])


class Q4tpCodec(_LadderCodec):
    """``q4tp``: q4_tiled nibbles, per-tile scale = 5-bit rung of a per-row ladder."""

    id = Dtype.Q4TP
    plane = 16

    def _encode_rows(self, w, enc, search, wt):
        return encode_q4tp_rows(w, search) if enc == "reference" else encode_q4tp_rows_mse(w, wt)

    _table = NIBBLE_LUT

    def ladder(self, params):
        return q4tp_ladder(*params_bits(params))

    def scales(self, params, codes, gpr):
        return np.take_along_axis(self.ladder(params), unpack_codes(codes, gpr), axis=1)

    def _values(self, planes):
        return NIBBLE_LUT[planes]


class Q2tpCodec(_LadderCodec):
    """``q2tp``: the q4tp ladder with a 2-bit weight plane; rung 0 means an all-zero group."""

    id = Dtype.Q2TP
    plane = 8

    def _encode_rows(self, w, enc, search, wt):
        return encode_q2tp_rows(w, search) if enc == "reference" else encode_q2tp_rows_mse(w, wt)

    _table = CRUMB_LUT

    def ladder(self, params):
        return q2tp_ladder(*params_bits(params))

    def scales(self, params, codes, gpr):
        return np.take_along_axis(self.ladder(params), unpack_codes(codes, gpr), axis=1)

    def _values(self, planes):
        return CRUMB_LUT[planes]
