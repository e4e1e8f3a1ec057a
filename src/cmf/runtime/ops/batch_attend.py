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
threads (``attends_serially`` false) get only the write here and their attention from
:func:`~cmf.runtime.ops.decode.attend_decode` afterwards, as alone.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .decode import PARALLEL_ATTEND, attend_decode, attends_serially, rope_append_attend
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
                             softcap, serial, out, like):  # pragma: no cover - compiled
    """For every b: rope_append_attend(Q[b], Kn[b], Vn[b], …, K_b, V_b, ns[b], poss[b], starts[b], …,
    out[b], serial[b]) with K_b / V_b the [caps[b], kv_heads, ·] arrays at kaddr[b] / vaddr[b], of
    ``like``'s dtype (float32, or uint16 f16 bits)."""
    kvh, hd, vd = Kn.shape[1], Kn.shape[2], Vn.shape[2]
    for b in prange(Q.shape[0]):
        K = numba.carray(pointer_at(kaddr[b], like), (caps[b], kvh, hd))
        V = numba.carray(pointer_at(vaddr[b], like), (caps[b], kvh, vd))
        rope_append_attend(Q[b], Kn[b], Vn[b], qn, kn, eps, cos[b], sin[b], K, V, ns[b], poss[b], starts[b], scale,
                           window, softcap, out[b], serial[b])


def attend_batch(attend, q: np.ndarray, k: np.ndarray, v: np.ndarray, states: list, positions: list[int],  # noqa: ANN001
                 cos: np.ndarray, sin: np.ndarray, out: np.ndarray, nt: int) -> None:
    """Every sequence's one-token attention (``attend``: the layer's TokenAttention, whose constants
    it reads) into out [B, heads, v_dim]. q/k/v: [B, ·, ·] C-contiguous; states: each sequence's
    LayerKV (all keeping every entry and of one storage type: the caller checks); cos/sin: [B, rotary_dim] at each position."""
    kind = states[0].dtype
    meta: list[int] = []  # per sequence: entries, capacity, key and value addresses, first position
    for kv in states:
        if kv.dtype != kind:  # the compiled call reads every cache by address as one dtype
            raise ValueError(f"a decode batch mixes KV cache types ({kind} and {kv.dtype})")
        cap = kv._k.shape[0]
        if kv.n >= cap:
            kv.reserve(1)
            cap = kv._k.shape[0]
        meta += (kv.n, cap, kv.k_addr, kv.v_addr, kv.start)
    ns, caps, kaddr, vaddr, starts = np.array(meta, np.int64).reshape(-1, 5).T.copy()
    if nt <= 1 or q.shape[1] * q.shape[2] * (max(meta[::5]) + 1) < PARALLEL_ATTEND:
        serial = _all_serial(len(states))  # short caches (the common case): no per-sequence test
    else:
        serial = attends_serially(q[0], ns + 1, nt)  # the one-token step's choice, per sequence
    batch_rope_append_attend(q, k, v, attend.qn, attend.kn, attend.eps, cos, sin, kaddr, vaddr, caps, ns,
                             np.asarray(positions, np.int64), starts, attend.scale, attend.window, attend.softcap,
                             serial, out, _LIKE[kind])
    for kv in states:
        kv.n += 1
    if not serial.all():
        for i in np.flatnonzero(~serial):  # a long cache: the parallel attention, as the sequence gets alone
            kv = states[i]
            attend_decode(q[i], kv.k[:kv.n], kv.v[:kv.n], positions[i], kv.start, attend.scale, attend.window,
                          attend.softcap, out[i], nt)


__all__ = ["attend_batch", "batch_rope_append_attend"]
