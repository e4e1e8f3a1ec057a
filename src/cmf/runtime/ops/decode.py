"""numba kernels of the one-token decode step: RMSNorm into a buffer, q/k norm + RoPE in place,
and attention of one query over the KV cache.

They compute what ``norm.py``, ``rope.py`` and ``attention.py`` compute for T = 1, without the
numpy temporaries (a few µs each, 12+ times per token). The norm keeps the float64 mean of
squares and the operation order of :func:`~cmf.runtime.ops.norm.rms_norm_prepared` (no
fastmath: reassociating ``x·inv·w`` would change the last bit).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ...kernels.vmath import exp_f32

_EXACT = {"cache": True, "nogil": True, "error_model": "numpy"}
_FAST = dict(_EXACT, fastmath={"contract", "nsz", "arcp", "reassoc"})
# Attention over fewer (heads × positions × dims) than this runs on one thread: a parallel
# region costs more than it saves.
PARALLEL_ATTEND = 1 << 13


@numba.njit(**_EXACT)
def rms_norm_into(x, w, eps, out):  # pragma: no cover - compiled
    """out[r] = x[r] · f32(1/sqrt(mean(x[r]²) + eps)) · w for each row of x [T, n] (w may be empty)."""
    T, n = x.shape
    for t in range(T):
        acc = 0.0
        for i in range(n):
            v = np.float64(x[t, i])
            acc += v * v
        inv = np.float32(1.0 / math.sqrt(acc / n + eps))
        if w.shape[0]:
            for i in range(n):
                out[t, i] = (x[t, i] * inv) * w[i]
        else:
            for i in range(n):
                out[t, i] = x[t, i] * inv


@numba.njit(**_EXACT)
def _rope(h, cos, sin):  # pragma: no cover - compiled
    """Half-split rotation of the first cos.shape[0] dims of each head, in place."""
    rot = cos.shape[0]
    half = rot // 2
    for j in range(h.shape[0]):
        for i in range(half):
            x1 = h[j, i]
            x2 = h[j, half + i]
            h[j, i] = x1 * cos[i] - x2 * sin[i]
            h[j, half + i] = x2 * cos[half + i] + x1 * sin[half + i]


@numba.njit(**_EXACT)
def qk_norm_rope(q, k, qn, kn, eps, cos, sin):  # pragma: no cover - compiled
    """The per-head q/k RMSNorm (when qn/kn are non-empty) and RoPE of one token, in place."""
    if qn.shape[0]:
        rms_norm_into(q, qn, eps, q)  # per head, in place (each row is read before it is written)
    if kn.shape[0]:
        rms_norm_into(k, kn, eps, k)
    if cos.shape[0]:
        _rope(q, cos, sin)
        _rope(k, cos, sin)


@numba.njit(**_FAST)
def _attend_head(q, keys, vals, h, group, lo, hi, scale, softcap, out, p):  # pragma: no cover - compiled
    """Query heads h·group … h·group+group-1 over cache entries [lo, hi) of KV head h.

    Each key and value row is loaded once for the whole group; the exp and normalisation passes
    are plain loops over the scores, so they vectorize."""
    d = q.shape[1]
    dv = vals.shape[2]
    n = hi - lo
    mx = np.full(group, -np.inf, np.float32)  # running max per query head (no separate pass:
    for s in range(n):                         # a max reduction does not vectorize without nnan)
        kr = keys[lo + s, h]
        for g in range(group):
            qh = q[h * group + g]
            acc = np.float32(0)
            for i in range(d):
                acc += qh[i] * kr[i]
            acc *= scale
            if softcap > 0:
                acc = np.tanh(acc / softcap) * softcap
            p[g, s] = acc
            mx[g] = max(mx[g], acc)
    for g in range(group):
        pg = p[g]
        m = mx[g]
        tot = np.float32(0)
        for s in range(n):
            e = exp_f32(pg[s] - m)
            pg[s] = e
            tot += e
        for s in range(n):
            pg[s] = pg[s] / tot
        out[h * group + g, :] = 0
    for s in range(n):
        vr = vals[lo + s, h]
        for g in range(group):
            w = p[g, s]
            o = out[h * group + g]
            for i in range(dv):
                o[i] += w * vr[i]


@numba.njit(**_FAST)
def _span(n, pos, k0, window):  # pragma: no cover - compiled
    """Cache entries [lo, hi) a query at ``pos`` sees: not in the future, inside the window."""
    hi = min(n, pos - k0 + 1)
    lo = 0
    if window > 0:
        lo = max(0, pos - window + 1 - k0)
    return lo, hi


@numba.njit(**_FAST)
def attend_one(q, keys, vals, pos, k0, scale, window, softcap, out):  # pragma: no cover - compiled
    """out[H, Dv] for one query q[H, D] at absolute position ``pos`` over keys/vals [S, KV, ·]
    whose entry 0 sits at ``k0`` (``window``/``softcap`` 0: none)."""
    kvh = keys.shape[1]
    group = q.shape[0] // kvh
    lo, hi = _span(keys.shape[0], pos, k0, window)
    p = np.empty((group, max(hi - lo, 1)), np.float32)
    for h in range(kvh):
        _attend_head(q, keys, vals, h, group, lo, hi, np.float32(scale), np.float32(softcap), out, p)


@numba.njit(parallel=True, **_FAST)
def attend_one_par(q, keys, vals, pos, k0, scale, window, softcap, out):  # pragma: no cover - compiled
    """:func:`attend_one` with the KV heads split across threads."""
    kvh = keys.shape[1]
    group = q.shape[0] // kvh
    lo, hi = _span(keys.shape[0], pos, k0, window)
    for h in prange(kvh):
        p = np.empty((group, max(hi - lo, 1)), np.float32)
        _attend_head(q, keys, vals, h, group, lo, hi, np.float32(scale), np.float32(softcap), out, p)


def attend_decode(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, pos: int, k0: int, scale: float,
                  window: int | None, softcap: float | None, out: np.ndarray, nt: int | None = None) -> np.ndarray:
    """One-token attention into ``out`` [H, Dv]; parallel over KV heads for long caches."""
    work = q.shape[0] * keys.shape[0] * q.shape[1]
    nt = numba.get_num_threads() if nt is None else nt
    fn = attend_one_par if work >= PARALLEL_ATTEND and nt > 1 and keys.shape[1] > 1 else attend_one
    fn(q, keys, vals, pos, k0, scale, int(window or 0), float(softcap or 0.0), out)
    return out
