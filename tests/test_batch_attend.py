"""The batched decode step's attention (runtime/ops/batch_attend.py): one compiled call for every
sequence, each row bit for bit the one-token step's TokenAttention on that sequence alone — short
caches attended inside the call, long ones (the one-token step's split-across-threads attention)
after it, q/k norms, RoPE and the cache writes included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cmf.runtime.cache import LayerKV
from cmf.runtime.ops.batch_attend import attend_batch
from cmf.runtime.ops.decode import attends_serially
from cmf.runtime.ops.kv_values import to_storage
from cmf.runtime.ops.rope import RopeProfile
from cmf.runtime.step import TokenAttention, rope_at

H, KV, D = 8, 2, 64


def _attention(softcap: float = 0.0) -> TokenAttention:
    rng = np.random.default_rng(1)
    rope = RopeProfile(inv_freq=(1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32), rotary_dim=D)
    a = SimpleNamespace(rope=rope, scale=D ** -0.5, window=None, softcap=softcap)
    attn = SimpleNamespace(a=a, eps=1e-6, qn=(1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
                           kn=(1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    return TokenAttention(attn)


def _cache(rng: np.random.Generator, n: int, dtype: str = "f32") -> LayerKV:
    kv = LayerKV(KV, D, dtype=dtype)
    kv.reserve(n)
    kv.k[:n] = to_storage(rng.standard_normal((n, KV, D)).astype(np.float32), kv.k.dtype.type)
    kv.v[:n] = to_storage(rng.standard_normal((n, KV, D)).astype(np.float32), kv.v.dtype.type)
    kv.n = n
    return kv


def _clone(kv: LayerKV) -> LayerKV:
    c = LayerKV(KV, D, dtype=kv.dtype)
    c.k, c.v, c.n, c.start = kv.k.copy(), kv.v.copy(), kv.n, kv.start
    return c


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_every_row_equals_the_sequence_alone(dtype: str) -> None:
    rng = np.random.default_rng(0)
    lengths = [0, 1, 5, 63, 64, 300, 1100, 1500]  # a fresh cache, a doubling at 64, two long caches
    assert not attends_serially(np.zeros((H, D), np.float32), 1101, 2)  # the long ones take the split path
    for softcap in (0.0, 30.0):
        att = _attention(softcap)
        caches = [_cache(rng, n, dtype) for n in lengths]
        alone = [_clone(c) for c in caches]
        B = len(caches)
        q = rng.standard_normal((B, H, D)).astype(np.float32)
        k = rng.standard_normal((B, KV, D)).astype(np.float32)
        v = rng.standard_normal((B, KV, D)).astype(np.float32)
        positions = [c.n for c in caches]
        rows = [rope_at(att.rope, p) for p in positions]
        cos, sin = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
        out = np.empty((B, H, D), np.float32)
        qb, kb, vb = q.copy(), k.copy(), v.copy()
        attend_batch(att, qb, kb, vb, caches, positions, cos, sin, out, 2)
        for b in range(B):
            want = np.empty((H, D), np.float32)
            att(q[b].copy(), k[b].copy(), v[b].copy(), alone[b], positions[b], want, 2)
            assert np.array_equal(out[b], want), (softcap, lengths[b])
            assert caches[b].n == alone[b].n == lengths[b] + 1
            n = caches[b].n
            assert np.array_equal(caches[b].k[:n], alone[b].k[:n]) and np.array_equal(caches[b].v[:n], alone[b].v[:n])
