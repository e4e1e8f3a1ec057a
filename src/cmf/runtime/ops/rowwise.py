"""Row-parallel drivers for blocks of tokens (prefill): RMSNorm, the gated activation, and the
q/k norm + RoPE of attention.

The norm and RoPE here are not implementations of their own: each thread runs the one-token
step's bodies (``decode.rms_norm_into``, ``decode.qk_norm_rope``, ``decode.rope_into``) over its
rows, so a token gets the same bits in a block as alone. numpy evaluates
``x / (1 + exp(−x)) · u`` over a [512, 3072] block in five passes with four temporaries and a
scalar exp per element; the gated activation runs one pass, 16 lanes wide (kernels/vmath.py),
rows split across threads.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ...kernels.vmath import gated
from .decode import qk_norm_rope, rms_norm_into, rope_into

_PAR = {"cache": True, "nogil": True, "error_model": "numpy", "parallel": True,
        "fastmath": {"contract", "nsz", "arcp", "reassoc"}}
_EXACT_PAR = {"cache": True, "nogil": True, "error_model": "numpy", "parallel": True}
# Below this many elements a block runs on one thread.
PARALLEL_MIN = 1 << 16


@numba.njit(**_PAR)
def _gated_rows(g, u, act, out, nt):  # pragma: no cover - compiled
    T, n = g.shape
    step = (T + nt - 1) // nt
    for j in prange(nt):
        for t in range(j * step, min(T, (j + 1) * step)):
            for i in range(n):
                out[t, i] = gated(g[t, i], u[t, i], act)


@numba.njit(**_EXACT_PAR)
def _norm_rows(x, w, eps, out, nt):  # pragma: no cover - compiled
    T = x.shape[0]
    step = (T + nt - 1) // nt
    for j in prange(nt):
        t0 = min(T, j * step)
        t1 = min(T, t0 + step)
        rms_norm_into(x[t0:t1], w, eps, out[t0:t1])


def _threads(size: int) -> int:
    return numba.get_num_threads() if size >= PARALLEL_MIN else 1


def gated_act(g: np.ndarray, u: np.ndarray, act: int, *, in_place: bool = False) -> np.ndarray:
    """act(g)·u for [T, n] blocks (act: a kernels.gemv.ACTS code). ``in_place``: written over
    ``g`` when it is a writable C-contiguous float32 array (each element reads only its own g
    and u), else into a new array."""
    if in_place and g.dtype == np.float32 and g.flags.c_contiguous and g.flags.writeable and g.shape == u.shape:
        out = g
    else:
        out = np.empty(g.shape, np.float32)
    _gated_rows(g, u, act, out, _threads(g.size))
    return out


_EMPTY = np.zeros(0, np.float32)


@numba.njit(**_EXACT_PAR)
def _qk_norm_rope_rows(q, k, qn, kn, eps, cos, sin, nt):  # pragma: no cover - compiled
    T = q.shape[0]
    step = (T + nt - 1) // nt
    for j in prange(nt):
        for t in range(j * step, min(T, (j + 1) * step)):
            qk_norm_rope(q[t], k[t], qn, kn, eps, cos[t], sin[t])


def qk_norm_rope_rows(q: np.ndarray, k: np.ndarray, qn: np.ndarray | None, kn: np.ndarray | None, eps: float,
                      cos: np.ndarray, sin: np.ndarray) -> None:
    """The per-head q/k RMSNorm (where a weight is given) and RoPE of a block of tokens, in place:
    q [T, H, D] and k [T, KV, D] C-contiguous float32, cos/sin [T, rotary_dim]. Each token is the
    decode step's ``qk_norm_rope`` — the values of ``rms_norm_rows`` then ``rope.apply_rope``,
    without their copies and temporaries (~2 ms a layer at T = 256)."""
    _qk_norm_rope_rows(q, k, _EMPTY if qn is None else qn, _EMPTY if kn is None else kn, float(eps),
                       np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32),
                       _threads(q.size))


@numba.njit(**_EXACT_PAR)
def _rope_rows(x, cos, sin, nt):  # pragma: no cover - compiled
    T = x.shape[0]
    step = (T + nt - 1) // nt
    for j in prange(nt):
        for t in range(j * step, min(T, (j + 1) * step)):
            rope_into(x[t], cos[t], sin[t])


def rope_rows(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE of a block of tokens in place, x [T, heads, D] C-contiguous float32, cos/sin [T, rotary_dim]:
    each token is the decode step's rotation (``decode.rope_into``), the values of ``rope.apply_rope``
    (the same float32 operations, no fastmath). Returns x."""
    if cos.shape[-1]:
        _rope_rows(x, np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32),
                   _threads(x.size))
    return x


def rms_norm_rows(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm of each row of x [T, n] into a new array: ``decode.rms_norm_into`` over row ranges
    (the values of ops.norm.rms_norm_prepared, to the bit)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.float32)
    nt = _threads(x.size)
    if nt == 1:  # no parallel region to set up (~3 µs of a 30-row norm)
        rms_norm_into(x, _EMPTY if w is None else w, float(eps), out)
    else:
        _norm_rows(x, _EMPTY if w is None else w, float(eps), out, nt)
    return out
