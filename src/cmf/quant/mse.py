"""The ``mse`` encoder of the 4- and 2-bit group dtypes: the same bytes layouts, better choices.

The reference encoders (REFERENCE_NOTES §1.8) take each group's scale from its absmax
(``absmax/7`` for 4 bits, ``absmax/1.5`` for 2) and only nudge the q4tp/q2tp rung by a step or
two. The ``mse`` encoder chooses, per group, the scale that minimises the group's weighted
squared reconstruction error (4-bit: each weight's error counts ``0.5·rms(group) + |w|`` times,
so large weights keep their precision; 2-bit: plain) among:

- q4_block / q4_tiled: the reference scale, a grid of signed scales that map the largest-magnitude
  weight onto the -8 end (all 16 levels in use, as llama.cpp's Q4_0 does), and the least-squares
  refit of each grid point's levels; every candidate is rounded to f16 before it is scored and the
  nibbles are quantized against that rounded scale, so writer and reader agree.
- q4tp / q2tp: the rungs of the row's ladder around the group's best unconstrained scale; the
  ladder's ``lo``/``step`` come from the rows' best scales rather than from absmax, and q2tp may
  also pick its zero rung for a live group when that is closer.

Every reader decodes the result with the normative decoders: nothing about the layout changes.
Arithmetic is plain f32 without fastmath, so the bytes do not depend on the CPU's vector width.
Figures and the reason ``mse`` is the default are in docs/QUANT.md.

``importance`` (length = input features, non-negative) multiplies each column's error weight; a
calibration pass can pass the mean squared activation per input channel. ``CMF_QUANT_ENCODER=
reference`` in the environment makes the reference encoder the default (the reference bytes from
the command line).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numba
import numpy as np
from numba import njit, prange

ENCODERS = ("mse", "reference")
DEFAULT_ENCODER = "mse"

_SER = {"cache": True, "nogil": True}
_PAR = {"cache": True, "nogil": True, "parallel": True}
_PARALLEL_MIN = 1 << 16  # groups below which one thread encodes the whole chunk

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_LO4 = np.float32(-8.0)
_HI4 = np.float32(7.0)
_HALF = np.float32(0.5)
_C2 = np.float32(1.5)
_Q2MAX = np.float32(3.0)
_F16_TINY = 2.0 ** -14
_F16_MAX = 65504.0

# Signed q4_block/q4_tiled grid: s = -m/d for the largest-magnitude weight m. d = 8 puts m exactly
# on level -8; d < 8 rounds it inward, d > 8 clips it (at most by |m|/9, which bounds the worst
# element's error the way absmax/7 scaling does).
Q4_DIVISORS = np.linspace(7.0, 9.0, 9).astype(np.float32)
# Positive-scale grids for a group's best unconstrained scale s = absmax/d, each point followed by
# its least-squares refit (q4tp: levels -8..7; q2tp: ±0.5, ±1.5, whose squared-error optimum for
# a Gaussian group sits near absmax/2.2). Wider or finer grids measured no better (docs/QUANT.md).
Q4TP_DIVISORS = np.linspace(6.5, 9.5, 7).astype(np.float32)
Q2_DIVISORS = np.linspace(1.5, 4.0, 11).astype(np.float32)
# 4-bit error weight per element = importance × (Q4_MAGNITUDE·rms(group) + |w|): plain squared error
# spends the scale on the many small weights and lets the few large ones round coarsely, which
# measured worse on a real model than weighting large weights up (as llama.cpp's k-quants do);
# at 2 bits the same weighting measured worse than none (docs/QUANT.md), so q2tp has it off.
Q4_MAGNITUDE = np.float32(0.5)
Q2_MAGNITUDE = np.float32(-1.0)  # < 0: off


def options(encoder: str | None, importance: Any, cols: int,
            search: bool | None = None) -> tuple[str, np.ndarray | None]:
    """Validate the encoder options: (encoder name, importance as f32 (cols,) or None)."""
    if encoder is None:
        encoder = os.environ.get("CMF_QUANT_ENCODER", "").strip() or DEFAULT_ENCODER
    enc = str(encoder).strip().lower()
    if enc not in ENCODERS:
        raise ValueError(f"unknown encoder {encoder!r}; choose one of {', '.join(ENCODERS)}")
    if enc == "mse" and search is not None:
        raise ValueError("search= is an option of encoder='reference' (the reference's CMF_Q2TP_SEARCH)")
    if importance is None:
        return enc, None
    if enc != "mse":
        raise ValueError("importance= needs encoder='mse'; the reference encoder has no error weights")
    imp = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
    if imp.size != cols:
        raise ValueError(f"importance has {imp.size} values; the matrix has {cols} input features")
    if not np.isfinite(imp).all() or (imp < 0).any():
        raise ValueError("importance must be finite and non-negative")
    return enc, imp


def group_weights(importance: np.ndarray | None, cols: int) -> np.ndarray:
    """(P, 32) per-element weights of flattened 32-groups; group g uses row g % P.

    Groups of a flattened tensor repeat their column pattern every ``cols / gcd(cols, 32)``
    groups, so one small table serves any chunk (given the chunk's first global group).
    """
    if importance is None:
        return np.ones((1, 32), np.float32)
    period = cols // math.gcd(cols, 32)
    return np.ascontiguousarray(importance[np.arange(32 * period) % cols].reshape(period, 32))


def _threads(groups: int) -> int:
    return numba.get_num_threads() if groups >= _PARALLEL_MIN else 1


# -- scalar pieces ----------------------------------------------------------------------------

@njit(inline="always", **_SER)
def _f16s(x):  # pragma: no cover - compiled
    """``f16_scale`` of a signed f32: RNE to f16's 11 significant bits, magnitude floored at 2^-14."""
    a = abs(np.float64(x))
    if not a >= _F16_TINY:  # also NaN: never reached for finite groups
        r = _F16_TINY
    else:
        m, e = math.frexp(a)
        r = min(math.ldexp(np.rint(m * 2048.0), e - 11), _F16_MAX)
    return np.float32(-r) if x < 0 else np.float32(r)


@njit(inline="always", **_SER)
def _stats(x, w, s, two_bit):  # pragma: no cover - compiled
    """One pass over a group quantized against scale s (reciprocal form, as the writer stores):
    (Σ w·x·l, Σ w·l²) for its levels l, from which the error at any scale of those levels and
    their least-squares scale follow."""
    r = _F1 / s
    num = _F0
    den = _F0
    for i in range(32):
        if two_bit:
            q = min(max(np.rint(x[i] * r + _C2), _F0), _Q2MAX) - _C2
        else:
            q = min(max(np.rint(x[i] * r), _LO4), _HI4)
        num += w[i] * x[i] * q
        den += w[i] * q * q
    return num, den


@njit(inline="always", **_SER)
def _sxx(x, w):  # pragma: no cover - compiled
    t = _F0
    for i in range(32):
        t += w[i] * x[i] * x[i]
    return t


@njit(inline="always", **_SER)
def _err(sxx, num, den, s):  # pragma: no cover - compiled
    """Σ w·(x − l·s)² = Σwx² − 2s·Σwxl + s²·Σwl², in f64 (the f32 sums cancel by ~2 digits)."""
    sd = np.float64(s)
    return np.float64(sxx) - 2.0 * sd * np.float64(num) + sd * sd * np.float64(den)


@njit(inline="always", **_SER)
def _absmax(x):  # pragma: no cover - compiled
    """(absmax, the first weight of largest magnitude)."""
    a = _F0
    m = _F0
    for i in range(32):
        v = abs(x[i])
        if v > a:
            a = v
            m = x[i]
    return a, m


@njit(inline="always", **_SER)
def _weights(xs, wcol, mag, out):  # pragma: no cover - compiled
    """Per-element error weights of one group: column importance × (mag·rms(group) + |w|).

    mag < 0 turns the magnitude term off (plain weighted squared error).
    """
    if mag < _F0:
        for i in range(32):
            out[i] = wcol[i]
        return
    ss = _F0
    for i in range(32):
        ss += xs[i] * xs[i]
    base = mag * np.float32(math.sqrt(ss / np.float32(32.0)))
    for i in range(32):
        out[i] = wcol[i] * (base + abs(xs[i]))


# -- q4_block / q4_tiled: signed f16 scale per group -----------------------------------------

@njit(**_SER)
def _q4_groups_range(x, wt, g0, div, mag, s_out, q_out, lo, hi):  # pragma: no cover - compiled
    period = wt.shape[0]
    w = np.empty(32, np.float32)
    for g in range(lo, hi):
        xs = x[g]
        _weights(xs, wt[(g0 + g) % period], mag, w)
        a, m = _absmax(xs)
        sxx = _sxx(xs, w)
        best = _f16s(a / np.float32(7.0))  # the reference's scale first: ties keep it
        num, den = _stats(xs, w, best, False)
        err = _err(sxx, num, den, best)
        if a > _F0:
            for k in range(div.shape[0]):
                s = _f16s(-m / div[k])
                num, den = _stats(xs, w, s, False)
                e = _err(sxx, num, den, s)
                if e < err:
                    err, best = e, s
                if den > _F0 and num != _F0:  # the least-squares scale of these levels
                    s = _f16s(num / den)
                    num, den = _stats(xs, w, s, False)
                    e = _err(sxx, num, den, s)
                    if e < err:
                        err, best = e, s
        s_out[g] = best
        r = _F1 / best
        for i in range(32):
            q_out[g, i] = np.uint8(min(max(np.rint(xs[i] * r), _LO4), _HI4) + np.float32(8.0))


@njit(**_PAR)
def _q4_groups_par(x, wt, g0, div, mag, s_out, q_out, nt):  # pragma: no cover - compiled
    n = x.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _q4_groups_range(x, wt, g0, div, mag, s_out, q_out, min(n, c * step), min(n, (c + 1) * step))


def q4_groups(x: np.ndarray, wt: np.ndarray, g0: int) -> tuple[np.ndarray, np.ndarray]:
    """(G, 32) f32 groups -> (f16-exact signed scales (G,), nibble codes 0..15 (G, 32))."""
    s = np.empty(x.shape[0], np.float32)
    q = np.empty(x.shape, np.uint8)
    nt = _threads(x.shape[0])
    if nt > 1:
        _q4_groups_par(x, wt, g0, Q4_DIVISORS, Q4_MAGNITUDE, s, q, nt)
    else:
        _q4_groups_range(x, wt, g0, Q4_DIVISORS, Q4_MAGNITUDE, s, q, 0, x.shape[0])
    return s, q


# -- q4tp / q2tp: best unconstrained scale, then the best rung ---------------------------------

@njit(**_SER)
def _ideal_range(x, wt, div, two_bit, mag, s_out, lo, hi):  # pragma: no cover - compiled
    gpr = x.shape[1]
    w = np.empty(32, np.float32)
    for r in range(lo, hi):
        for g in range(gpr):
            xs = x[r, g]
            _weights(xs, wt[g], mag, w)
            a, _ = _absmax(xs)
            if a == _F0:
                s_out[r, g] = _F0
                continue
            sxx = _sxx(xs, w)
            best = a / div[0]
            err = np.inf
            for k in range(div.shape[0]):
                s = a / div[k]
                for _it in range(2):  # the grid point, then its least-squares refit
                    if s > _F0:
                        num, den = _stats(xs, w, s, two_bit)
                        e = _err(sxx, num, den, s)
                        if e < err:
                            err, best = e, s
                        s = num / den if den > _F0 else _F0
            s_out[r, g] = best


@njit(**_PAR)
def _ideal_par(x, wt, div, two_bit, mag, s_out, nt):  # pragma: no cover - compiled
    n = x.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _ideal_range(x, wt, div, two_bit, mag, s_out, min(n, c * step), min(n, (c + 1) * step))


def ideal_scales(x: np.ndarray, wt: np.ndarray, two_bit: bool) -> np.ndarray:
    """(rows, gpr, 32) -> (rows, gpr) positive scale minimising each group's error (0 = dead)."""
    s = np.empty(x.shape[:2], np.float32)
    div = Q2_DIVISORS if two_bit else Q4TP_DIVISORS
    mag = Q2_MAGNITUDE if two_bit else Q4_MAGNITUDE
    nt = _threads(x.shape[0] * x.shape[1])
    if nt > 1:
        _ideal_par(x, wt, div, two_bit, mag, s, nt)
    else:
        _ideal_range(x, wt, div, two_bit, mag, s, 0, x.shape[0])
    return s


@njit(**_SER)
def _rungs_range(x, wt, t, ideal, first, factor, two_bit, mag, codes, q_out, row_err, lo, hi):  # pragma: no cover
    gpr = x.shape[1]
    w = np.empty(32, np.float32)
    for r in range(lo, hi):
        tr = t[r]
        total = 0.0
        for g in range(gpr):
            xs = x[r, g]
            _weights(xs, wt[g], mag, w)
            si = ideal[r, g]
            if si == _F0:  # dead group: rung 0 (q2tp: exact zero; q4tp: nibbles 8)
                codes[r, g] = 0
                for i in range(32):
                    q_out[r, g, i] = 2 if two_bit else 8
                continue
            # rungs whose scale lies within [si/factor, si·factor] (a contiguous run, the ladder
            # grows), else the single nearest rung in log distance
            c_lo = 32
            c_hi = -1
            near = first
            gap = np.float32(np.inf)
            for c in range(first, 32):
                s = tr[c]
                if s >= si / factor and s <= si * factor:
                    c_lo = min(c_lo, c)
                    c_hi = max(c_hi, c)
                d = max(s / si, si / s) if s > _F0 else np.float32(np.inf)  # ratio: log distance
                if d < gap:
                    gap, near = d, c
            if c_hi < c_lo:
                c_lo = c_hi = near
            sxx = _sxx(xs, w)
            err = np.inf
            best = c_lo
            if two_bit:  # the zero rung spells "this group is 0": sometimes the closest
                err = np.float64(sxx)
                best = 0
            for c in range(c_lo, c_hi + 1):
                num, den = _stats(xs, w, tr[c], two_bit)
                e = _err(sxx, num, den, tr[c])
                if e < err:
                    err, best = e, c
            codes[r, g] = best
            total += err
            if two_bit and best == 0:
                for i in range(32):
                    q_out[r, g, i] = 2
                continue
            s = tr[best]
            rc = _F1 / s
            for i in range(32):
                if two_bit:
                    q_out[r, g, i] = np.uint8(min(max(np.rint(xs[i] * rc + _C2), _F0), _Q2MAX))
                else:
                    q_out[r, g, i] = np.uint8(min(max(np.rint(xs[i] * rc), _LO4), _HI4) + np.float32(8.0))
        row_err[r] = total


@njit(**_PAR)
def _rungs_par(x, wt, t, ideal, first, factor, two_bit, mag, codes, q_out, row_err, nt):  # pragma: no cover
    n = x.shape[0]
    step = (n + nt - 1) // nt
    for c in prange(nt):
        _rungs_range(x, wt, t, ideal, first, factor, two_bit, mag, codes, q_out, row_err,
                     min(n, c * step), min(n, (c + 1) * step))


def best_rungs(x: np.ndarray, wt: np.ndarray, t: np.ndarray, ideal: np.ndarray, two_bit: bool,
               factor: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group, the rung of ladder ``t`` (rows, 32) minimising the group's error.

    Returns (codes (rows, gpr) int64, level codes (rows, gpr, 32) uint8: nibbles 0..15 or crumbs
    0..3, weighted squared error per row f64). Rung 0 is q2tp's zero rung.
    """
    rows, gpr = x.shape[:2]
    codes = np.empty((rows, gpr), np.int64)
    q = np.empty(x.shape, np.uint8)
    err = np.empty(rows, np.float64)
    first = 1 if two_bit else 0
    f = np.float32(factor)
    mag = Q2_MAGNITUDE if two_bit else Q4_MAGNITUDE
    nt = _threads(rows * gpr)
    if nt > 1:
        _rungs_par(x, wt, t, ideal, first, f, two_bit, mag, codes, q, err, nt)
    else:
        _rungs_range(x, wt, t, ideal, first, f, two_bit, mag, codes, q, err, 0, rows)
    return codes, q, err
