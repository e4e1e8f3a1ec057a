"""1-bit and ternary dtypes: ``q1`` (12), ``q1s`` (13), ``q1t`` (14).

q1: per 32-group ``[f16 scale][4 B sign bits]``, bit k of byte j (LSB-first) is weight 8j+k,
``w = s·(2·bit - 1)``. ``diffusion=True`` is the reference's ``q1p`` (error diffusion along the
row). q1s: a q1 base (outliers excluded from the scale), then ``[u32 count]`` and
``count × [u32 flat index][f16 value]``; decode overwrites the base. q1t: per group
``[f16 scale][7 B base-3]`` (code 0 → 0, 1 → +s, 2 → -s; weight k adds code·3^(k mod 5) to byte
k // 5), then ``[u32 row_ptr rows+1]`` and ``[u16 col][f16 value]`` entries grouped by row,
added to the (zero) base.

Encoders follow REFERENCE_NOTES §1.8 and the reference's sequential f32 sums. The sign walks of
q1p/q1s are inherently sequential along a row; they loop over columns, vectorized over rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..format.constants import GROUP, Dtype
from ..format.dtypes import numel, q1s_overlay_count, q1t_row_ptr
from . import _fast, _outputs
from .base import (Buffer, Codec, as_bytes_array, as_f32, check_shape, expand_ranges, require_2d, round_half_away,
                   row_block, row_chunks, seq_sum)
from .float import f16_scale, f32_to_f16_bits

_Q1_TILE = np.dtype([("scale", "<f2"), ("bits", "u1", (4,))])
_Q1T_TILE = np.dtype([("scale", "<f2"), ("q", "u1", (7,))])
_Q1S_ENTRY = np.dtype([("index", "<u4"), ("value", "<f2")])
_Q1T_ENTRY = np.dtype([("col", "<u2"), ("value", "<f2")])

# byte -> its eight weights' signs (LSB-first) as ±1
SIGN_LUT = (2.0 * ((np.arange(256)[:, None] >> np.arange(8)) & 1) - 1).astype(np.float32)
# byte -> its five base-3 digits (least significant first) as 0, +1, -1
_DIGITS = (np.arange(256)[:, None] // (3 ** np.arange(5))) % 3
TERNARY_LUT = np.choose(_DIGITS, [0.0, 1.0, -1.0]).astype(np.float32)
_POW3 = (3 ** np.arange(5)).astype(np.uint8)

DEFAULT_Q1S_KEEP = 0.01


# ---------------------------------------------------------------------------------------------
# shared pieces


def _tiles(w: np.ndarray) -> np.ndarray:
    return w.reshape(-1, GROUP)


def _group_mean_abs(g: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    """Mean |w| per group over the non-skipped weights: f32, summed left to right."""
    a = np.abs(g)
    if skip is None:
        return seq_sum(a) / np.float32(GROUP)
    a = np.where(skip, np.float32(0), a)  # adding +0.0 leaves a sequential sum unchanged
    cnt = (~skip).sum(axis=-1)
    total = seq_sum(a)
    return np.where(cnt > 0, total / np.maximum(cnt, 1).astype(np.float32), np.float32(0)).astype(np.float32)


def _sign_walk(w: np.ndarray, scales: np.ndarray, diffusion: bool, skip: np.ndarray | None) -> np.ndarray:
    """Sign bits (rows, cols). With diffusion, the rounding residual carries along each row;
    positions in ``skip`` (outliers) take their own sign and neither use nor update the carry."""
    if not diffusion:
        return w >= 0
    rows, cols = w.shape
    wt = np.ascontiguousarray(w.T)
    st = np.ascontiguousarray(scales.T)
    sk = np.ascontiguousarray(skip.T) if skip is not None else None
    bits = np.empty((cols, rows), bool)
    carry = np.zeros(rows, np.float32)
    for j in range(cols):
        s = st[j // GROUP]
        v = wt[j] + carry
        bit = v >= 0
        new_carry = v - np.where(bit, s, -s)
        if sk is not None:
            out = sk[j]
            bit = np.where(out, wt[j] >= 0, bit)
            new_carry = np.where(out, carry, new_carry)
        bits[j] = bit
        carry = new_carry
    return bits.T


def _q1_tiles(scales: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """(G,) scales and (G, 32) bits -> q1 tile records."""
    tiles = np.empty(scales.shape[0], _Q1_TILE)
    tiles["scale"] = f32_to_f16_bits(scales).view(np.float16)
    tiles["bits"] = np.packbits(bits.reshape(-1, GROUP).astype(np.uint8), axis=1, bitorder="little")
    return tiles


def _decode_q1(tiles: np.ndarray) -> np.ndarray:
    vals = SIGN_LUT[tiles["bits"]].reshape(tiles.shape[0], GROUP)
    vals *= tiles["scale"].astype(np.float32)[:, None]
    return vals


def _decode_q1_fast(tiles: np.ndarray) -> np.ndarray:
    out = _outputs.empty((tiles.shape[0], GROUP), np.float32)
    _fast.q1_decode(tiles.view(np.uint8).reshape(-1, 6), _fast.F16_TABLE, out)
    return out


def _outlier_count(n: int, keep: float, cap: float) -> int:
    """n_out = round(n·keep) in f32 with Rust's ties-away rounding, keep clamped to [0, cap]."""
    keep = np.float32(min(max(float(keep), 0.0), cap))
    return min(round_half_away(np.float32(n) * keep), n)


def _check_rms(act_rms: Sequence[float] | None, cols: int) -> np.ndarray | None:
    if act_rms is None:
        return None
    rms = np.asarray(act_rms, np.float32).reshape(-1)
    if rms.size != cols:
        raise ValueError(f"act_rms has {rms.size} entries for {cols} input columns")
    return rms


def _top_mask(w: np.ndarray, rms: np.ndarray | None, n_out: int, colmask: bool = False) -> np.ndarray:
    """The reference's two-field outlier mask: exactly ``n_out`` largest |w|·RMS(x_col)
    (tie order unspecified), or whole columns ranked by max|W[:,j]|·RMS with ``colmask``."""
    rows, cols = w.shape
    mask = np.zeros(w.shape, bool)
    r = rms if rms is not None else np.ones(cols, np.float32)
    if colmask:
        keep_cols = min(n_out // max(rows, 1), cols)
        if 0 < keep_cols < cols:
            score = np.abs(w).max(axis=0) * r
            mask[:, np.argpartition(score, cols - keep_cols)[cols - keep_cols:]] = True
        return mask
    total = w.size
    if 0 < n_out < total:
        score = (np.abs(w) * r[None, :]).reshape(-1)
        mask.reshape(-1)[np.argpartition(score, total - n_out)[total - n_out:]] = True
    return mask


class Q1Codec(Codec):
    """``q1``: ±s per weight, ``s = f16_scale(mean |group|)``; 2-D, ``in % 32 == 0``."""

    id = Dtype.Q1

    def encode(self, array: np.ndarray, diffusion: bool = False) -> bytes:
        """Encode; ``diffusion=True`` is the ``q1p`` error-diffusion variant (same dtype)."""
        w = as_f32(array)
        rows, cols = require_2d(self.id, w.shape)
        parts = []
        for sl in row_chunks(rows, cols):
            blk = w[sl]
            s = f16_scale(_group_mean_abs(_tiles(blk)))
            bits = _sign_walk(blk, s.reshape(blk.shape[0], -1), diffusion, None)
            parts.append(_q1_tiles(s, bits).tobytes())
        return b"".join(parts)

    def _tiles_of(self, buf: Buffer, shape: tuple[int, ...]) -> np.ndarray:
        require_2d(self.id, shape)
        data = as_bytes_array(buf)
        self.validate(data, shape)
        return data.view(_Q1_TILE)

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        shape = check_shape(shape)
        return _decode_q1_fast(self._tiles_of(buf, shape)).reshape(shape)

    def decode_rows(self, buf, shape, rows):
        shape = check_shape(shape)
        tiles = self._tiles_of(buf, shape)
        _, _, rows = row_block(shape, rows)
        gpr = shape[1] // GROUP
        return _decode_q1(tiles.reshape(shape[0], gpr)[rows].reshape(-1)).reshape(rows.size, shape[1])


class Q1sCodec(Codec):
    """``q1s``: q1 base plus a sparse f16 overlay of the largest weights (1-bit PTQ)."""

    id = Dtype.Q1S

    def encode(self, array: np.ndarray, keep: float = DEFAULT_Q1S_KEEP,
               act_rms: Sequence[float] | None = None) -> bytes:
        """Encode with the ``keep`` fraction (clamped 0..0.25) of weights in the overlay.

        Without ``act_rms`` this is the converter's path: outliers are every |w| at or above
        the (n - n_out)-th smallest (ties may exceed n_out), the rest binarized with row-local
        error diffusion. With ``act_rms`` (per input column) it is ``quantize-gptq``'s path with
        the fold off: exactly n_out weights by |w|·RMS(x), plain signs.
        """
        w = as_f32(array)
        rows, cols = require_2d(self.id, w.shape)
        n = w.size
        n_out = _outlier_count(n, keep, 0.25)  # CMF_Q1S_KEEP is clamped to 0..0.25
        rms = _check_rms(act_rms, cols)
        if rms is not None:
            is_out = _top_mask(w, rms, n_out)
        elif n_out > 0:
            absw = np.abs(w).reshape(-1)
            threshold = np.partition(absw, n - n_out)[n - n_out]
            is_out = np.abs(w) >= threshold
        else:
            is_out = np.zeros(w.shape, bool)
        parts = []
        for sl in row_chunks(rows, cols):
            blk, out = w[sl], is_out[sl]
            s = f16_scale(_group_mean_abs(_tiles(blk), _tiles(out)))
            bits = _sign_walk(blk, s.reshape(blk.shape[0], -1), rms is None, out)
            parts.append(_q1_tiles(s, bits).tobytes())
        idx = np.flatnonzero(is_out)
        entries = np.empty(idx.size, _Q1S_ENTRY)
        entries["index"] = idx
        entries["value"] = f32_to_f16_bits(w.reshape(-1)[idx]).view(np.float16)
        parts.append(np.array([idx.size], "<u4").tobytes())
        parts.append(entries.tobytes())
        return b"".join(parts)

    def _parts(self, buf: Buffer, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        require_2d(self.id, shape)
        data = as_bytes_array(buf)
        count = q1s_overlay_count(data, shape)
        base = 6 * (numel(shape) // GROUP)
        return data[:base].view(_Q1_TILE), data[base + 4:base + 4 + 6 * count].view(_Q1S_ENTRY)

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        shape = check_shape(shape)
        tiles, entries = self._parts(buf, shape)
        out = _decode_q1_fast(tiles).reshape(-1)
        out[entries["index"].astype(np.int64)] = entries["value"].astype(np.float32)
        return out.reshape(shape)

    def decode_rows(self, buf, shape, rows):
        shape = check_shape(shape)
        tiles, entries = self._parts(buf, shape)
        _, cols, rows = row_block(shape, rows)
        gpr = cols // GROUP
        out = _decode_q1(tiles.reshape(shape[0], gpr)[rows].reshape(-1)).reshape(rows.size, cols)
        idx = entries["index"].astype(np.int64)
        order = np.argsort(rows, kind="stable")
        srt = rows[order]
        er = idx // max(cols, 1)
        first = np.searchsorted(srt, er, "left")
        cnt = np.searchsorted(srt, er, "right") - first
        entry, pos = expand_ranges(first, cnt)
        out[order[pos], idx[entry] % max(cols, 1)] = entries["value"][entry].astype(np.float32)
        return out


class Q1tCodec(Codec):
    """``q1t``: ternary {-s, 0, +s} base-3 tiles plus a per-row f16 outlier overlay."""

    id = Dtype.Q1T

    def encode(self, array: np.ndarray, keep: float = 0.0, act_rms: Sequence[float] | None = None,
               correct: bool = True, colmask: bool = False) -> bytes:
        """Encode (``gptq.rs::quantize_q1t``): ``keep`` = overlay fraction (plain convert uses 0),
        ``act_rms`` = per-column activation RMS from calibration (default all 1), ``correct`` =
        per-row scale correction (``CMF_GPTQ_NOCORRECT=1`` turns it off), ``colmask`` = keep whole
        input columns (``CMF_GPTQ_COLMASK=1``)."""
        w = as_f32(array)
        rows, cols = require_2d(self.id, w.shape)
        rms = _check_rms(act_rms, cols)
        is_out = _top_mask(w, rms, _outlier_count(w.size, keep, 1.0), colmask)
        d = (rms.astype(np.float64) ** 2 if rms is not None else np.ones(cols)).reshape(-1, GROUP)
        tiles = np.empty(w.size // GROUP, _Q1T_TILE)
        gpr = cols // GROUP
        for sl in row_chunks(rows, cols):
            scale, codes = _q1t_groups(w[sl].reshape(-1, gpr, GROUP), is_out[sl].reshape(-1, gpr, GROUP), d, correct)
            dst = tiles[sl.start * gpr:sl.stop * gpr]
            dst["scale"] = f32_to_f16_bits(scale.reshape(-1)).view(np.float16)  # no floor after correction
            padded = np.zeros((codes.shape[0] * gpr, 35), np.uint8)
            padded[:, :GROUP] = codes.reshape(-1, GROUP)
            dst["q"] = (padded.reshape(-1, 7, 5) * _POW3).sum(axis=2, dtype=np.uint8)
        idx = np.flatnonzero(is_out)
        counts = np.bincount(idx // max(cols, 1), minlength=rows)
        row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype("<u4")
        entries = np.empty(idx.size, _Q1T_ENTRY)
        entries["col"] = idx % max(cols, 1)
        entries["value"] = f32_to_f16_bits(w.reshape(-1)[idx]).view(np.float16)
        return tiles.tobytes() + row_ptr.tobytes() + entries.tobytes()

    def _parts(self, buf: Buffer, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        require_2d(self.id, shape)
        data = as_bytes_array(buf)
        row_ptr = q1t_row_ptr(data, shape)
        base = 9 * (numel(shape) // GROUP)
        ent_off = base + 4 * (shape[0] + 1)
        return data[:base].view(_Q1T_TILE), row_ptr, data[ent_off:].view(_Q1T_ENTRY)

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        shape = check_shape(shape)
        tiles, row_ptr, entries = self._parts(buf, shape)
        out = _outputs.empty((tiles.shape[0], GROUP), np.float32)
        _fast.q1t_decode(tiles.view(np.uint8).reshape(-1, 9), _fast.F16_TABLE, TERNARY_LUT, out)
        out = out.reshape(shape)
        er = np.repeat(np.arange(shape[0]), np.diff(row_ptr))
        np.add.at(out, (er, entries["col"].astype(np.int64)), entries["value"].astype(np.float32))
        return out

    def decode_rows(self, buf, shape, rows):
        shape = check_shape(shape)
        tiles, row_ptr, entries = self._parts(buf, shape)
        _, cols, rows = row_block(shape, rows)
        gpr = cols // GROUP
        out = _decode_q1t(tiles.reshape(shape[0], gpr)[rows].reshape(-1)).reshape(rows.size, cols)
        owner, pos = expand_ranges(row_ptr[rows], row_ptr[rows + 1] - row_ptr[rows])
        e = entries[pos]
        np.add.at(out, (owner, e["col"].astype(np.int64)), e["value"].astype(np.float32))
        return out


def _decode_q1t(tiles: np.ndarray) -> np.ndarray:
    vals = TERNARY_LUT[tiles["q"]].reshape(tiles.shape[0], 35)[:, :GROUP]
    return vals * tiles["scale"].astype(np.float32)[:, None]


def _q1t_groups(w: np.ndarray, out: np.ndarray, d: np.ndarray, correct: bool) -> tuple[np.ndarray, np.ndarray]:
    """Scales (rows, gpr) f32 and codes (rows, gpr, 32) for a block of rows.

    Per group, two candidates (``q1t_group_candidate``): legacy = f16_scale(mean |w|) with
    support |w| >= 0.5·s; adaptive = support |w| >= 0.7·mean with the d-weighted least-squares
    level. The adaptive one wins only with a strictly smaller d-weighted error. Outliers get
    code 0 (the overlay adds their value onto an empty base).
    """
    keep = ~out
    mean = _group_mean_abs(w, out)
    legacy = f16_scale(mean)
    thr = np.float32(0.7) * mean
    aw = np.abs(w)
    dd = d[None, :, :]  # (1, gpr, 32): d per column within its group
    w64 = w.astype(np.float64)
    half = np.float32(0.5) * legacy
    q_leg = np.where(w >= half[..., None], legacy[..., None],
                     np.where(w <= -half[..., None], -legacy[..., None], np.float32(0))).astype(np.float64)
    legacy_err = np.where(keep, dd * (w64 - q_leg) ** 2, 0.0).sum(axis=-1)
    sup = keep & (aw >= thr[..., None])
    num = np.where(sup, dd * aw.astype(np.float64), 0.0).sum(axis=-1)
    den = np.where(sup, dd, 0.0).sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (num / np.where(den > 0, den, 1.0)).astype(np.float32)
    adaptive = np.where(den > 0, f16_scale(ratio), legacy).astype(np.float32)
    q_ad = np.where(aw >= thr[..., None], np.copysign(adaptive[..., None], w), np.float32(0)).astype(np.float64)
    adaptive_err = np.where(keep, dd * (w64 - q_ad) ** 2, 0.0).sum(axis=-1)
    use_ad = adaptive_err < legacy_err
    scale = np.where(use_ad, adaptive, legacy).astype(np.float32)
    nonzero = keep & np.where(use_ad[..., None], aw >= thr[..., None], aw >= half[..., None])
    codes = np.where(nonzero, np.where(w >= 0, 1, 2), 0).astype(np.uint8)
    if correct:
        q = np.where(codes == 1, scale[..., None], np.where(codes == 2, -scale[..., None], np.float32(0)))
        q = q.astype(np.float64)
        num = (q * w64 * dd).sum(axis=(1, 2))
        den = (q * q * dd).sum(axis=(1, 2))
        ok = den > 1e-20
        alpha = np.clip(num / np.where(ok, den, 1.0), 0.5, 2.0).astype(np.float32)
        scale = np.where(ok[:, None], scale * alpha[:, None], scale).astype(np.float32)
    return scale, codes

