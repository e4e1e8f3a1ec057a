"""Executable layers assembled from LayerPlans: token mixers, FFNs and the decoder block.

Each mixer owns its per-sequence state type (``new_state()``): a KV cache for GQA, a latent cache
for MLA, conv + recurrent state for Gated DeltaNet. Matrices are LinearOps over the stored bytes
(``Weights.linear``); expert matrices are prepared on first selection only, so experts that are
never routed to are never read.
"""

from __future__ import annotations

import numba
import numpy as np

from .cache import LayerKV, LinearState
from .ops import attention_block, gdn
from .ops.activations import activation
from .ops.attention import attend
from .ops.decode import attend_decode
from .ops.linear import mm
from .ops.rowwise import gated_act, qk_norm_rope_rows, rms_norm_rows, rope_rows
from ..kernels.gemv import ACTS
from .ops.mla import deinterleave, latent_attend
from .ops.moe import expert_counts, expert_mix, route
from .ops.norm import prepare_norm_weight
from .plan import AttentionPlan, FfnPlan, GdnPlan, LayerPlan, MlaPlan, MoePlan
from .schedule import run_layer
from .step import BlockStep
from .weights import Weights


# Query blocks at least this long use the per-thread sgemm attention (ops/attention_block.py).
BLOCKED_ATTENTION_T = 8


def attend_rows(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, pos0: int, k0: int, scale: float,
                window: int | None, softcap: float | None) -> np.ndarray:
    """Attention of a short query block (fewer than BLOCKED_ATTENTION_T rows: a speculative
    draft being verified, an MTP step, a one-token forward) through the one-token decode kernel,
    row by row: each row gets exactly what the token step computes at its position, and no
    numpy temporaries of [KV, G, T, S]."""
    t, h, _ = q.shape
    out = np.empty((t, h, vals.shape[-1]), np.float32)
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    vals = np.ascontiguousarray(vals, dtype=np.float32)
    for r in range(t):
        n = pos0 + r - k0 + 1  # the cache as the token step at this position holds it
        attend_decode(q[r], keys[:n], vals[:n], pos0 + r, k0, scale, window, softcap, out[r])
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def _new_sum(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A residual sum as a new array (a block's input belongs to its caller)."""
    return x + y


def _heads_off(out: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """Zero the masked heads of an attention output [T, heads, d] (a task mask's head bitfield)."""
    return out if keep is None else np.where(keep[None, :, None], out, np.float32(0))


class _Norms:
    """Norm weights prepared once (the gemma ``1 + w`` folded in)."""

    def __init__(self, w: Weights, gemma: bool) -> None:
        self.w, self.gemma = w, gemma

    def __call__(self, name: str | None) -> np.ndarray | None:
        return prepare_norm_weight(self.w.vector(name), self.gemma) if name else None


def int8_group(ops: list, act: str | None = None):  # noqa: ANN201 - a kernels.q8i.Int8Group or None
    """One product for matrices sharing an input when all run q8 with int8 activations (the input
    quantized once, one parallel region; with ``act`` the gated activation in the first half), else
    None. A prompt block's q/k/v and gate/up went through one product each, each quantizing x."""
    if not all(getattr(o, "group_family", None) == "q8i" for o in ops):
        return None
    from ..kernels.q8i import Int8Group

    return Int8Group([o.int8_mats() for o in ops], ops[0].in_features, ACTS[act] if act else -1,
                     ops[0].out_features if act else 0)


class Attention:
    """Grouped-query attention with the optional biases, q/k norms, output gate and g_proj gate."""

    def __init__(self, a: AttentionPlan, w: Weights, norm: _Norms, eps: float) -> None:
        self.a, self.eps = a, eps
        self.q, self.k, self.v, self.o = w.linear(a.q), w.linear(a.k), w.linear(a.v), w.linear(a.o)
        self.qb, self.kb, self.vb, self.ob = (w.vector(n) for n in (a.q_bias, a.k_bias, a.v_bias, a.o_bias))
        self.qn, self.kn = norm(a.q_norm), norm(a.k_norm)
        self.g = w.linear(a.g_proj) if a.g_proj else None
        self.head_keep: np.ndarray | None = None  # task mask: bool per head, None = all heads
        self._qkv = False  # int8_group of q/k/v (made on the first block of tokens; None: none)

    def new_state(self, kv_cache: str = "f32") -> LayerKV:
        return LayerKV(self.a.kv_heads, self.a.head_dim, self.a.window, self.a.v_head_dim, kv_cache)

    def __call__(self, h: np.ndarray, kv: LayerKV, pos0: int) -> np.ndarray:
        a = self.a
        t = h.shape[0]
        if self._qkv is False:
            self._qkv = None if a.output_gate else int8_group([self.q, self.k, self.v])
        if t > 1 and self._qkv is not None:  # one product (no output gate: checked when made)
            y = self._qkv.run(h, np.empty((t, self._qkv.out_features), np.float32), numba.get_num_threads())
            nq, nk = a.heads * a.head_dim, a.kv_heads * a.head_dim
            q, k, v = y[:, :nq], y[:, nq:nq + nk], y[:, nq + nk:]
        else:
            q, k, v = mm(self.q, h), mm(self.k, h), mm(self.v, h)
        if self.qb is not None:
            q += self.qb
        gate = None
        if a.output_gate:
            q = q.reshape(t, a.heads, 2 * a.head_dim)
            q, gate = np.ascontiguousarray(q[..., :a.head_dim]), q[..., a.head_dim:]
        else:
            q = q.reshape(t, a.heads, a.head_dim)
        if self.kb is not None:
            k += self.kb
        k = k.reshape(t, a.kv_heads, a.head_dim)
        if self.vb is not None:
            v += self.vb
        v = v.reshape(t, a.kv_heads, a.v_head_dim)
        cos, sin = a.rope.cos_sin_at(pos0, t)
        # q and k are this call's own arrays (fresh products): normalized and rotated in place
        q, k = np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(k, dtype=np.float32)
        qk_norm_rope_rows(q, k, self.qn, self.kn, self.eps, cos, sin)
        keys, vals, k0 = kv.append(k, v)
        if t < BLOCKED_ATTENTION_T:
            out = attend_rows(q, keys, vals, pos0, k0, a.scale, a.window, a.softcap)
        elif attention_block.supported():
            out = attention_block.attend_blocked(q, keys, vals, pos0, k0, scale=a.scale, window=a.window,
                                                 softcap=a.softcap)
        else:  # no reachable sgemm: numpy's batched products
            out = attend(q, keys, vals, pos0, k0, scale=a.scale, window=a.window, softcap=a.softcap)
        if gate is not None:
            out = out * _sigmoid(gate)
        if self.g is not None:
            g = np.logaddexp(0, self.g(h)).astype(np.float32)  # softplus
            out = out * (g[:, :, None] if g.shape[-1] == a.heads else g.reshape(out.shape))
        out = _heads_off(out, self.head_keep)
        y = mm(self.o, out.reshape(t, -1))
        if self.ob is not None:
            y += self.ob
        return y


class LatentAttention:
    """Multi-head latent attention. The cache holds the normalised latent and the rotated shared
    rope key per position (kv_rank + rope_dim floats), not per-head keys and values: ``kv_b`` is
    absorbed into the query and the output instead (see ops/mla.py)."""

    def __init__(self, a: MlaPlan, w: Weights, norm: _Norms, eps: float) -> None:
        self.a, self.eps, self.w = a, eps, w
        self.q = w.linear(a.q) if a.q else None
        self.q_a = w.linear(a.q_a) if a.q_a else None
        self.q_b = w.linear(a.q_b) if a.q_b else None
        self.q_a_norm, self.kv_a_norm = norm(a.q_a_norm), norm(a.kv_a_norm)
        self.q_a_bias, self.kv_a_bias, self.ob = (w.vector(n) for n in (a.q_a_bias, a.kv_a_bias, a.o_bias))
        self.kv_a, self.o = w.linear(a.kv_a), w.linear(a.o)
        self._wk: np.ndarray | None = None
        self._wv: np.ndarray | None = None
        self.head_keep: np.ndarray | None = None  # task mask: bool per head, None = all heads

    def _kv_b(self) -> tuple[np.ndarray, np.ndarray]:
        """kv_b as [heads, nope, rank] and [heads, v, rank] (decoded once; a view for f32 files)."""
        if self._wk is None:
            a = self.a
            full = self.w.linear(a.kv_b).dense().reshape(a.heads, a.nope_dim + a.v_dim, a.kv_rank)
            self._wk, self._wv = full[:, :a.nope_dim], full[:, a.nope_dim:]
        return self._wk, self._wv

    def new_state(self) -> LayerKV:
        # One "KV head": the latent in the key slot, the shared rope key in the value slot.
        return LayerKV(1, self.a.kv_rank, None, self.a.rope_dim)

    def __call__(self, h: np.ndarray, kv: LayerKV, pos0: int) -> np.ndarray:
        a = self.a
        t = h.shape[0]
        if self.q is not None:
            q = self.q(h)
        else:
            qa = self.q_a(h)
            if self.q_a_bias is not None:
                qa += self.q_a_bias
            q = self.q_b(rms_norm_rows(qa, self.q_a_norm, self.eps))
        q = q.reshape(t, a.heads, a.nope_dim + a.rope_dim)
        if a.rope_first:  # interchange layout: [rope | nope] per head (plan_mixers._layout)
            q_rot, q_nope = np.array(q[..., :a.rope_dim], dtype=np.float32), q[..., a.rope_dim:]
        else:
            q_nope, q_rot = q[..., :a.nope_dim], np.array(q[..., a.nope_dim:], dtype=np.float32)
        ckv = self.kv_a(h)
        if self.kv_a_bias is not None:
            ckv += self.kv_a_bias
        latent = rms_norm_rows(ckv[:, :a.kv_rank], self.kv_a_norm, self.eps)
        k_rot = np.array(ckv[:, None, a.kv_rank:], dtype=np.float32)
        if a.interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        if a.rotate:
            cos, sin = a.rope.cos_sin_at(pos0, t)
            q_rot = rope_rows(np.ascontiguousarray(q_rot), cos, sin)
            k_rot = rope_rows(np.ascontiguousarray(k_rot), cos, sin)
        latents, k_rots, k0 = kv.append(latent[:, None, :], k_rot)
        wk, wv = self._kv_b()
        out = latent_attend(q_nope, q_rot, latents[:, 0], k_rots[:, 0], wk, wv, pos0, k0, a.scale)
        out = _heads_off(out, self.head_keep)
        y = self.o(out.reshape(t, -1))
        if self.ob is not None:
            y += self.ob
        return y


class DeltaNet:
    """Gated DeltaNet (ops/gdn.py). Prefill chunks run the chunked form; single tokens, short
    chunks and chunks whose per-position states must be kept (speculative verify) run the
    token-by-token form."""

    def __init__(self, a: GdnPlan, w: Weights, norm: _Norms, eps: float) -> None:
        self.a, self.eps = a, eps
        self.qkv, self.z, self.pa, self.pb, self.out = (w.linear(n) for n in (a.qkv, a.z, a.a, a.b, a.out))
        self.conv = w.vector(a.conv).reshape(a.conv_dim, a.kernel)
        self.a_log, self.dt_bias = w.vector(a.a_log), w.vector(a.dt_bias)
        # The gated norm's weight multiplies as stored, whatever the model's norm_style: both
        # transformers implementations (Qwen3-Next, Qwen3.5) use w·x̂ here, initialised to ones.
        self.norm_w = w.vector(a.norm)

    def new_state(self) -> LinearState:
        a = self.a
        return LinearState(a.conv_dim, a.kernel, a.v_heads, a.k_dim, a.v_dim)

    def __call__(self, h: np.ndarray, st: LinearState, pos0: int) -> np.ndarray:
        a = self.a
        t = h.shape[0]
        before = (st.conv, st.S)  # replaced, never modified in place: safe to keep as a snapshot
        y, conv_states = self._conv(self.qkv(h), st)
        q, k, v = gdn.split_heads(y, a.k_heads, a.v_heads, a.k_dim, a.v_dim)
        g, beta = gdn.gates(self.pa(h), self.pb(h), self.a_log, self.dt_bias)
        if st.record:
            states: list[np.ndarray] = []
            o, st.S = gdn.delta_rule_steps(q, k, v, g, beta, st.S, states)
            st.remember(pos0, before, conv_states, states)
        elif t >= 16:
            o, st.S = gdn.delta_rule_chunked(q, k, v, g, beta, st.S)
        else:
            o, st.S = gdn.delta_rule_steps(q, k, v, g, beta, st.S)
        st.pos = pos0 + t
        z = self.z(h).reshape(t, a.v_heads, a.v_dim)
        o = gdn.gated_rms_norm(o, z, self.norm_w, self.eps)
        return self.out(o.reshape(t, -1))

    def _conv(self, qkv: np.ndarray, st: LinearState) -> tuple[np.ndarray, list[np.ndarray] | None]:
        before = st.conv
        y, st.conv = gdn.causal_conv(qkv, before, self.conv)
        if not st.record:
            return y, None
        # The conv state after each position: the last K-1 inputs up to it.
        xp = np.concatenate([before, qkv], axis=0)
        km1 = before.shape[0]
        return y, [xp[i + 1:i + 1 + km1].copy() for i in range(qkv.shape[0])]


class LiveFfn:
    """The gathered matrices of one FFN mask (runtime/masked.py): ``gate``/``up`` over the live
    rows (None: that matrix's live rows are multiplied in place), ``down`` over the live columns
    (``positions``: where live activation k goes in down's input, None when in order)."""

    def __init__(self, gate, up, down, positions: np.ndarray | None) -> None:  # noqa: ANN001 - LinearOps
        self.gate, self.up, self.down, self.positions = gate, up, down, positions

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered payloads (a matrix that runs whole under the mask is not counted)."""
        from .masked import MemTensor

        return sum(int(op.tensor.nbytes) for op in (self.gate, self.up, self.down)
                   if op is not None and isinstance(getattr(op, "tensor", None), MemTensor))


class DenseFfn:
    """SwiGLU/GeGLU FFN. Under a task mask (``set_mask``) only the live neurons run: their rows of
    gate/up and columns of down, each gathered once per mask into an in-memory payload of the
    same dtype (runtime/masked.py). Dead gate/up rows are never read; down's dead columns are
    read only where down runs whole (their activations are zero: ``masked.live_columns``)."""

    def __init__(self, f: FfnPlan, w: Weights) -> None:
        self.gate, self.up, self.down = w.linear(f.gate), w.linear(f.up), w.linear(f.down)
        self.act = activation(f.act)
        self.act_name = f.act
        self.width = f.width
        self._w = w
        self._live: np.ndarray | None = None  # live neuron indices; None = unmasked fast path
        self._masked: LiveFfn | None = None  # the live matrices of the current mask
        self._key = b""
        self._cache: dict[bytes, LiveFfn] = {}  # gathers of recent masks (cheap switching back)
        self._gate_up = False  # int8_group of gate/up with the activation (made on first use; None: none)

    def set_mask(self, keep: np.ndarray | None) -> None:
        """Restrict to the neurons where ``keep`` (bool [width]) is set; None or all-set: no mask."""
        if keep is None or keep.all():
            self._live, self._masked = None, None
            return
        live = np.flatnonzero(keep).astype(np.int64)
        if self._live is not None and np.array_equal(live, self._live):
            return
        self._live, self._key = live, np.packbits(keep).tobytes()
        self._masked = self._cache.pop(self._key, None)
        if self._masked is not None:
            self._cache[self._key] = self._masked  # most recently used last

    def live(self) -> LiveFfn:
        """The current mask's gathered matrices (gathered on first use; ``set_mask`` first)."""
        if self._masked is None:
            from .masked import live_columns, live_rows

            # prepared as the model's own ops: reference kernels, int8 activations
            kw = {"reference": self._w.reference, "int8_activations": self._w.int8}
            down, pos = live_columns(self.down, self._live, **kw)
            self._masked = LiveFfn(live_rows(self.gate, self._live, **kw), live_rows(self.up, self._live, **kw),
                                   down, pos)
            if len(self._cache) >= 2:  # keep the last two masks' gathers: A -> B -> A costs nothing
                self._cache.pop(next(iter(self._cache)))
            self._cache[self._key] = self._masked
        return self._masked

    def __call__(self, h: np.ndarray) -> np.ndarray:
        live = self._live
        if live is None:
            gate, up, down, pos = self.gate, self.up, self.down, None
        elif live.size == 0:
            return np.zeros((*h.shape[:-1], self.down.out_features), np.float32)
        else:
            lf = self.live()
            gate, up, down, pos = lf.gate, lf.up, lf.down, lf.positions
        if live is None and h.ndim == 2 and h.shape[0] > 1 and self.act_name in ACTS:
            if self._gate_up is False:
                self._gate_up = int8_group([self.gate, self.up], self.act_name)
            if self._gate_up is not None:  # gate/up and the activation in one product
                w = self._gate_up.width
                y = self._gate_up.run(h, np.empty((h.shape[0], 2 * w), np.float32), numba.get_num_threads())
                return mm(down, y[:, :w])
        g = mm(gate, h) if gate is not None else self.gate.rows(live, h)
        u = mm(up, h) if up is not None else self.up.rows(live, h)
        if h.ndim == 2 and self.act_name in ACTS:
            # over g (a fresh product), and u let go before down: a 256-token block held three
            # [T, intermediate] arrays through down (9 MB on the benchmark model), now one
            a = gated_act(g, u, ACTS[self.act_name], in_place=True)
        else:
            a = self.act(g) * u
        del g, u
        if pos is not None:  # group-gathered columns: dead neurons inside kept groups get 0
            x = np.zeros((*a.shape[:-1], down.in_features), np.float32)
            x[..., pos] = a
            a = x
        return mm(down, a)


class MoeFfn:
    """Routed experts + optional shared expert (ops/moe.py).

    ``allowed`` (bool per expert, or None) restricts the routable set (runtime expert mask, task
    mask); ``counts`` (int64 per expert, or None) accumulates selections when statistics are on.
    """

    def __init__(self, m: MoePlan, w: Weights) -> None:
        self.m, self.w = m, w
        self.router = w.linear(m.router)
        self.bias = w.vector(m.expert_bias)
        self.shared = DenseFfn(m.shared, w) if m.shared else None
        self.shared_gate = w.linear(m.shared_gate) if m.shared_gate else None
        self.act = activation(m.act)
        self.allowed: np.ndarray | None = None
        self.counts: np.ndarray | None = None

    def expert(self, e: int, x: np.ndarray) -> np.ndarray:
        g, u, d = (self.w.linear(n) for n in self.m.experts[e])  # prepared on first selection
        return mm(d, self.act(mm(g, x)) * mm(u, x))

    def __call__(self, h: np.ndarray) -> np.ndarray:
        idx, wts = route(self.router(h), self.m.routing, bias=self.bias, allowed=self.allowed)
        if self.counts is not None:
            self.counts += expert_counts(idx, wts, self.m.n_experts)
        out = expert_mix(h, idx, wts, self.expert)
        if self.shared is not None:
            s = self.shared(h)
            if self.shared_gate is not None:
                s = s * _sigmoid(self.shared_gate(h))
            out += s
        return out


_MIXERS = {AttentionPlan: Attention, MlaPlan: LatentAttention, GdnPlan: DeltaNet}


class Block:
    """One decoder layer: pre-norm mixer and FFN with residuals (sandwich norms when present)."""

    def __init__(self, lp: LayerPlan, w: Weights, gemma_norm: bool, eps: float) -> None:
        norm = _Norms(w, gemma_norm)
        self.plan, self.eps = lp, eps
        self.mixer = _MIXERS[type(lp.attn)](lp.attn, w, norm, eps)
        self.ffn = MoeFfn(lp.ffn, w) if isinstance(lp.ffn, MoePlan) else DenseFfn(lp.ffn, w)
        self.n_in, self.n_post_attn = norm(lp.input_norm), norm(lp.post_attn_norm)
        self.n_pre_ffn, self.n_post_ffn = norm(lp.pre_ffn_norm), norm(lp.post_ffn_norm)
        self.n_exit = norm(lp.exit_norm)  # looped stacks: the final norm at a pass end (loops.py)
        self.alive = True  # a task mask's layer gate: False skips the layer (the residual passes)
        self._step = None  # runtime/step.py BlockStep, built on the first decoded token

    def new_state(self, kv_cache: str = "f32"):
        """The mixer's fresh per-sequence state; ``kv_cache`` ("f32" / "f16") is the storage of a
        GQA layer's KV cache (latent and linear-attention states stay float32)."""
        if isinstance(self.mixer, Attention):
            return self.mixer.new_state(kv_cache)
        return self.mixer.new_state()

    def _n(self, x: np.ndarray, w: np.ndarray | None) -> np.ndarray:
        return rms_norm_rows(x, w, self.eps) if w is not None else x

    def step(self, x: np.ndarray, state, pos: int, nt: int) -> np.ndarray:
        """One token: x [1, hidden] advanced in place through the fused decode path (step.py),
        its products on ``nt`` threads."""
        if self.alive:
            if self._step is None:
                self._step = BlockStep(self, x.shape[1], isinstance(self.mixer, Attention),
                                       isinstance(self.ffn, DenseFfn))
            self._step(x, state, pos, nt)
        if self.n_exit is not None:  # in place, like the step (the caller keeps its x)
            x[...] = rms_norm_rows(x, self.n_exit, self.eps)
        return x

    def __call__(self, x: np.ndarray, state, pos0: int) -> np.ndarray:
        if self.n_exit is not None:  # a pass end: the norm applies whether or not the layer is gated
            return rms_norm_rows(self._layer(x, state, pos0), self.n_exit, self.eps)
        return self._layer(x, state, pos0)

    def _layer(self, x: np.ndarray, state, pos0: int) -> np.ndarray:
        if not self.alive:
            return x
        return run_layer(self, x, lambda h: self.mixer(h, state, pos0), self.ffn,
                         lambda v, w, slot: self._n(v, w), _new_sum)
