"""Causal attention of a block of queries (prefill) through per-thread sgemm.

The numpy form (``attention.attend``) builds the whole [KV, G, T, S] score tensor, masks the
future half and exponentiates all of it, and runs its matmuls on OpenBLAS's own thread pool. Here
each numba thread takes whole query heads; for a block of ``QB`` queries of one head it computes
only the visible key range with one sgemm (strided operands straight from the [T, H, D] query and
[S, KV, D] cache layouts: no transposed copies), a row-wise softmax in place, and P·V with a second
sgemm into the output rows. Same semantics as :func:`~cmf.runtime.ops.attention.attend`: a key is
visible when it is not in the future and, with a window, when ``q_pos − k_pos < window``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ...kernels.vmath import exp_f32
from ...kernels.blas import NO_TRANS, SGEMM, TRANS, sgemm, single_threaded

QB = 64  # queries per block: one [QB, S] score tile per thread
_OPTS = {"cache": True, "nogil": True, "error_model": "numpy", "fastmath": {"contract", "nsz", "arcp", "reassoc"}}


@numba.njit(inline="always")
def _softmax_row(row, a, b, n0, scale, softcap, capped):  # pragma: no cover - compiled
    """row[a:b] ← softmax(scale·row[a:b]) (soft-capped when ``capped``), the rest of row[:n0] ← 0."""
    if capped:
        for s in range(a, b):
            row[s] = np.tanh(row[s] * scale / softcap) * softcap
    else:
        for s in range(a, b):
            row[s] = row[s] * scale
    m = -np.inf
    for s in range(a, b):
        m = max(m, row[s])
    tot = np.float32(0)
    for s in range(a, b):
        e = exp_f32(row[s] - m)
        row[s] = e
        tot += e
    inv = np.float32(1) / tot
    for s in range(a, b):
        row[s] *= inv
    row[:a] = 0
    row[b:n0] = 0


@numba.njit(**_OPTS)
def _softmax_causal(sc, n0, q_pos, k_pos, scale):  # pragma: no cover - compiled
    """Row r of sc[:, :n0] ← softmax over the keys query q_pos + r may see: plain causal rows.

    Kept apart from the windowed / soft-capped form: with those tests compiled in, LLVM left the
    loops scalar (measured 3x slower)."""
    for r in range(sc.shape[0]):
        _softmax_row(sc[r], 0, min(n0, q_pos + r - k_pos + 1), n0, scale, scale, False)


@numba.njit(**_OPTS)
def _softmax_rows(sc, n0, q_pos, k_pos, window, softcap, scale):  # pragma: no cover - compiled
    """Row r of sc[:, :n0] ← softmax over the keys query q_pos + r may see (others 0): each row's
    visible keys are one contiguous range [a, b), so the loops carry no per-element test."""
    for r in range(sc.shape[0]):
        qp = q_pos + r
        b = min(n0, qp - k_pos + 1)
        a = max(0, qp - window + 1 - k_pos) if window > 0 else 0
        _softmax_row(sc[r], a, b, n0, scale, softcap, softcap > 0)


@numba.njit(parallel=True, **_OPTS)
def attend_block(addr, ilp64, q, keys, vals, q_pos0, k_pos0, scale, window, softcap, out, bufs,
                 nt):  # pragma: no cover - compiled
    """out[T, H, Dv] for queries q[T, H, D] at q_pos0.. over keys/vals [S, KV, ·] at k_pos0.."""
    T, H, D = q.shape
    S, KV, Dv = vals.shape
    G = H // KV
    qb = bufs.shape[1]  # queries per block: the score buffer's rows
    nb = (T + qb - 1) // qb
    scale32 = np.float32(scale)
    cap32 = np.float32(softcap)
    per = (H + nt - 1) // nt
    for j in prange(nt):
        sc = bufs[j]
        for hq in range(j * per, min(H, (j + 1) * per)):
            h = hq // G
            for b in range(nb):
                t0 = b * qb
                t1 = min(T, t0 + qb)
                # visible key range of the block: [lo, hi) in cache entries
                hi = min(S, q_pos0 + t1 - 1 - k_pos0 + 1)
                lo = 0
                if window > 0:
                    lo = max(0, q_pos0 + t0 - window + 1 - k_pos0)
                n0 = hi - lo
                if n0 <= 0:
                    out[t0:t1, hq, :] = 0
                    continue
                blk = sc[:t1 - t0]
                sgemm(addr, ilp64, TRANS, t1 - t0, n0, D, q[t0:, hq], H * D, keys[lo:, h], KV * D, blk, sc.shape[1])
                if window > 0 or softcap > 0:
                    _softmax_rows(blk, n0, q_pos0 + t0, k_pos0 + lo, window, cap32, scale32)
                else:
                    _softmax_causal(blk, n0, q_pos0 + t0, k_pos0 + lo, scale32)
                sgemm(addr, ilp64, NO_TRANS, t1 - t0, Dv, n0, blk, sc.shape[1], vals[lo:, h], KV * Dv,
                      out[t0:, hq], H * Dv)


def supported() -> bool:
    return bool(SGEMM.addr)


def attend_blocked(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, q_pos0: int, k_pos0: int, *, scale: float,
                   window: int | None = None, softcap: float | None = None) -> np.ndarray:
    """q [T, H, D], keys [S, KV, D], vals [S, KV, Dv] → [T, H, Dv] (see the module docstring)."""
    from ...numba_prims import scratch

    T, H, _ = q.shape
    S = keys.shape[0]
    q = np.ascontiguousarray(q, dtype=np.float32)
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    vals = np.ascontiguousarray(vals, dtype=np.float32)
    out = np.empty((T, H, vals.shape[2]), np.float32)
    nt = max(1, min(numba.get_num_threads(), H))
    bufs = scratch("attn-scores", (nt, QB, max(S, 1)))
    with single_threaded():
        attend_block(SGEMM.addr, SGEMM.ilp64, q, keys, vals, int(q_pos0), int(k_pos0), float(scale),
                     int(window or 0), float(softcap or 0.0), out, bufs, nt)
    return out
