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
from numba import prange, types
from numba.extending import intrinsic

from .decode import attend_decode, attends_serially, rope_append_attend

_OPTS = {"cache": True, "nogil": True, "error_model": "numpy"}


@intrinsic
def _f32_at(typingctx, addr):  # noqa: ANN001
    """The float32 pointer at an address (an int64)."""
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@numba.njit(parallel=True, **_OPTS)
def batch_rope_append_attend(Q, Kn, Vn, qn, kn, eps, cos, sin, kaddr, vaddr, caps, ns, poss, starts, scale, window,
                             softcap, serial, out):  # pragma: no cover - compiled
    """For every b: rope_append_attend(Q[b], Kn[b], Vn[b], …, K_b, V_b, ns[b], poss[b], starts[b], …,
    out[b], serial[b]) with K_b / V_b the [caps[b], kv_heads, ·] float32 arrays at kaddr[b] / vaddr[b]."""
    kvh, hd, vd = Kn.shape[1], Kn.shape[2], Vn.shape[2]
    for b in prange(Q.shape[0]):
        K = numba.carray(_f32_at(kaddr[b]), (caps[b], kvh, hd))
        V = numba.carray(_f32_at(vaddr[b]), (caps[b], kvh, vd))
        rope_append_attend(Q[b], Kn[b], Vn[b], qn, kn, eps, cos[b], sin[b], K, V, ns[b], poss[b], starts[b], scale,
                           window, softcap, out[b], serial[b])


def attend_batch(attend, q: np.ndarray, k: np.ndarray, v: np.ndarray, states: list, positions: list[int],  # noqa: ANN001
                 cos: np.ndarray, sin: np.ndarray, out: np.ndarray, nt: int) -> None:
    """Every sequence's one-token attention (``attend``: the layer's TokenAttention, whose constants
    it reads) into out [B, heads, v_dim]. q/k/v: [B, ·, ·] C-contiguous; states: each sequence's
    LayerKV (all keeping every entry: the caller checks); cos/sin: [B, rotary_dim] at each position."""
    for kv in states:
        if kv.n + 1 > kv.k.shape[0]:
            kv.reserve(1)
    ns = np.array([kv.n for kv in states], np.int64)
    caps = np.array([kv.k.shape[0] for kv in states], np.int64)
    kaddr = np.array([kv.k_addr for kv in states], np.int64)
    vaddr = np.array([kv.v_addr for kv in states], np.int64)
    serial = attends_serially(q[0], ns + 1, nt)  # the one-token step's choice, per sequence
    batch_rope_append_attend(q, k, v, attend.qn, attend.kn, attend.eps, cos, sin, kaddr, vaddr, caps, ns,
                             np.asarray(positions, np.int64), np.array([kv.start for kv in states], np.int64),
                             attend.scale, attend.window, attend.softcap, serial, out)
    for i, kv in enumerate(states):
        kv.n = int(ns[i]) + 1
        if not serial[i]:  # a long cache: the parallel attention, as the sequence gets alone
            attend_decode(q[i], kv.k[:kv.n], kv.v[:kv.n], positions[i], kv.start, attend.scale, attend.window,
                          attend.softcap, out[i], nt)


__all__ = ["attend_batch", "batch_rope_append_attend"]
