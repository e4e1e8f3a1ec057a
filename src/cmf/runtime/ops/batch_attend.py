"""One decode step's attention for every sequence of a batch in one compiled call.

The batched step ran :class:`~cmf.runtime.step.TokenAttention` once per sequence and layer: at 16
sequences 480 Python calls of ~13 µs each (SmolLM2-135M, 30 layers), 6 ms of a 24 ms step, where
the attention arithmetic itself over a few hundred cached positions is ~2 µs. Here one call per
layer runs, for each sequence on its own thread, exactly the one-token step's
:func:`~cmf.runtime.ops.decode.rope_append_attend` (q/k norm, RoPE, the cache write, attention
over entries [0, n]) on that sequence's own cache arrays, so each row is bit for bit what it gets
alone. The caches are separate numpy arrays of different lengths; the call takes their addresses
(an int64 array) and views them as arrays inside (``numba.carray``), while the caller keeps them
alive. Sequences whose cache is long enough for the one-token step to split attention across
threads (``attends_serially`` false) get that split inside the same call: their position ranges
run as tasks of one parallel loop and are combined as ``attend_one_par`` combines them, so each
is bit for bit what it gets alone — where a Python loop of one parallel region per sequence and
layer took ~60% of a 16-sequence step at 1,000 positions.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .decode import attends_serially, padded, rope_append_attend_into, split_combine, split_part
from .kv_values import pointer_at

_OPTS = {"cache": True, "nogil": True, "error_model": "numpy"}
_LIKE = {"f32": np.empty(0, np.float32), "f16": np.empty(0, np.uint16)}  # a cache's element type, as an argument
_SERIAL: dict[int, np.ndarray] = {}


def _all_serial(n: int) -> np.ndarray:
    """An all-True flag array of n sequences (made once per batch size; never written)."""
    a = _SERIAL.get(n)
    if a is None:
        a = _SERIAL[n] = np.ones(n, np.bool_)
    return a


@numba.njit(parallel=True, **_OPTS)
def batch_rope_append_attend(Q, Kn, Vn, qn, kn, eps, cos, sin, kaddr, vaddr, caps, ns, poss, starts, scale, window,
                             softcap, serial, out, like, nt):  # pragma: no cover - compiled
    """For every b: rope_append_attend(Q[b], Kn[b], Vn[b], …, K_b, V_b, ns[b], poss[b], starts[b], …,
    out[b], serial[b]) with K_b / V_b the [caps[b], kv_heads, ·] arrays at kaddr[b] / vaddr[b], of
    ``like``'s dtype (float32, or uint16 f16 bits). A sequence whose one-token step would split its
    attention over ``nt`` threads (``serial[b]`` false) gets that split here: its ``nt`` parts
    (``decode.split_part``) run as tasks beside the other long sequences' parts, then each is
    combined (``decode.split_combine``) — the arithmetic of ``attend_one_par``, so the same bits,
    without a parallel region per sequence."""
    kvh, hd, vd = Kn.shape[1], Kn.shape[2], Vn.shape[2]
    B, H = Q.shape[0], Q.shape[1]
    width, nlong = 1, 0  # the serial sequences' longest score row; how many split
    for b in range(B):
        if serial[b]:
            width = max(width, padded(ns[b] + 1))
        else:
            nlong += 1
    p = np.empty((B, H, width), np.float32)  # every serial sequence's scratch, one allocation
    mx1 = np.empty((B, H), np.float32)
    tot1 = np.empty((B, H), np.float32)
    for b in prange(B):
        K = numba.carray(pointer_at(kaddr[b], like), (caps[b], kvh, hd))
        V = numba.carray(pointer_at(vaddr[b], like), (caps[b], kvh, vd))
        rope_append_attend_into(Q[b], Kn[b], Vn[b], qn, kn, eps, cos[b], sin[b], K, V, ns[b], poss[b], starts[b],
                                scale, window, softcap, out[b], serial[b], p[b], mx1[b], tot1[b])
    if nlong == 0:
        return
    long = np.flatnonzero(~serial)
    mx = np.empty((long.shape[0], nt, H), np.float32)
    tot = np.empty((long.shape[0], nt, H), np.float32)
    part = np.empty((long.shape[0], nt, H, vd), np.float32)
    for task in prange(long.shape[0] * nt):
        i, c = task // nt, task % nt
        b = long[i]
        K = numba.carray(pointer_at(kaddr[b], like), (caps[b], kvh, hd))
        V = numba.carray(pointer_at(vaddr[b], like), (caps[b], kvh, vd))
        n = ns[b] + 1
        split_part(Q[b], K[:n], V[:n], poss[b], starts[b], scale, window, softcap, nt, c, mx[i, c], tot[i, c],
                   part[i, c])
    for i in prange(long.shape[0]):
        split_combine(mx[i], tot[i], part[i], out[long[i]])


def attend_batch(attend, q: np.ndarray, k: np.ndarray, v: np.ndarray, states: list, positions: list[int],  # noqa: ANN001
                 cos: np.ndarray, sin: np.ndarray, out: np.ndarray, nt: int) -> None:
    """Every sequence's one-token attention (``attend``: the layer's TokenAttention, whose constants
    it reads) into out [B, heads, v_dim]. q/k/v: [B, ·, ·] with each head's row contiguous (views
    of the batch's q/k/v product: q and k are normalized and rotated in place); states: each sequence's
    LayerKV (all keeping every entry: the caller checks; one storage type: checked here); cos/sin:
    [B, rotary_dim] at each position."""
    kind = states[0].dtype
    meta: list[int] = []  # per sequence: entries, capacity, key and value addresses, first position
    for kv in states:
        if kv.dtype != kind:  # the compiled call reads every cache by address as one dtype
            raise ValueError(f"a decode batch mixes KV cache types ({kind} and {kv.dtype})")
        if kv.n >= kv.capacity:
            kv.reserve(1)
        meta += (kv.n, kv.capacity, kv.k_addr, kv.v_addr, kv.start)
    ns, caps, kaddr, vaddr, starts = np.array(meta, np.int64).reshape(-1, 5).T.copy()
    if attends_serially(q[0], max(meta[::5]) + 1, nt):  # the longest cache short: every one serial
        serial = _all_serial(len(states))  # short caches (the common case): no per-sequence test
    else:
        serial = attends_serially(q[0], ns + 1, nt)  # the one-token step's choice, per sequence
    batch_rope_append_attend(q, k, v, attend.qn, attend.kn, attend.eps, cos, sin, kaddr, vaddr, caps, ns,
                             np.asarray(positions, np.int64), starts, attend.scale, attend.window, attend.softcap,
                             serial, out, _LIKE[kind], max(int(nt), 1))
    for kv in states:
        kv.n += 1


__all__ = ["attend_batch", "batch_rope_append_attend"]
