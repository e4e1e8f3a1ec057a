"""The runtime's compiled operator bodies: RMSNorm (:func:`rms_norm_into`), RoPE
(:func:`rope_into`), their per-head composition (:func:`qk_norm_rope`), and attention of one
query over the KV cache (:func:`attend_one`, :func:`attend_one_par`).

Each body is the only implementation of its operator at run time: the one-token step
(step.py, batched.py) calls them directly, blocks of tokens through the row-parallel drivers of
``rowwise.py``, so an operator's values do not depend on T or on the path. ``norm.py`` and
``rope.py`` keep the numpy references the bodies are tested against, to the bit: the norm sums
the float64 squares in numpy's pairwise order and keeps the operation order of
:func:`~cmf.runtime.ops.norm.rms_norm_prepared` (no fastmath: reassociating ``x·inv·w`` would
change the last bit).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ...numba_prims import chunk
from ...kernels.vmath import exp_f32
from .attend_ir import LANES, WEIGH_BLOCK, head_dots, prefetch_rows, weigh_rows1, weigh_rows2, weigh_rows4
from .kv_values import as_f32, put_entry
from .norm_ir import squares8

_EXACT = {"cache": True, "nogil": True, "error_model": "numpy"}
_FAST = dict(_EXACT, fastmath={"contract", "nsz", "arcp", "reassoc"})
# Attention over fewer (heads × positions × dims) than this runs on one thread: a parallel
# region costs more than it saves (measured inside a decode step: serial 20 µs against 24 µs
# parallel at 16 heads × 65 positions; the position split wins from ~500 positions: 1000 ->
# 128 against 153 µs, 4000 -> 406 against 766).
PARALLEL_ATTEND = 1 << 19


# numpy's pairwise summation (``np.add.reduce`` over contiguous float64): blocks of at most this
# many elements are summed with eight accumulators, longer spans split in two at a multiple of 8.
_PAIRWISE_BLOCK = 128


@numba.njit(inline="always", **_EXACT)
def _leaf_squares(x, t, lo, n):  # pragma: no cover - compiled
    """Σ float64(x[t, i])² over i in [lo, lo + n), n ≤ _PAIRWISE_BLOCK, as numpy sums one such
    block: eight accumulators (one vector of eight lanes, :func:`~.norm_ir.squares8`), then the
    remainder one by one. Row t of the 2-D x, not a view of it: a
    view per row cost reference counting (atomics) at every call."""
    if n < 8:
        acc = 0.0
        for i in range(lo, lo + n):
            v = np.float64(x[t, i])
            acc += v * v
        return acc
    m = lo + n - n % 8
    if x.strides[1] == 4:
        acc = squares8(x, t, lo, m)
    else:  # strided rows (no caller passes them today): the same vector sum over a contiguous copy
        acc = squares8(np.ascontiguousarray(x[t:t + 1, lo:m]), 0, 0, m - lo)
    for j in range(m, lo + n):
        v = np.float64(x[t, j])
        acc += v * v
    return acc


@numba.njit(inline="always", **_EXACT)
def _sum_squares(x, t, n, lo_st, n_st, vals):  # pragma: no cover - compiled
    """Σ float64(x[t, i])² over i < n in the order numpy's pairwise sum adds them.

    The squares are exact in float64, so only the order of the additions can differ; this is
    numpy's order, hence the mean of squares of ``norm.rms_norm_prepared`` to the bit (and eight
    independent accumulators: the sum runs at throughput, not at add latency). numpy recurses;
    this walks the same tree with an explicit stack, because numba's on-disk cache cannot reload
    a recursive function (the process crashed on the second run). The stack is the caller's
    (:func:`_stacks`, made once per call of a norm, not per row: three allocations a row were
    most of a 576-wide row's time)."""
    if n <= _PAIRWISE_BLOCK:
        return _leaf_squares(x, t, 0, n)
    # post-order walk: a node is (lo, n); n = -1 marks "add the last two sums"
    lo_st[0], n_st[0] = 0, n
    sp, vp = 1, 0
    while sp > 0:
        sp -= 1
        lo, m = lo_st[sp], n_st[sp]
        if m < 0:
            vp -= 1
            vals[vp - 1] = vals[vp - 1] + vals[vp]
        elif m <= _PAIRWISE_BLOCK:
            vals[vp] = _leaf_squares(x, t, lo, m)
            vp += 1
        else:
            half = m // 2
            half -= half % 8
            n_st[sp] = -1  # combine after both halves; the left half is summed first
            lo_st[sp + 1], n_st[sp + 1] = lo + half, m - half
            lo_st[sp + 2], n_st[sp + 2] = lo, half
            sp += 3
    return vals[0]


@numba.njit(inline="always")
def _stacks():  # pragma: no cover - compiled
    """The walk stacks of :func:`_sum_squares` (depth ≤ 64: any length an int64 holds)."""
    return np.empty(130, np.int64), np.empty(130, np.int64), np.empty(66, np.float64)


@numba.njit(**_EXACT)
def _norm_rows(x, w, eps, out, lo_st, n_st, vals):  # pragma: no cover - compiled
    """:func:`rms_norm_into`'s rows, the pairwise walk's stacks given."""
    T, n = x.shape
    for t in range(T):
        if n <= _PAIRWISE_BLOCK:
            ss = _leaf_squares(x, t, 0, n)
        else:
            ss = _sum_squares(x, t, n, lo_st, n_st, vals)
        inv = np.float32(1.0 / math.sqrt(ss / n + eps))
        if w.shape[0]:
            for i in range(n):
                out[t, i] = (x[t, i] * inv) * w[i]
        else:
            for i in range(n):
                out[t, i] = x[t, i] * inv


@numba.njit(**_EXACT)
def rms_norm_into(x, w, eps, out):  # pragma: no cover - compiled
    """out[r] = x[r] · f32(1/sqrt(mean(x[r]²) + eps)) · w for each row of x [T, n] (w may be empty):
    the runtime's one RMSNorm (every norm of a layer at any T, the final norm, MLA's latent norms,
    the MTP head), the values of ``norm.rms_norm_prepared`` to the bit. The rows run in
    :func:`_norm_rows` with the walk's stacks as arguments: allocated in the function that loops
    over the rows, they cost ~60 ns a row (576 wide: 0.56 µs a row before, 0.21 µs now)."""
    lo_st, n_st, vals = _stacks()
    _norm_rows(x, w, eps, out, lo_st, n_st, vals)


@numba.njit(parallel=True, **_EXACT)
def rms_norm_rows_par(x, w, eps, out, nt):  # pragma: no cover - compiled
    """:func:`rms_norm_into` with the rows split over ``nt`` threads in contiguous shares (each
    row the same arithmetic)."""
    T = x.shape[0]
    for j in numba.prange(nt):
        t0, t1 = chunk(T, nt, j, 1)
        rms_norm_into(x[t0:t1], w, eps, out[t0:t1])


# Rows from which a norm splits them over the threads: a parallel region costs ~4 µs, a 576-wide
# row ~0.2 µs (16 × 576: 5.1 µs serial, 6.0 split; 64 rows: 19 against 15).
PARALLEL_NORM_ROWS = 32


def norm_into(x: np.ndarray, w: np.ndarray | None, eps: float, out: np.ndarray) -> np.ndarray:
    """RMSNorm of x [T, n] into ``out`` with :func:`rms_norm_into` (``w`` None: the layer has no
    such norm, a copy); the one-token step's and the batched step's norms (a batch's rows over
    the threads from :data:`PARALLEL_NORM_ROWS` rows)."""
    if w is None:
        out[...] = x
    elif x.shape[0] >= PARALLEL_NORM_ROWS:
        rms_norm_rows_par(x, w, eps, out, numba.get_num_threads())
    else:
        rms_norm_into(x, w, eps, out)
    return out


@numba.njit(**_EXACT)
def add_into(x, a):  # pragma: no cover - compiled
    """x += a (a numpy in-place add costs a few µs of dispatch a call, cold in a token step)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += a[t, i]


@numba.njit(**_EXACT)
def add_norm_into(x, a, w, eps, out):  # pragma: no cover - compiled
    """x += a, then :func:`rms_norm_into` of x into ``out``: a layer's residual add and the next
    norm in one call (the same additions and the same norm as the two steps apart)."""
    add_into(x, a)
    rms_norm_into(x, w, eps, out)


def add_norm(x: np.ndarray, a: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
    """x += a, then :func:`norm_into` of x into ``out`` (one compiled call below
    :data:`PARALLEL_NORM_ROWS` rows): the batched step's residual add and the next norm."""
    if x.shape[0] >= PARALLEL_NORM_ROWS:
        add_into(x, a)
        rms_norm_rows_par(x, w, eps, out, numba.get_num_threads())
    else:
        add_norm_into(x, a, w, eps, out)
    return out


@numba.njit(**_EXACT)
def rope_into(h, cos, sin):  # pragma: no cover - compiled
    """Half-split rotation of the first cos.shape[0] dims of each head h [heads, D], in place: the
    one RoPE of the runtime (the decode step, blocks of tokens through ops/rowwise.py)."""
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
        rope_into(q, cos, sin)
        rope_into(k, cos, sin)


@numba.njit(inline="always")
def padded(n):  # pragma: no cover - compiled
    """Row length of a scores buffer for n positions: the vector bodies write whole blocks."""
    return max((n + LANES - 1) // LANES * LANES, 1)


@numba.njit(inline="always")
def _vector_rows(x):  # pragma: no cover - compiled
    """Whether the vector bodies of attend_ir can read x: its last axis contiguous, a multiple
    of the lane width long."""
    return x.shape[x.ndim - 1] % LANES == 0 and x.strides[x.ndim - 1] == x.itemsize


@numba.njit(inline="always")
def _first_values(vals, lo, n):  # pragma: no cover - compiled
    """Ask for the value rows the weighing reads first (a block of them) before the scores are
    computed: they arrive meanwhile instead of stalling the weighing's first block."""
    if _vector_rows(vals):
        prefetch_rows(vals, lo, min(n, WEIGH_BLOCK))


@numba.njit(**_FAST)
def _scores(q, keys, group, lo, hi, scale, softcap, p, mx):  # pragma: no cover - compiled
    """p[j, s] = scale·q_j·k_{lo+s} (soft-capped) for every query head j, and mx[j] its max.

    Rows the vector bodies can read (contiguous, a multiple of the lane width) go to
    :func:`~.attend_ir.head_dots`: blocks of positions, every head inside a block. Otherwise
    this loop, position-major: for each cache entry the KV heads' rows are adjacent in memory
    ([S, KV, D]), so the keys stream through once in address order; a head-major loop strided
    2 KB per entry and ran latency-bound (2× slower inside a decode step, where the products
    have just flushed the caches). Each key row is loaded once for its whole group of query
    heads."""
    d = q.shape[1]
    n = hi - lo
    if _vector_rows(q) and _vector_rows(keys) and p.shape[1] >= padded(n):
        head_dots(q, keys, group, lo, n, scale, p, mx)
        if softcap > 0:
            for j in range(q.shape[0]):
                top = -np.inf
                for s in range(n):
                    v = np.tanh(p[j, s] / softcap) * softcap
                    p[j, s] = v
                    top = max(top, v)
                mx[j] = top
        return
    mx[:] = -np.inf  # running max (no separate pass: a max reduction does not vectorize without nnan)
    for s in range(n):
        for h in range(keys.shape[1]):
            kr = keys[lo + s, h]
            for g in range(group):
                j = h * group + g
                qh = q[j]
                acc = np.float32(0)
                for i in range(d):
                    acc += qh[i] * as_f32(kr[i])
                acc *= scale
                if softcap > 0:
                    acc = np.tanh(acc / softcap) * softcap
                p[j, s] = acc
                mx[j] = max(mx[j], acc)


@numba.njit(**_FAST)
def _weigh(vals, group, lo, n, p, mx, tot, out):  # pragma: no cover - compiled
    """p[j] = exp(p[j] − mx[j]), tot[j] = Σ p[j], out[j] = Σ_s p[j, s]·v_{lo+s} (unnormalized)."""
    dv = vals.shape[2]
    vector = _vector_rows(vals) and _vector_rows(out)
    for j in range(p.shape[0]):
        pj = p[j]
        top = mx[j]
        t = np.float32(0)
        for s in range(n):
            e = exp_f32(pj[s] - top)
            pj[s] = e
            t += e
        tot[j] = t
    if vector:
        chunks = dv // LANES
        if chunks % 4 == 0:
            weigh_rows4(p, vals, group, lo, n, out)
        elif chunks % 2 == 0:
            weigh_rows2(p, vals, group, lo, n, out)
        else:
            weigh_rows1(p, vals, group, lo, n, out)
        return
    out[:, :] = 0
    for s in range(n):
        for h in range(vals.shape[1]):
            vr = vals[lo + s, h]
            for g in range(group):
                w = p[h * group + g, s]
                o = out[h * group + g]
                for i in range(dv):
                    o[i] += w * as_f32(vr[i])


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
    H = q.shape[0]
    lo, hi = _span(keys.shape[0], pos, k0, window)
    attend_one_into(q, keys, vals, pos, k0, scale, window, softcap, out, np.empty((H, padded(hi - lo)), np.float32),
                    np.empty(H, np.float32), np.empty(H, np.float32))


@numba.njit(**_FAST)
def attend_one_into(q, keys, vals, pos, k0, scale, window, softcap, out, p, mx, tot):  # pragma: no cover - compiled
    """:func:`attend_one` with the caller's scratch: scores p [H, ≥ padded(positions seen)], and
    mx, tot [H] (the batched step gives every sequence a slice of one allocation: three
    allocations per sequence and layer were a tenth of its attention at a hundred positions)."""
    H = q.shape[0]
    group = H // keys.shape[1]
    lo, hi = _span(keys.shape[0], pos, k0, window)
    _first_values(vals, lo, hi - lo)
    _scores(q, keys, group, lo, hi, np.float32(scale), np.float32(softcap), p, mx)
    _weigh(vals, group, lo, hi - lo, p, mx, tot, out)
    for j in range(H):
        inv = np.float32(1) / tot[j]
        for i in range(out.shape[1]):
            out[j, i] *= inv


@numba.njit(**_FAST)
def split_part(q, keys, vals, pos, k0, scale, window, softcap, nt, c, mx, tot, part):  # pragma: no cover - compiled
    """Part ``c`` of :func:`attend_one_par`: its heads' running max ``mx`` [H], exp sum ``tot``
    [H] and unnormalized output ``part`` [H, Dv] over the c-th of ``nt`` position ranges (left
    at −inf / 0 / 0 when the range is empty)."""
    H = q.shape[0]
    group = H // keys.shape[1]
    lo, hi = _span(keys.shape[0], pos, k0, window)
    a, b = chunk(hi - lo, nt, c, 1)
    mx[:] = -np.inf
    tot[:] = 0
    part[:, :] = 0
    if a < b:
        p = np.empty((H, padded(b - a)), np.float32)
        _first_values(vals, lo + a, b - a)
        _scores(q, keys, group, lo + a, lo + b, np.float32(scale), np.float32(softcap), p, mx)
        _weigh(vals, group, lo + a, b - a, p, mx, tot, part)


@numba.njit(**_FAST)
def split_combine(mx, tot, part, out):  # pragma: no cover - compiled
    """out [H, Dv] from the parts of :func:`split_part` (mx, tot [nt, H]; part [nt, H, Dv]),
    rescaled to the common max and summed in part order."""
    nt = mx.shape[0]
    for j in range(out.shape[0]):
        top = mx[0, j]
        for c in range(1, nt):
            top = max(top, mx[c, j])
        den = np.float32(0)
        out[j, :] = 0
        for c in range(nt):
            if tot[c, j] > 0:
                f = exp_f32(mx[c, j] - top)
                den += f * tot[c, j]
                for i in range(out.shape[1]):
                    out[j, i] += f * part[c, j, i]
        inv = np.float32(1) / den
        for i in range(out.shape[1]):
            out[j, i] *= inv


@numba.njit(parallel=True, **_FAST)
def attend_one_par(q, keys, vals, pos, k0, scale, window, softcap, out, nt):  # pragma: no cover - compiled
    """:func:`attend_one` with the cache split into ``nt`` position ranges, one per thread, each
    giving its heads' running max, exp sum and unnormalized output (:func:`split_part`); the
    partials are then rescaled to the common max and summed (:func:`split_combine`, as split-K
    "flash decoding" does). Every thread streams its own contiguous part of the cache."""
    H = q.shape[0]
    mx = np.empty((nt, H), np.float32)
    tot = np.empty((nt, H), np.float32)
    part = np.empty((nt, H, out.shape[1]), np.float32)
    for c in prange(nt):
        split_part(q, keys, vals, pos, k0, scale, window, softcap, nt, c, mx[c], tot[c], part[c])
    split_combine(mx, tot, part, out)


@numba.njit(**_EXACT)
def rope_append_attend(q, k, v, qn, kn, eps, cos, sin, K, V, n, pos, k0, scale, window, softcap, out,
                       attend):  # pragma: no cover - compiled
    """One token's attention after its q/k/v products, in one call: :func:`qk_norm_rope` on q
    and k, k and v written to cache entry ``n`` of K/V [cap, KV, ·], then (``attend``)
    :func:`attend_one` over entries [0, n] into ``out``. A token step made these three calls
    plus the cache append in Python (~15 µs a layer); the caller runs the parallel attention
    itself for long caches (``attend`` False)."""
    H = q.shape[0]
    w = padded(n + 1) if attend else 1
    rope_append_attend_into(q, k, v, qn, kn, eps, cos, sin, K, V, n, pos, k0, scale, window, softcap, out, attend,
                            np.empty((H, w), np.float32), np.empty(H, np.float32), np.empty(H, np.float32))


@numba.njit(**_EXACT)
def rope_append_attend_into(q, k, v, qn, kn, eps, cos, sin, K, V, n, pos, k0, scale, window, softcap, out, attend,
                            p, mx, tot):  # pragma: no cover - compiled
    """:func:`rope_append_attend` with the caller's attention scratch (:func:`attend_one_into`)."""
    qk_norm_rope(q, k, qn, kn, eps, cos, sin)
    put_entry(K[n], k)
    put_entry(V[n], v)
    if attend:
        attend_one_into(q, K[:n + 1], V[:n + 1], pos, k0, scale, window, softcap, out, p, mx, tot)


def attends_serially(q: np.ndarray, n_keys, nt: int):  # noqa: ANN001, ANN201 - int or int array
    """Whether one-token attention of q [H, D] over ``n_keys`` cache entries runs on one thread
    (short caches: a parallel region costs more than it saves, see PARALLEL_ATTEND); an array of
    key counts gives an array of answers (the batched step's sequences)."""
    return (q.shape[0] * n_keys * q.shape[1] < PARALLEL_ATTEND) | (nt <= 1)


def attend_decode(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, pos: int, k0: int, scale: float,
                  window: int | None, softcap: float | None, out: np.ndarray, nt: int | None = None) -> np.ndarray:
    """One-token attention into ``out`` [H, Dv]; parallel over KV heads for long caches."""
    nt = numba.get_num_threads() if nt is None else nt
    if not attends_serially(q, keys.shape[0], nt):
        attend_one_par(q, keys, vals, pos, k0, scale, int(window or 0), float(softcap or 0.0), out, nt)
    else:
        attend_one(q, keys, vals, pos, k0, scale, int(window or 0), float(softcap or 0.0), out)
    return out
