"""Batched decode: one token for each of several sequences in one pass over the weights.

Row ``b`` of the batch is sequence ``b``, with its own :class:`~cmf.runtime.cache.Cache` and
position. The matrix products run on the [B, in] block, so each weight is read once per step for
all the sequences; attention runs per sequence over its own cache (the decode step's kernels).

Batch independence: for q8, f16/bf16 and f32 matrices the products go through
``kernels/gemv_batch.BatchGroup``, which computes each (row, sequence) dot product with the
one-token step's own ``MatvecGroup`` code on the same row chunks; the norms, the gated activation,
RoPE and attention are the per-row kernels of ``runtime/step.py``. A sequence's logits are
therefore bit-identical to ``Model.forward([token], cache)`` on it alone, whatever else is in the
batch. Other families (4-bit, vbit, q1) run their LinearOps, whose path switches at
``fused_max_t`` rows: there a batch can change a row's last bits. Mixers and FFNs the fused step
does not cover (MLA, linear attention, output gates, MoE) run their generic code, the mixer once
per sequence.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numba
import numpy as np

from .blocks import Attention, Block, DenseFfn
from .cache import Cache, LayerKV, LinearState
from .model import ContextOverflow
from .ops.decode import add_into, add_norm, norm_into
from .ops.batch_attend import StepCaches, attend_batch, attend_step
from .schedule import run_layer
from .step import AttnStep, FfnStep, TokenAttention, rope_at
from ..kernels.gemv_batch import BatchGroup

log = logging.getLogger(__name__)

# Batch sizes whose activation arrays a decoder keeps (the server's batch size moves between a few
# values as requests join and leave; past this many the set starts again).
MAX_BATCH_SIZES = 8



def _norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm of each row into a new array (the step's ``norm_into``: a copy when ``w`` is None)."""
    return norm_into(x, w, eps, np.empty_like(x))


class _LayerOps:
    """A layer's products as batch groups (q/k/v in one region, gate/up with the activation in one),
    built on the first batch step that meets the layer, like ``step.BlockStep``."""

    def __init__(self, block: Block) -> None:
        m, f = block.mixer, block.ffn
        self.attn = isinstance(m, Attention) and AttnStep.supports(m)
        if self.attn:
            a = m.a
            self.qkv, self.o = BatchGroup([m.q, m.k, m.v]), BatchGroup([m.o])
            self.nq, self.nk = a.heads * a.head_dim, a.kv_heads * a.head_dim
            self.bias = None
            if m.qb is not None or m.kb is not None or m.vb is not None:  # as AttnStep adds them
                parts = [b if b is not None else np.zeros(n, np.float32) for b, n in
                         ((m.qb, self.nq), (m.kb, self.nk), (m.vb, a.kv_heads * a.v_head_dim))]
                self.bias = np.concatenate(parts).astype(np.float32)[None]
            self.attend = TokenAttention(m)
        self.dense = isinstance(f, DenseFfn) and FfnStep.supports(f)
        if self.dense:
            self._plain = (BatchGroup([f.gate, f.up], act=f.act_name), BatchGroup([f.down]), None)
        self._masked: tuple = (None, None)  # (the LiveFfn, its groups or None)
        # GQA over caches that keep every entry and a dense FFN: products that can be bound
        self.bindable = self.attn and self.dense and m.a.window is None
        self._bound: dict = {}  # batch size -> (threads, FFN groups, _BoundLayer or None)

    def bound(self, block: Block, bufs: "_Buffers", nt: int) -> "_BoundLayer | None":
        """The layer's four products bound to ``bufs`` (one batch size), or None when this layer
        takes the generic path (another mixer or FFN, a sliding window, a masked down fed at
        positions, a family without one kernel call)."""
        if not self.bindable:
            return None
        groups = self.ffn_groups(block.ffn)
        hit = self._bound.get(bufs.B)
        if hit is None or hit[0] != nt or hit[1] is not groups:
            made = None if groups is None or groups[2] is not None else _BoundLayer(self, groups, bufs, nt)
            hit = self._bound[bufs.B] = (nt, groups, made if made is not None and made.calls else None)
        return hit[2]

    def ffn_groups(self, f: DenseFfn) -> tuple | None:
        """(gate/up group, down group, live positions in down's input or None) of the FFN now,
        or None for the generic path (as ``FfnStep.products``)."""
        if f._live is None:
            return self._plain
        lf = f.live() if f._live.size else None
        if self._masked[0] is not lf or lf is None:
            groups = None
            if lf is not None and lf.gate is not None and lf.up is not None:
                groups = (BatchGroup([lf.gate, lf.up], act=f.act_name), BatchGroup([lf.down]), lf.positions)
            self._masked = (lf, groups)
        return self._masked[1]


class _Buffers:
    """Activation arrays of one batch size, reused by every step and every layer of that size
    (layers run one after another, so arrays of one shape are shared by name)."""

    def __init__(self, B: int) -> None:
        self.B = B
        self._arrays: dict = {}

    def get(self, name: str, *shape: int) -> np.ndarray:
        key = (name, shape)
        a = self._arrays.get(key)
        if a is None:
            a = self._arrays[key] = np.empty((self.B, *shape), np.float32)
        return a


class _BoundLayer:
    """One layer's products for one batch size with their arrays bound (``BatchGroup.bind``): the
    generic path's calls and values, without its per-call checks and allocations (~2.4 ms of
    Python in a 16-sequence step of SmolLM2-135M, 15% of it, before)."""

    def __init__(self, ops: _LayerOps, groups: tuple, bufs: _Buffers, nt: int) -> None:
        gate_up, down, _ = groups
        n = ops.qkv.group.in_features
        self.h = bufs.get("h", n)
        self.qkv = bufs.get("qkv", ops.qkv.out_features)
        self.o = bufs.get("o", ops.o.out_features)
        self.gu = bufs.get("gu", gate_up.out_features)
        self.g = self.gu if gate_up.width == gate_up.out_features else bufs.get("g", gate_up.width)
        self.f = bufs.get("f", down.out_features)
        self.t = bufs.get("t", n)  # a sandwich norm's output
        self.width = gate_up.width
        self.att = bufs.get("att", ops.o.group.in_features)
        calls = (ops.qkv.bind(self.h, self.qkv, nt), ops.o.bind(self.att, self.o, nt),
                 gate_up.bind(self.h, self.gu, nt), down.bind(self.g, self.f, nt))
        self.calls = None if any(c is None for c in calls) else calls


_SLOTS = {"h": "h", "a": "t", "f": "t"}  # run_layer's norm slots -> the bound layer's arrays


def _slot(bound: _BoundLayer | None, slot: str, like: np.ndarray) -> np.ndarray:
    """The bound layer's array for a norm's output in ``slot``, or a new one shaped as ``like``."""
    return getattr(bound, _SLOTS[slot]) if bound is not None else np.empty_like(like)


def _add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x += y (compiled: the batch's residual stream is the step's own array); returns x."""
    add_into(x, y)
    return x


class BatchDecoder:
    """Decode steps of one model over many caches (see the module docstring). Reads the model's
    current blocks at every call, so a task/skill switch between steps is honoured."""

    def __init__(self, model) -> None:  # noqa: ANN001 - a runtime.model.Model
        self.model = model
        self._head: BatchGroup | None = None
        self._ropes: dict = {}
        self._bufs: dict[int, _Buffers] = {}  # batch size -> its activation arrays
        self._positions = np.empty(0, np.int64)  # this step's positions (attention's argument)
        self._kv = StepCaches()  # the plain layers' caches as attention reads them

    def step(self, tokens: Sequence[int], caches: Sequence[Cache]) -> np.ndarray:
        """Feed ``tokens[b]`` to ``caches[b]`` for every b; the logits [B, vocab] (float32)."""
        model = self.model
        plan = model.plan
        b = len(tokens)
        if b == 0 or b != len(caches):
            raise ValueError(f"a decode batch needs one cache per token ({b} tokens, {len(caches)} caches)")
        ids = np.asarray(tokens, dtype=np.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= plan.vocab:
            raise ValueError(f"token id out of range [0, {plan.vocab})")
        for c in caches:
            if c.pos + 1 > model.ctx_size:
                raise ContextOverflow(f"context limit exceeded: {c.pos} + 1 tokens > ctx size {model.ctx_size}")
        x = model.weights.rows(plan.embed, ids)
        if plan.embed_multiplier != 1.0:
            x *= np.float32(plan.embed_multiplier)
        # the embedding's looked-up pages given back as for decode forwards; on a watched step (the
        # first after a layer was rebuilt, decode counts 1, 2, 4, ...) the layers' pages too
        watch = model._count_forward(1)
        positions = [c.pos for c in caches]
        self._positions = np.array(positions, np.int64)  # attention's argument, made once a step
        self._kv.start(caches, self._positions)
        self._ropes: dict = {}  # this step's cos/sin rows per RoPE profile
        nt = numba.get_num_threads()
        bufs = self._bufs.get(b)
        if bufs is None:
            if len(self._bufs) >= MAX_BATCH_SIZES:  # a server sees a few sizes again and again
                self._bufs.clear()
                for blk in model._blocks:  # the layers' bound calls hold the old arrays
                    ops = getattr(blk, "_batch_ops", None)
                    if ops is not None:
                        ops._bound.clear()
            bufs = self._bufs[b] = _Buffers(b)
        pending = None  # a plain layer's FFN output, added to x with the next norm (_plain_layer)
        for i, block in enumerate(model._blocks):
            states = [c.layers[i] for c in caches]
            plain = self._plain(block, states, bufs, nt) if block.alive else None
            if plain is not None:
                pending = self._plain_layer(i, block, *plain, x, pending, states, positions, nt)
                continue
            if pending is not None:
                add_into(x, pending)
                pending = None
            if block.alive:
                x = self._layer(i, block, x, states, positions, nt, bufs)
            if block.n_exit is not None:  # looped stacks: the final norm at a pass end (loops.py)
                x = _norm(x, block.n_exit, block.eps)
        for c in caches:
            c.pos += 1
        if pending is not None and model._final_norm is not None:
            h = add_norm(x, pending, model._final_norm, plan.eps, np.empty_like(x))
        else:
            if pending is not None:
                add_into(x, pending)
            h = x if model._final_norm is None else _norm(x, model._final_norm, plan.eps)
        if self._head is None or self._head.ops[0] is not model._lm_head:
            self._head = BatchGroup([model._lm_head])
        logits = self._head(h, nt)
        if plan.logit_multiplier != 1.0:
            logits *= np.float32(plan.logit_multiplier)
        if plan.final_softcap:
            cap = np.float32(plan.final_softcap)
            logits = np.tanh(logits / cap) * cap
        if watch:  # after the head's product: what this step packed, the head included
            for i in range(len(model._blocks)):
                model._give_back(i)
            model._give_back_head()
        return logits.astype(np.float32, copy=False)

    # -- one layer ---------------------------------------------------------------------------------
    def _plain(self, block: Block, states: list, bufs: _Buffers, nt: int) -> tuple | None:
        """(ops, bound layer) when ``block`` takes :meth:`_plain_layer`: bound products, pre-norms
        only (no sandwich, no pass-end norm); else None."""
        if block.plan.sandwich or block.n_exit is not None or block.n_in is None or block.n_post_attn is None:
            return None
        ops = getattr(block, "_batch_ops", None)
        if ops is None:
            ops = block._batch_ops = _LayerOps(block)
        bound = ops.bound(block, bufs, nt)
        return None if bound is None else (ops, bound)

    def _plain_layer(self, i: int, block: Block, ops: _LayerOps, bound: _BoundLayer, x: np.ndarray,
                     pending: np.ndarray | None, states: list, positions: list[int], nt: int) -> np.ndarray:
        """The common layer (``run_layer``'s schedule with pre-norms) on its bound arrays, each
        residual add in one call with the norm after it — the previous layer's FFN output
        (``pending``) with this layer's input norm, the mixer's with the post-attention norm —
        the same additions and norms as apart, a fifth fewer calls. Returns this layer's FFN
        output, not yet added to x."""
        eps = block.eps
        if pending is None:
            norm_into(x, block.n_in, eps, bound.h)
        else:
            add_norm(x, pending, block.n_in, eps, bound.h)
        add_norm(x, self._attention(block, ops, bound.h, states, positions, nt, bound, i), block.n_post_attn, eps,
                 bound.h)
        return self._ffn(block, ops, bound.h, nt, bound)

    def _layer(self, i: int, block: Block, x: np.ndarray, states: list, positions: list[int], nt: int,
               bufs: _Buffers) -> np.ndarray:
        """One decoder layer for the batch: the products on the layer's bound arrays where it has
        them (:class:`_BoundLayer`), else through the generic calls — one schedule, the same values."""
        ops = getattr(block, "_batch_ops", None)  # made once per block (a skill switch makes new blocks)
        if ops is None:
            ops = block._batch_ops = _LayerOps(block)
        bound = ops.bound(block, bufs, nt)
        eps = block.eps
        if ops.attn:
            mix = lambda h: self._attention(block, ops, h, states, positions, nt, bound, i)  # noqa: E731
        else:  # MLA, linear attention, gated attention: the generic mixer, one sequence at a time
            mix = lambda h: np.concatenate([block.mixer(h[i:i + 1], st, p)  # noqa: E731
                                            for i, (st, p) in enumerate(zip(states, positions))])
        return run_layer(block, x, mix, lambda h: self._ffn(block, ops, h, nt, bound),
                         lambda v, w, slot: norm_into(v, w, eps, _slot(bound, slot, v)), _add)

    def _attention(self, block: Block, ops: _LayerOps, h: np.ndarray, states: list, positions: list[int],
                   nt: int, bound: "_BoundLayer | None", layer: int) -> np.ndarray:
        m = block.mixer
        a = m.a
        bsz = h.shape[0]
        if bound is not None:
            fn, args = bound.calls[0]
            fn(*args)
            qkv = bound.qkv
        else:
            qkv = ops.qkv(h, nt)
        if ops.bias is not None:
            qkv += ops.bias
        q = qkv[:, :ops.nq].reshape(bsz, a.heads, a.head_dim)
        k = qkv[:, ops.nq:ops.nq + ops.nk].reshape(bsz, a.kv_heads, a.head_dim)
        v = qkv[:, ops.nq + ops.nk:].reshape(bsz, a.kv_heads, a.v_head_dim)
        att = (bound.att if bound is not None else np.empty((bsz, a.heads * a.v_head_dim), np.float32)).reshape(
            bsz, a.heads, a.v_head_dim)
        rows = self._kv.layer(layer, states)  # gathered once, kept across steps (None: not every cache plain)
        if rows is not None:
            cos, sin = self._rope(a.rope, positions)
            # contiguous copies: the compiled attention over strided views of the product was
            # ~10% slower (2026-12-06, three alternated pairs), more than the copies cost
            attend_step(ops.attend, np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
                        states, rows, self._kv, cos, sin, att, nt)
        elif all(type(kv) is LayerKV and kv.window is None for kv in states):  # one call for the batch
            cos, sin = self._rope(a.rope, positions)
            attend_batch(ops.attend, np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
                         states, self._positions, cos, sin, att, nt)
        else:  # sliding windows drop entries as they append: one sequence at a time
            for i, (kv, pos) in enumerate(zip(states, positions)):
                ops.attend(q[i], k[i], v[i], kv, pos, att[i], nt)
        if m.head_keep is not None:
            att[:, ~m.head_keep] = 0
        if bound is not None:
            fn, args = bound.calls[1]
            fn(*args)
            y = bound.o
        else:
            y = ops.o(att.reshape(bsz, -1), nt)
        if m.ob is not None:
            y += m.ob
        return y

    def _rope(self, profile, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
        """cos, sin [B, rotary_dim] at each sequence's position (the one-token step's ``rope_at``
        rows), made once per step and RoPE profile."""
        hit = self._ropes.get(id(profile))
        if hit is None or hit[0] is not profile:
            rows = [rope_at(profile, p) for p in positions]
            hit = self._ropes[id(profile)] = (profile, np.stack([c for c, _ in rows]), np.stack([s for _, s in rows]))
        return hit[1], hit[2]

    def _ffn(self, block: Block, ops: _LayerOps, h: np.ndarray, nt: int, bound: "_BoundLayer | None") -> np.ndarray:
        if bound is not None:
            (gate_up, gate_up_args), (down, down_args) = bound.calls[2:]
            gate_up(*gate_up_args)
            if bound.g is not bound.gu:
                bound.g[...] = bound.gu[:, :bound.width]
            down(*down_args)
            return bound.f
        f = block.ffn
        groups = ops.ffn_groups(f) if ops.dense else None
        if groups is None:
            if isinstance(f, DenseFfn) and f._live is not None and f._live.size == 0:
                return np.zeros((h.shape[0], f.down.out_features), np.float32)
            return f(h)  # MoE and the rest: their own batched code
        gate_up, down, pos = groups
        g = gate_up(h, nt)[:, :gate_up.width]
        if pos is not None:  # group-gathered down columns: live activations at their positions
            full = np.zeros((h.shape[0], down.group.in_features), np.float32)
            full[:, pos] = g
            g = full
        return down(g, nt)


def decoder(model) -> BatchDecoder:  # noqa: ANN001
    """The model's BatchDecoder (one per model, made on first use)."""
    bd = getattr(model, "_batch_decoder", None)
    if bd is None:
        bd = model._batch_decoder = BatchDecoder(model)
    return bd


# ----------------------------------------------------------------------------------- cache helpers


def cache_nbytes(cache: Cache) -> int:
    """Bytes the cache's arrays hold (allocated capacity, not just the valid entries)."""
    n = 0
    for layer in cache.layers:
        if isinstance(layer, LayerKV):
            n += layer.k.nbytes + layer.v.nbytes
        elif isinstance(layer, LinearState):
            n += layer.conv.nbytes + layer.S.nbytes
    return n


def bytes_per_token(model) -> int:  # noqa: ANN001
    """KV bytes one more position adds to a sequence's cache (linear-attention state is fixed)."""
    n = 0
    for b in model._blocks:
        st = b.new_state(model.kv_cache)
        if isinstance(st, LayerKV):
            n += st.k.itemsize * st.kv_heads * (st.head_dim + st.v_dim)
    return max(n, 1)


def can_cut(cache: Cache, n: int) -> bool:
    """Whether ``cache`` can give its first ``n`` positions (a window may have dropped them, a
    recurrent state holds only its own length)."""
    if n > cache.pos:
        return False
    for layer in cache.layers:
        if isinstance(layer, LayerKV) and (layer.start > 0 or layer.window is not None) and n != cache.pos:
            return False
        if isinstance(layer, LinearState) and n != layer.pos:
            return False
    return True


def clone_prefix(cache: Cache, n: int, reserve: int = 0) -> Cache:
    """A new cache holding copies of ``cache``'s first ``n`` positions, with room for ``reserve``
    more entries per layer (``can_cut(cache, n)`` must hold)."""
    layers: list = []
    for layer in cache.layers:
        if isinstance(layer, LayerKV):
            keep = n - layer.start
            new = LayerKV(layer.kv_heads, layer.head_dim, layer.window, layer.v_dim, layer.dtype)
            new.reserve(keep + reserve)
            new.k[:keep] = layer.k[:keep]
            new.v[:keep] = layer.v[:keep]
            new.n, new.start = keep, layer.start
            layers.append(new)
        elif isinstance(layer, LinearState):
            new_s = LinearState.__new__(LinearState)
            new_s.__dict__.update(layer.__dict__)
            new_s.conv, new_s.S = layer.conv.copy(), layer.S.copy()
            new_s.record, new_s._snap = False, {}
            layers.append(new_s)
        else:
            layers.append(layer)
    out = Cache(layers)
    out.pos = n
    return out


def shrink(cache: Cache) -> None:
    """Reallocate each KV layer to its valid entries when it holds far more (a finished sequence
    kept for its prefix: doubling leaves up to half the arrays unused)."""
    for layer in cache.layers:
        if isinstance(layer, LayerKV) and layer.k.shape[0] > max(64, layer.n + layer.n // 2):
            layer.k = layer.k[:layer.n].copy()
            layer.v = layer.v[:layer.n].copy()


def reserve(cache: Cache, extra: int) -> None:
    """Room for ``extra`` more positions in every KV layer (one allocation instead of doublings)."""
    for layer in cache.layers:
        if isinstance(layer, LayerKV) and layer.window is None:
            layer.reserve(extra)
