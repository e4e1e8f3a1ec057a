"""Variable-bit dtypes: ``vbit`` (8) and ``vbit_ro`` (10).

Layout: ``[u8 width per row][f16 scale per (row, 32-group)]`` (``vbit_ro``: then
``[u32 offsets rows+1]``) then the packed rows, each row's codes ``b`` bits MSB-first in one bit
stream padded to a byte. ``w = (u - L)·s`` with ``L = 2^(b-1) - 1``, b in {3, 4, 5, 6, 8}.

Because ``in % 32 == 0``, every row is exactly ``in·b/8`` bytes and every 8 codes fill ``b``
whole bytes, so packing and unpacking work on 8-code chunks as one big-endian integer.

Width allocation is the reference's water-filling (REFERENCE_NOTES §1.8): bits = mean_bits +
(log2 row amplitude - its mean) + bias, snapped to the nearest level with ties to the lower one.
MoE families share one budget through ``family_biases`` (the Python writer's joint budget).

Scales: the ``reference`` encoder takes ``absmax/L`` per group; the ``mse`` encoder (the default,
as for the 4-bit family) picks per group the scale that minimises the weighted squared error among
a grid around it and each grid point's least-squares refit, with the error weights of
:mod:`.mse` (``importance`` per input feature × (0.5·rms(group) + |w|)); in rows of at most
:data:`SIGNED_WIDTH` bits the scale may be negative, giving the extra level of ``-L .. L+1`` to
the side of the group's largest weight. Widths are the same for both. Figures: docs/QUANT.md.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..format.constants import GROUP, VBIT_WIDTHS, Dtype
from ..format.dtypes import vbit_layout
from ..format.errors import BoundsError
from . import _fast, _outputs, mse
from .base import (Buffer, Codec, as_bytes_array, as_f32, check_shape, f16_at, get_codec, require_2d, resolve_dtype,
                   row_block, row_chunks, seq_sum)
from .float import f16_scale, f32_to_f16_bits

DEFAULT_MEAN_BITS = 4.25  # the mean row width when none is given (the converter's --mean-bits default too)
_BISECT_STEPS = 40
_BIAS_CLIP = 2.5
# mse scale grid: s = absmax / (L + d) (d = 0 is the reference scale), each point also refitted by
# least squares; on SmolLM2's matrices at 5 bits this halves the output error of absmax scales.
_VBIT_OFFSETS = np.linspace(-0.5, 1.5, 9).astype(np.float32)
# The widest rows whose groups also try negative scales. The extra level cuts the weight error
# most where levels are few (a seeded Gaussian matrix: -19% at a mean of 3 bits, -12% at 4.25,
# -7% at 5, -5% at 6); at 5 and 6 bits the held-out perplexity moved both ways by more than that
# (docs/QUANT.md, "Signed vbit scales"), so wider rows keep positive scales.
SIGNED_WIDTH = 4


def mean_bits_value(mean_bits: float) -> np.float32:
    """The budget as the reference stores it: clamped to 3..8, truncated to 1/1000."""
    clamped = np.float32(min(max(float(mean_bits), 3.0), 8.0))
    return np.float32(np.float32(int(clamped * np.float32(1000))) / np.float32(1000))


def snap_widths(x: np.ndarray) -> np.ndarray:
    """Snap raw bit counts to {3,4,5,6,8}: nearest level, ties to the lower (7.0 -> 6)."""
    x = np.asarray(x, np.float32)
    best = np.full(x.shape, VBIT_WIDTHS[0], np.uint8)
    bestd = np.abs(x - np.float32(VBIT_WIDTHS[0]))
    for lv in VBIT_WIDTHS[1:]:
        d = np.abs(x - np.float32(lv))
        better = d < bestd
        best = np.where(better, np.uint8(lv), best)
        bestd = np.where(better, d, bestd)
    return best


def row_log_amplitude(w: np.ndarray) -> np.ndarray:
    """a_r = log2(max(absmax_r, 1e-12)) in f32."""
    absmax = np.abs(w).max(axis=1, initial=np.float32(0)) if w.size else np.zeros(w.shape[0], np.float32)
    # log2 in f64, rounded once to f32: machine-independent (numpy's float32 log2 is not
    # correctly rounded); the reference's log2f differs from this only in rare last-bit cases.
    return np.log2(np.maximum(absmax, np.float32(1e-12)).astype(np.float64)).astype(np.float32)


def _raw_bits(a: np.ndarray, mb: np.float32) -> np.ndarray:
    amean = seq_sum(a) / np.float32(max(a.size, 1))  # f32, left to right like the reference
    return mb + (a - np.float32(amean))


def row_widths(w: np.ndarray, mean_bits: float = DEFAULT_MEAN_BITS, bias: float = 0.0) -> np.ndarray:
    """Per-row widths of a 2-D matrix by water-filling toward ``mean_bits`` (+ a family bias)."""
    raw = _raw_bits(row_log_amplitude(w), mean_bits_value(mean_bits)) + np.float32(bias)
    return snap_widths(raw)


def family_biases(arrays: Sequence[np.ndarray], mean_bits: float = DEFAULT_MEAN_BITS,
                  route_counts: Sequence[float] | None = None) -> list[float]:
    """Per-expert biases for a MoE family (all experts of one layer × projection) sharing one budget.

    Implements the Python writer's joint water-filling (REFERENCE_NOTES §1.8): an expert's
    shift is its mean row amplitude against the family's, plus an optional B-field
    ``log2(count + 1)`` centred over the family (router selection counts from calibration),
    clipped to ±2.5 and centred; then a common δ from 40 bisection steps on [-3, 3] makes the
    snapped widths of all family rows average ``mean_bits``. We take the upper end of the final
    bisection interval, i.e. the smallest δ found whose widths reach the budget (the notes do
    not say which end the reference keeps). Pass each returned bias as ``encode(..., bias=b)``.
    """
    if not arrays:
        return []
    mb = mean_bits_value(mean_bits)
    amps = [row_log_amplitude(as_f32(a).reshape(np.shape(a)[0], -1)) for a in arrays]
    base = [_raw_bits(a, mb) for a in amps]  # mean_bits + d_e, exactly as encode computes it
    am = np.array([float(a.mean()) if a.size else 0.0 for a in amps])
    shift = am - am.mean()
    if route_counts is not None:
        counts = np.asarray(route_counts, np.float64).reshape(-1)
        if counts.size != len(arrays):
            raise ValueError(f"route_counts has {counts.size} entries for {len(arrays)} experts")
        lg = np.log2(counts + 1.0)
        shift = shift + (lg - lg.mean())
    raw = np.clip(shift, -_BIAS_CLIP, _BIAS_CLIP)
    raw = raw - raw.mean()

    def mean_width(delta: float) -> float:
        widths = [snap_widths(b + np.float32(r + delta)) for b, r in zip(base, raw)]
        allw = np.concatenate(widths).astype(np.float64)
        return float(allw.mean()) if allw.size else float(mb)

    lo, hi = -3.0, 3.0
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        if mean_width(mid) < float(mb):
            lo = mid
        else:
            hi = mid
    return [float(r + hi) for r in raw]


def level_codes(ratio: np.ndarray, lvl: np.ndarray) -> np.ndarray:
    """Codes ``u = clip(rint(w/s) + L, 0, 2L + 1)`` of (k, groups, 32) ratios, ``L`` per row (k,)."""
    lv = lvl.astype(np.float32)[:, None, None]
    return np.clip(np.rint(ratio) + lv, 0, 2 * lv + 1).astype(np.int64)


def _search_scales(blk: np.ndarray, lvl: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """Per-group f16-exact scales of (k, groups, 32) weights minimising the weighted squared error."""
    k, gpr, _ = blk.shape
    wt = np.abs(blk) + mse.Q4_MAGNITUDE * np.sqrt((blk * blk).mean(axis=2, keepdims=True))
    if importance is not None:
        wt = wt * importance.reshape(1, gpr, GROUP)
    groups, weights = blk.reshape(-1, GROUP), wt.reshape(-1, GROUP)
    absmax = np.abs(groups).max(axis=1, initial=np.float32(0))
    lv = np.repeat(lvl.astype(np.float32), gpr)
    best, best_err = _grid_search(groups, weights, absmax, lv, np.float32(1))
    # The levels -L .. L+1 have one more step on the side of the scale's sign: in rows of at most
    # SIGNED_WIDTH bits, a group whose largest-magnitude weight is negative also tries negative
    # scales, which give that side the extra level (w = (u - L)·s holds for either sign).
    dominant_negative = groups.min(axis=1, initial=np.float32(0)) < -groups.max(axis=1, initial=np.float32(0))
    narrow = 2 * (lv + 1) <= 2.0 ** SIGNED_WIDTH  # width b <=> L = 2^(b-1) - 1
    flip = np.flatnonzero(dominant_negative & narrow)
    if flip.size:
        s, err = _grid_search(groups[flip], weights[flip], absmax[flip], lv[flip], np.float32(-1))
        best[flip] = np.where(err < best_err[flip], s, best[flip])
    return best.reshape(k, gpr).astype(np.float32)


def _grid_search(groups: np.ndarray, wt: np.ndarray, absmax: np.ndarray, lv: np.ndarray,
                 sign: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(scale, weighted error) per (n, 32) group: the best of ``sign·absmax/(L + d)`` over
    :data:`_VBIT_OFFSETS` and each point's least-squares refit, levels ``-L .. L+1``."""
    lo, hi = -lv[:, None], lv[:, None] + np.float32(1)
    best = best_err = None
    for d in _VBIT_OFFSETS:
        mag = absmax / (lv + d)
        grid = sign * mag
        q = np.clip(np.rint(groups / (sign * np.maximum(mag, np.float32(1e-30)))[:, None]), lo, hi)
        den = (wt * q * q).sum(axis=1)
        refit = np.where(den > 0, (wt * groups * q).sum(axis=1) / np.where(den > 0, den, 1), grid)
        for cand in (grid, refit):
            s = sign * f16_scale(np.maximum(sign * cand, np.float32(0)))
            q = np.clip(np.rint(groups / s[:, None]), lo, hi)
            err = (wt * (q * s[:, None] - groups) ** 2).sum(axis=1)
            if best_err is None:
                best, best_err = s, err
            else:
                better = err < best_err
                best = np.where(better, s, best)
                best_err = np.where(better, err, best_err)
    return best, best_err


def _row_bytes(widths: np.ndarray, cols: int) -> np.ndarray:
    return (widths.astype(np.int64) * cols + 7) // 8


def _pack(u: np.ndarray, b: int) -> np.ndarray:
    """(k, cols) codes of width b -> (k, cols·b/8) bytes, MSB-first."""
    k, cols = u.shape
    chunks = u.astype(np.uint64).reshape(k, cols // 8, 8)
    shifts = (b * (7 - np.arange(8))).astype(np.uint64)
    val = np.bitwise_or.reduce(chunks << shifts, axis=2)
    bshift = (8 * (b - 1 - np.arange(b))).astype(np.uint64)
    return ((val[..., None] >> bshift) & np.uint64(0xFF)).astype(np.uint8).reshape(k, cols * b // 8)


def _unpack(raw: np.ndarray, b: int, cols: int) -> np.ndarray:
    """(k, cols·b/8) bytes -> (k, cols) codes (int32)."""
    k = raw.shape[0]
    chunks = raw.reshape(k, cols // 8, b).astype(np.uint64)
    val = np.bitwise_or.reduce(chunks << (8 * (b - 1 - np.arange(b))).astype(np.uint64), axis=2)
    shifts = (b * (7 - np.arange(8))).astype(np.uint64)
    u = (val[..., None] >> shifts) & np.uint64((1 << b) - 1)
    return u.astype(np.int32).reshape(k, cols)


class VbitCodec(Codec):
    """``vbit``: variable 3–8 bits per row, f16 scale per (row, 32-group), rows MSB-first."""

    id = Dtype.VBIT
    row_offsets = False

    def encode(self, array: np.ndarray, mean_bits: float = DEFAULT_MEAN_BITS, bias: float = 0.0,
               importance: np.ndarray | None = None, encoder: str | None = None) -> bytes:
        """Encode a 2-D matrix (``in % 32 == 0``) at a mean budget of ``mean_bits`` (clamped 3..8).

        ``encoder``: ``"mse"`` (default; ``CMF_QUANT_ENCODER`` overrides) or ``"reference"``.
        ``importance`` (mse only; per input feature, e.g. mean x² from calibration) weights each
        column's error in the scale search. Widths never depend on it: weighting the rows'
        amplitudes by the inputs moved bits to rows with one loud input and measured worse."""
        w = as_f32(array)
        rows, cols = require_2d(self.id, w.shape)
        enc, imp = mse.options(encoder, importance, cols)
        gpr = cols // GROUP
        widths = row_widths(w, mean_bits, bias) if rows else np.zeros(0, np.uint8)
        scales = np.empty((rows, gpr), np.float32)
        u = np.empty((rows, cols), np.uint8)  # codes < 256: one byte each, as the input's quarter
        for sl in row_chunks(rows, cols):
            blk = w[sl].reshape(-1, gpr, GROUP)
            b = widths[sl].astype(np.int64)
            lvl = ((1 << (b - 1)) - 1).astype(np.float32)
            if enc == "mse":
                s = _search_scales(blk, lvl, imp)
            else:
                s = f16_scale(np.abs(blk).max(axis=2, initial=np.float32(0)) / lvl[:, None])
            scales[sl] = s
            u[sl] = level_codes(blk / s[..., None], lvl).reshape(-1, cols)
        return self.assemble(widths, scales, u)

    def assemble(self, widths: np.ndarray, scales: np.ndarray, codes: np.ndarray) -> bytes:
        """The payload of per-row ``widths``, f16-exact ``scales`` (rows × in/32) and ``codes``
        (rows × in, each in 0 .. 2^width - 1)."""
        rows, cols = codes.shape
        row_bytes = _row_bytes(widths, cols)
        starts = np.concatenate([[0], np.cumsum(row_bytes)]).astype(np.int64)
        packed = np.zeros(int(starts[-1]), np.uint8)
        for sl in row_chunks(rows, cols):
            b = widths[sl]
            u = codes[sl]
            for width in np.unique(b):
                sel = np.flatnonzero(b == width)
                nb = cols * int(width) // 8
                if nb == 0:
                    continue
                window = sliding_window_view(packed, nb, writeable=True)
                window[starts[sl.start + sel]] = _pack(u[sel], int(width))
        parts = [np.asarray(widths, np.uint8).tobytes(), f32_to_f16_bits(scales).astype("<u2").tobytes()]
        if self.row_offsets:
            if starts[-1] > 0xFFFFFFFF:
                raise BoundsError(f"vbit_ro packed area of {int(starts[-1])} B does not fit u32 offsets")
            parts.append(starts.astype("<u4").tobytes())
        parts.append(packed.tobytes())
        return b"".join(parts)

    def _layout(self, buf: Buffer, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        shape = check_shape(shape)
        rows, cols = require_2d(self.id, shape)
        data = as_bytes_array(buf)
        widths, scales_off, starts = vbit_layout(data, shape, row_offsets=self.row_offsets)
        return data, widths, starts, scales_off, cols

    def _decode(self, data: np.ndarray, widths: np.ndarray, starts: np.ndarray, scales_off: int,
                cols: int, rows: np.ndarray) -> np.ndarray:
        nrows = widths.size
        gpr = cols // GROUP
        out = _outputs.empty((rows.size, cols), np.float32)
        if rows.size == 0 or cols == 0:
            return out
        scales = f16_at(data, scales_off, nrows * gpr).reshape(nrows, gpr)
        wsel = widths[rows]
        for width in np.unique(wsel):
            b = int(width)
            sel = np.flatnonzero(wsel == width)
            src = rows[sel]
            raw = sliding_window_view(data, cols * b // 8)[starts[src]]
            u = _unpack(raw, b, cols) - ((1 << (b - 1)) - 1)
            vals = u.astype(np.float32).reshape(sel.size, gpr, GROUP) * scales[src][..., None]
            out[sel] = vals.reshape(sel.size, cols)
        return out

    def decode(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        data, widths, starts, scales_off, cols = self._layout(buf, shape)
        out = _outputs.empty((widths.size, cols), np.float32)
        _fast.vbit_decode(data, widths, starts, scales_off, _fast.F16_TABLE, cols, out)
        return out

    def decode_rows(self, buf, shape, rows):
        data, widths, starts, scales_off, cols = self._layout(buf, shape)
        _, _, rows = row_block(check_shape(shape), rows)
        return self._decode(data, widths, starts, scales_off, cols, rows)

    def widths(self, buf: Buffer, shape: Sequence[int]) -> np.ndarray:
        """The validated per-row widths of a payload."""
        return self._layout(buf, shape)[1].copy()


class VbitRoCodec(VbitCodec):
    """``vbit_ro``: vbit plus ``u32 offsets[rows+1]`` (relative to the packed area) for O(1) rows."""

    id = Dtype.VBIT_RO
    row_offsets = True


def encode_family(arrays: Sequence[np.ndarray], dtype: str | Dtype = Dtype.VBIT_RO, mean_bits: float = DEFAULT_MEAN_BITS,
                  route_counts: Sequence[float] | None = None) -> list[bytes]:
    """Encode all experts of one MoE family (layer × projection) under one shared budget."""
    d = resolve_dtype(dtype)
    if d not in (Dtype.VBIT, Dtype.VBIT_RO):
        raise ValueError(f"encode_family encodes vbit or vbit_ro, not {d.label}")
    codec = get_codec(d)
    biases = family_biases(arrays, mean_bits, route_counts)
    return [codec.encode(a, mean_bits=mean_bits, bias=b) for a, b in zip(arrays, biases)]
