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

from ..cache import LayerKV
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


def _serial(q: np.ndarray, ns: np.ndarray, nt: int) -> np.ndarray:
    """Per sequence (cache entries before this token ``ns``), whether its attention runs on one
    thread: the one-token step's choice (``attends_serially``)."""
    if attends_serially(q[0], int(ns.max()) + 1, nt):  # the longest cache short: every one serial
        return _all_serial(ns.shape[0])  # short caches (the common case): no per-sequence test
    return attends_serially(q[0], ns + 1, nt)


def attend_batch(attend, q: np.ndarray, k: np.ndarray, v: np.ndarray, states: list, positions: list[int],  # noqa: ANN001
                 cos: np.ndarray, sin: np.ndarray, out: np.ndarray, nt: int) -> None:
    """Every sequence's one-token attention (``attend``: the layer's TokenAttention, whose constants
    it reads) into out [B, heads, v_dim]. q/k/v: [B, ·, ·] C-contiguous; states: each sequence's
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
    batch_rope_append_attend(q, k, v, attend.qn, attend.kn, attend.eps, cos, sin, kaddr, vaddr, caps, ns,
                             np.asarray(positions, np.int64), starts, attend.scale, attend.window, attend.softcap,
                             _serial(q, ns, nt), out, _LIKE[kind], max(int(nt), 1))
    for kv in states:
        kv.n += 1


class StepCaches:
    """A decode step's caches as :func:`batch_rope_append_attend` reads them, kept across steps.

    :func:`attend_batch` gathered every sequence's entries, capacity, addresses and first position
    in Python at every layer (~10 µs a layer at 16 sequences, 0.3 ms of a step). Here a layer's
    capacities and addresses are [B] arrays made once and kept while the same caches come back and
    no cache array anywhere was replaced (:attr:`~cmf.runtime.cache.LayerKV.moves`), with room
    reserved ahead; the entries are the positions (a cache keeping every entry holds exactly its
    position's count, from entry 0: checked whenever a layer's arrays are gathered) and the
    serial/split choice is made once a step."""

    RESERVE = 64  # entries reserved past the position when a layer's arrays are gathered

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._rows: dict = {}  # layer index -> (capacities, key addresses, value addresses, dtype)
        self._floor = np.zeros(0, np.int64)  # per sequence, the least capacity over the kept layers
        self.ns = self.starts = np.zeros(0, np.int64)
        self._serial: dict = {}

    def start(self, caches: list, positions: np.ndarray) -> None:
        """Begin a step over ``caches`` at ``positions`` (int64 [B])."""
        key = (tuple(map(id, caches)), LayerKV.moves)
        if key != self._key or bool((positions >= self._floor).any()):
            self._key, self._rows = key, {}
            self._floor = np.full(len(caches), np.iinfo(np.int64).max, np.int64)
        if self.starts.shape[0] != len(caches):
            self.starts = np.zeros(len(caches), np.int64)
        self.ns, self._serial = positions, {}

    def layer(self, i: int, states: list) -> tuple | None:
        """(capacities, key addresses, value addresses, dtype) of layer ``i``'s caches, or None
        when one of them is not a LayerKV holding exactly its position's entries from entry 0
        (the caller then takes :func:`attend_batch`)."""
        hit = self._rows.get(i)
        if hit is not None:
            return hit
        kind = states[0].dtype
        for kv, n in zip(states, self.ns.tolist()):
            if type(kv) is not LayerKV or kv.window is not None or kv.n != n or kv.start != 0:
                return None
            if kv.dtype != kind:  # the compiled call reads every cache by address as one dtype
                raise ValueError(f"a decode batch mixes KV cache types ({kind} and {kv.dtype})")
            if kv.capacity <= n:
                kv.reserve(self.RESERVE + 1)
        caps = np.array([kv.capacity for kv in states], np.int64)
        hit = self._rows[i] = (caps, np.array([kv.k_addr for kv in states], np.int64),
                               np.array([kv.v_addr for kv in states], np.int64), kind)
        np.minimum(self._floor, caps, out=self._floor)
        self._key = (self._key[0], LayerKV.moves)  # this step's own reservations moved arrays it now holds
        return hit

    def serial(self, q: np.ndarray, nt: int) -> np.ndarray:
        """:func:`_serial` of this step's entries, once per query shape."""
        key = q.shape[1:]
        hit = self._serial.get(key)
        if hit is None:
            hit = self._serial[key] = _serial(q, self.ns, nt)
        return hit


def attend_step(attend, q: np.ndarray, k: np.ndarray, v: np.ndarray, states: list, rows: tuple,  # noqa: ANN001
                steps: StepCaches, cos: np.ndarray, sin: np.ndarray, out: np.ndarray, nt: int) -> None:
    """:func:`attend_batch` over a layer's gathered caches (``rows``: :meth:`StepCaches.layer`)."""
    caps, kaddr, vaddr, kind = rows
    batch_rope_append_attend(q, k, v, attend.qn, attend.kn, attend.eps, cos, sin, kaddr, vaddr, caps, steps.ns,
                             steps.ns, steps.starts, attend.scale, attend.window, attend.softcap,
                             steps.serial(q, nt), out, _LIKE[kind], max(int(nt), 1))
    for kv in states:
        kv.n += 1


__all__ = ["StepCaches", "attend_batch", "attend_step", "batch_rope_append_attend"]
