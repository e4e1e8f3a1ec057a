"""The one-token decode step: fused products into buffers allocated once per layer.

A decoded token costs one pass over the weights plus, per layer, the calls that drive it. The
generic path (``Block.__call__``) allocates every intermediate and runs one parallel region per
matrix; here a dense layer is seven calls into compiled code — q/k/v in one parallel region,
q/k norm + RoPE + the KV append + attention in one kernel, o, gate/up with the activation in one
region, down — writing into buffers that live as long as the layer. The fused calls compose the
operator bodies of ``ops/decode.py`` (the RMSNorm and RoPE that blocks of tokens run too, and
the one-token attention), never copies of them; the common layer binds its products once
(``kernels/bound.py``) and, where it can, runs as one compiled call (``layer_step.py``). Under a
task mask on FFN neurons the same calls
run on the mask's gathered matrices. Features this path does not cover
(output gates, ``g_proj``, MoE, MLA, linear attention) run the generic code for that part only,
with identical results.
"""

from __future__ import annotations

import numpy as np

from ..kernels.bound import prebind, run_bound
from ..kernels.gemv import ACTS, MatvecGroup
from .cache import LayerKV
from .layer_step import bind_layer, layer_step
from .schedule import run_layer
from .ops.decode import (add_into, add_norm_into, attend_decode, attends_serially, norm_into, qk_norm_rope,
                         rms_norm_into, rope_append_attend)

_EMPTY = np.zeros(0, np.float32)
_ROPE: dict[tuple[int, int], tuple[object, np.ndarray, np.ndarray]] = {}
_ROPE_MAX = 1 << 14  # (profile, position) entries kept: positions recur across layers, sequences, requests


def _sum_into(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x += y (the step's residual, in its caller's array); returns x."""
    x += y
    return x


def rope_at(profile, pos: int) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001 - a RopeProfile
    """cos, sin [rotary_dim] at one position, from a bounded table shared by every layer and
    sequence that uses ``profile`` (the one-token step and the batched step alike)."""
    key = (id(profile), pos)
    hit = _ROPE.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1], hit[2]
    cos, sin = profile.cos_sin(np.array([pos]))
    cos, sin = np.ascontiguousarray(cos[0]), np.ascontiguousarray(sin[0])
    if len(_ROPE) >= _ROPE_MAX:
        _ROPE.clear()
    _ROPE[key] = (profile, cos, sin)
    return cos, sin


class TokenAttention:
    """One token's attention for one layer (a cache per call): q/k norm + RoPE of ``q`` [heads, d]
    and ``k`` [kv_heads, d] in place, their append to the cache and attention over it into
    ``out`` [heads, v_dim]. A cache that keeps every entry is written in place by one fused
    kernel (from ~500 positions the attention itself runs again on ``nt`` threads); a sliding
    window appends through ``kv.append``, which drops old entries. The one-token step and every
    row of the batched step call this one object per layer; its constants are read once."""

    __slots__ = ("rope", "eps", "qn", "kn", "scale", "window", "softcap")

    def __init__(self, attn) -> None:  # noqa: ANN001 - blocks.Attention
        a = attn.a
        self.rope, self.eps = a.rope, attn.eps
        self.qn = attn.qn if attn.qn is not None else _EMPTY
        self.kn = attn.kn if attn.kn is not None else _EMPTY
        self.scale, self.window, self.softcap = float(a.scale), int(a.window or 0), float(a.softcap or 0.0)

    def slot(self, q: np.ndarray, kv: LayerKV, pos: int, nt: int) -> tuple:
        """For a cache that keeps every entry: (cos, sin) at ``pos``, the entry ``n`` the token
        goes to (room reserved) and whether attention over entries [0, n] runs on this thread."""
        cos, sin = rope_at(self.rope, pos)
        n = kv.reserve(1)
        return cos, sin, n, attends_serially(q, n + 1, nt)

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, kv, pos: int, out: np.ndarray,  # noqa: ANN001
                 nt: int) -> None:
        if type(kv) is LayerKV and kv.window is None:
            cos, sin, n, serial = self.slot(q, kv, pos, nt)
            rope_append_attend(q, k, v, self.qn, self.kn, self.eps, cos, sin, kv.k, kv.v, n, pos, kv.start,
                               self.scale, self.window, self.softcap, out, serial)
            kv.n = n + 1
            if not serial:
                attend_decode(q, kv.k[:n + 1], kv.v[:n + 1], pos, kv.start, self.scale, self.window, self.softcap,
                              out, nt)
            return
        cos, sin = rope_at(self.rope, pos)
        qk_norm_rope(q, k, self.qn, self.kn, self.eps, cos, sin)
        keys, vals, k0 = kv.append(k[None], v[None])
        attend_decode(q, keys, vals, pos, k0, self.scale, self.window, self.softcap, out, nt)


class AttnStep:
    """Grouped-query attention of one token: fused q/k/v, cache append, attention, o."""

    def __init__(self, attn) -> None:  # noqa: ANN001 - blocks.Attention
        a = attn.a
        self.attn, self.a = attn, a
        self.qkv = MatvecGroup([attn.q, attn.k, attn.v])
        self.o = MatvecGroup([attn.o])
        self.nq, self.nk = a.heads * a.head_dim, a.kv_heads * a.head_dim
        self.buf = np.empty((1, self.qkv.out_features), np.float32)
        self.att = np.empty((a.heads, a.v_head_dim), np.float32)
        self.bias = None
        if attn.qb is not None or attn.kb is not None or attn.vb is not None:
            parts = [b if b is not None else np.zeros(n, np.float32) for b, n in
                     ((attn.qb, self.nq), (attn.kb, self.nk), (attn.vb, a.kv_heads * a.v_head_dim))]
            self.bias = np.concatenate(parts).astype(np.float32)[None]
        # views of ``buf`` made once (a token step would otherwise slice and reshape per layer)
        row = self.buf[0]
        self.q = row[:self.nq].reshape(a.heads, a.head_dim)
        self.k = row[self.nq:self.nq + self.nk].reshape(a.kv_heads, a.head_dim)
        self.v = row[self.nq + self.nk:].reshape(a.kv_heads, a.v_head_dim)
        self.att2d = self.att.reshape(1, -1)
        self.attend = TokenAttention(attn)

    @staticmethod
    def supports(attn) -> bool:  # noqa: ANN001
        a = attn.a
        return not a.output_gate and attn.g is None

    def __call__(self, h: np.ndarray, kv, pos: int, out: np.ndarray, nt: int) -> np.ndarray:  # noqa: ANN001
        attn = self.attn
        self.qkv(h, self.buf, nt)
        if self.bias is not None:
            self.buf += self.bias
        self.attend(self.q, self.k, self.v, kv, pos, self.att, nt)
        if attn.head_keep is not None:
            self.att[~attn.head_keep] = 0
        self.o(self.att2d, out, nt)
        if attn.ob is not None:
            out += attn.ob
        return out


class FfnStep:
    """Dense gated FFN of one token: gate/up and the activation in one region, then down. Under
    a task mask the same two calls run on the mask's gathered matrices (``DenseFfn.live``)."""

    def __init__(self, ffn) -> None:  # noqa: ANN001 - blocks.DenseFfn
        self.ffn = ffn
        self.gate_up = MatvecGroup([ffn.gate, ffn.up], act=ffn.act_name)
        self.down = MatvecGroup([ffn.down])
        self.buf = np.empty((1, self.gate_up.out_features), np.float32)
        self.gated = self.buf[:, :self.gate_up.width]  # act(gate)·up: the down projection's input
        self._unmasked = (self.gate_up, self.down, self.buf, self.gated, None, None)
        self._masked: tuple = (None, None)  # (the LiveFfn, its products and buffers, or None)

    @staticmethod
    def supports(ffn) -> bool:  # noqa: ANN001
        return ffn.act_name in ACTS and ffn.gate.out_features == ffn.up.out_features

    def products(self) -> tuple | None:
        """What the FFN runs now: (gate/up group, down group, the gate/up buffer, its act(g)·u
        half, down's scattered input or None, the live positions in it or None), or None for the
        generic path (a mask whose gate or up could not be gathered, or no live neuron)."""
        ffn = self.ffn
        if ffn._live is None:
            return self._unmasked
        lf = ffn.live() if ffn._live.size else None
        if self._masked[0] is not lf:
            self._masked = (lf, self._live_products(lf))
        return self._masked[1]

    def __call__(self, h: np.ndarray, out: np.ndarray, nt: int) -> np.ndarray:
        prod = self.products()
        if prod is None:
            out[...] = self.ffn(h)
            return out
        gate_up, down, buf, gated, x, pos = prod
        gate_up(h, buf, nt)
        if pos is not None:  # group-gathered down columns: live activations at their positions
            x[0, pos] = gated[0]
            gated = x
        return down(gated, out, nt)

    def _live_products(self, lf) -> tuple | None:  # noqa: ANN001 - a blocks.LiveFfn
        if lf is None or lf.gate is None or lf.up is None:
            return None
        gate_up = MatvecGroup([lf.gate, lf.up], act=self.ffn.act_name)
        buf = np.empty((1, gate_up.out_features), np.float32)
        # zeros stay at the dead neurons' positions: only live positions are written per token
        x = np.zeros((1, lf.down.in_features), np.float32) if lf.positions is not None else None
        return gate_up, MatvecGroup([lf.down]), buf, buf[:, :gate_up.width], x, lf.positions


class BlockStep:
    """Per-layer buffers and the fused parts of one decoder layer."""

    def __init__(self, block, n: int, attention: bool, dense_ffn: bool) -> None:  # noqa: ANN001 - blocks.Block
        """``attention`` / ``dense_ffn``: whether the block's mixer is a blocks.Attention and its FFN
        a blocks.DenseFfn (the caller knows its classes; this module does not import blocks)."""
        self.block = block
        self.h = np.empty((1, n), np.float32)
        self.a = np.empty((1, n), np.float32)
        self.f = np.empty((1, n), np.float32)
        m, f = block.mixer, block.ffn
        self.attn = AttnStep(m) if attention and AttnStep.supports(m) else None
        self.ffn = FfnStep(f) if dense_ffn and FfnStep.supports(f) else None
        self._bound: tuple = (0, None, None)  # (threads, the FFN's products, the bound calls of _bind)

    def _bind(self, nt: int, ffn: tuple | None) -> tuple | None:
        """The four products' (function, arguments) with this layer's buffers bound, when the
        whole layer can run as :meth:`_plain` (``ffn``: the FFN's current products), the
        scatter of a masked down's input (or None) and the layer's ``layer_step.LayerArgs``
        when it can run as one compiled call (or None); else None."""
        b, at = self.block, self.attn
        if at is None or ffn is None or b.plan.sandwich or b.n_in is None or b.n_post_attn is None:
            return None
        gate_up, down, buf, gated, x, pos = ffn
        # a masked down that takes its live activations at positions: scattered into x first
        scatter = None if pos is None else (x[0], pos, gated[0])
        calls = (at.qkv.bind(self.h, at.buf, nt), at.o.bind(at.att2d, self.a, nt),
                 gate_up.bind(self.h, buf, nt), down.bind(gated if x is None else x, self.f, nt))
        if any(c is None for c in calls):
            return None
        calls = tuple(prebind(c) for c in calls)
        # the whole layer as one compiled call where it has nothing the fused call leaves out
        one = scatter is None and at.bias is None and at.attn.ob is None and all(c[0] is run_bound for c in calls)
        return (*calls, scatter, bind_layer(b, self.h, self.a, self.f, at, calls) if one else None)

    def bound(self, nt: int) -> tuple | None:
        """:meth:`_bind`'s calls for ``nt`` threads and the FFN's current products (bound again
        when either changed since the last call)."""
        ffn = self.ffn.products() if self.ffn is not None else None
        if self._bound[0] != nt or self._bound[1] is not ffn:  # new thread count or task mask
            self._bound = (nt, ffn, self._bind(nt, ffn))
        return self._bound[2]

    def layer_args(self, nt: int):  # noqa: ANN201 - a layer_step.LayerArgs or None
        """The one-call layer's arguments (``layer_step.LayerArgs``) when this layer runs as one
        compiled call on ``nt`` threads — bound, no head mask — else None."""
        calls = self.bound(nt)
        if calls is None or calls[5] is None or self.attn.attn.head_keep is not None:
            return None
        return calls[5]

    def __call__(self, x: np.ndarray, state, pos: int, nt: int) -> np.ndarray:  # noqa: ANN001
        """Advance x [1, hidden] through the layer in place (``nt``: threads for the products)."""
        calls = self.bound(nt)
        if (calls is not None and type(state) is LayerKV and state.window is None
                and self.attn.attn.head_keep is None):
            return self._plain(x, state, pos, nt, calls)
        b = self.block
        eps, slots = b.eps, {"h": self.h, "a": self.a, "f": self.f}
        if self.attn is not None:
            mix = lambda h: self.attn(h, state, pos, self.a, nt)  # noqa: E731
        else:
            mix = lambda h: b.mixer(h, state, pos)  # noqa: E731
        ffn = (lambda h: self.ffn(h, self.f, nt)) if self.ffn is not None else b.ffn
        return run_layer(b, x, mix, ffn, lambda v, w, slot: norm_into(v, w, eps, slots[slot]), _sum_into)

    def _plain(self, x: np.ndarray, kv: LayerKV, pos: int, nt: int, calls: tuple) -> np.ndarray:
        """The common layer (pre-norms, attention over a growing cache, gated FFN) as the same
        compiled calls as the general path in :meth:`__call__` — same values — with the Python
        between them cut to the minimum: run right after the weight stream, that Python finds
        its own objects evicted from cache and cost ~30 µs a layer (~0.2 ms a token saved)."""
        b, at = self.block, self.attn
        (qkv, qkv_args), (o, o_args), (gate_up, gate_up_args), (down, down_args), scatter, layer = calls
        if layer is not None:
            cos, sin, n, serial = at.attend.slot(at.q, kv, pos, nt)
            if serial:
                layer_step(layer, x, cos, sin, kv.k, kv.v, n, pos, kv.start)
                kv.n = n + 1
                return x
        rms_norm_into(x, b.n_in, b.eps, self.h)
        qkv(*qkv_args)
        if at.bias is not None:
            at.buf += at.bias
        at.attend(at.q, at.k, at.v, kv, pos, at.att, nt)
        o(*o_args)
        if at.attn.ob is not None:
            self.a += at.attn.ob
        add_norm_into(x, self.a, b.n_post_attn, b.eps, self.h)
        gate_up(*gate_up_args)
        if scatter is not None:
            scatter[0][scatter[1]] = scatter[2]
        down(*down_args)
        add_into(x, self.f)
        return x
