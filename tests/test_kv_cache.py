"""The f16 KV cache (``kv_cache="f16"``, runtime/ops/kv_values.py): the compiled token step and the
numpy prefill round to the same bits, attention over f16 entries is attention over their float32
values, a model's logits stay within f16 rounding of the f32 cache's, and every place that makes
or copies a cache keeps its type."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import cmf
from cmf.convert import convert
from cmf.runtime.batched import bytes_per_token, cache_nbytes, clone_prefix
from cmf.runtime.cache import LayerKV
from cmf.runtime.ops.decode import attend_one
from cmf.runtime.ops.kv_values import put_entry, storage_dtype, to_f32, to_storage

from server_fixtures import tiny_qwen3


@numba.njit(cache=False)
def _store(dst, src):  # pragma: no cover - compiled
    put_entry(dst, src)


def test_compiled_rounding_is_numpys():
    """put_entry's f32 -> f16 (vcvtps2ph / fptrunc) equals numpy's astype(float16) bit for bit:
    ties to even, subnormals, overflow to inf, signed zeros."""
    rng = np.random.default_rng(0)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    exact = halves[np.isfinite(halves)].astype(np.float32)
    ties = (exact[:-1].astype(np.float64) + np.diff(exact.astype(np.float64)) / 2).astype(np.float32)
    specials = np.array([0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1e-10, np.inf, -np.inf], np.float32)
    x = np.concatenate([exact, ties[np.isfinite(ties)], specials,
                        (rng.standard_normal(4096) * 10.0 ** rng.integers(-8, 6, 4096)).astype(np.float32)])
    x = x[: x.size // 64 * 64].reshape(-1, 64)
    out = np.empty(x.shape, np.uint16)
    _store(out, x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert np.array_equal(out, want.view(np.uint16)) and np.array_equal(out, to_storage(x, np.uint16))
    assert np.array_equal(to_f32(out), want.astype(np.float32))


def test_attention_over_f16_entries_is_attention_over_their_values():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((8, 64)).astype(np.float32)
    keys = to_storage(rng.standard_normal((300, 2, 64)).astype(np.float32), np.uint16)
    vals = to_storage(rng.standard_normal((300, 2, 64)).astype(np.float32), np.uint16)
    got, want = np.empty((8, 64), np.float32), np.empty((8, 64), np.float32)
    attend_one(q, keys, vals, 299, 0, 0.125, 0, 0.0, got)
    attend_one(q, to_f32(keys), to_f32(vals), 299, 0, 0.125, 0, 0.0, want)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_layer_cache_types_and_window():
    """An f16 layer stores uint16 bits, grows and slides like an f32 one and hands prefill float32
    entries equal to the rounded keys."""
    assert storage_dtype("f16") is np.uint16 and storage_dtype("f32") is np.float32
    with pytest.raises(ValueError, match="unknown KV cache type 'q8'"):
        storage_dtype("q8")
    rng = np.random.default_rng(2)
    for window in (None, 5):
        a, b = LayerKV(2, 16, window, dtype="f32"), LayerKV(2, 16, window, dtype="f16")
        for t in (3, 70, 1, 4):
            k = rng.standard_normal((t, 2, 16)).astype(np.float32)
            v = rng.standard_normal((t, 2, 16)).astype(np.float32)
            ka, va, sa = a.append(k, v)
            kb, vb, sb = b.append(k, v)
            assert kb.dtype == np.float32 and sa == sb and kb.shape == ka.shape
            assert np.array_equal(kb, ka.astype(np.float16).astype(np.float32))
            assert np.array_equal(vb, va.astype(np.float16).astype(np.float32))
        assert b.k.dtype == np.uint16 and (a.n, a.start) == (b.n, b.start)
        assert b.k.nbytes * 2 == a.k.nbytes


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    out = root / "tiny.cmf"
    convert(tiny_qwen3(root / "hf"), out, quant="q8")
    return out


def test_model_with_an_f16_cache(model_path, monkeypatch):
    """Logits within f16 rounding of the f32 cache's, in prefill and decode; the caches, their
    clones and the server's byte accounting are f16; bad types are refused by name."""
    ids = list(range(5, 45))
    runs = {}
    for kv in ("f32", "f16"):
        with cmf.load(model_path, kv_cache=kv) as m:
            assert m.kv_cache == kv
            c = m.new_cache()
            logits = [m.forward(ids, c)[-1]]
            for t in (7, 9, 11, 13):
                logits.append(m.forward([t], c)[-1])
            # a prompt prefilled in one block and fed token by token: the same cache contents
            c2 = m.new_cache()
            for t in ids:
                last = m.forward([t], c2)[-1]
            np.testing.assert_allclose(last, logits[0], rtol=0, atol=2e-5 * np.abs(logits[0]).max())
            layer = c.layers[0]
            assert layer.k.dtype == storage_dtype(kv)
            clone = clone_prefix(c, c.pos)
            assert clone.layers[0].dtype == kv and np.array_equal(clone.layers[0].k[:c.pos], layer.k[:c.pos])
            runs[kv] = (np.stack(logits), bytes_per_token(m), cache_nbytes(c))
    f32, f16 = runs["f32"], runs["f16"]
    scale = np.abs(f32[0]).max()
    assert 0 < np.abs(f16[0] - f32[0]).max() <= 3e-3 * scale
    assert f16[1] * 2 == f32[1] and f16[2] * 2 == f32[2]
    with pytest.raises(ValueError, match="unknown KV cache type 'int4'"):
        cmf.load(model_path, kv_cache="int4")
    monkeypatch.setenv("CMF_KV_CACHE", "f16")
    with cmf.load(model_path) as m:
        assert m.kv_cache == "f16" and m.new_cache().layers[0].k.dtype == np.uint16


def test_a_batch_of_mixed_cache_types_is_refused(model_path):
    from cmf.runtime.batched import decoder

    with cmf.load(model_path) as m:
        a = m.new_cache()
        b = cmf.runtime.cache.Cache([blk.new_state("f16") for blk in m._blocks])
        m.forward([3, 4], a)
        m.forward([3, 4], b)
        with pytest.raises(ValueError, match="mixes KV cache types"):
            decoder(m).step([5, 6], [a, b])


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text", "qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_batched_decode_of_other_layer_kinds(kind):
    """The batched step's one schedule on sandwich norms and sliding windows (gemma), MoE, MLA and
    linear attention, with an f16 cache: each row within float32 noise of the sequence alone
    (those mixers and FFNs run their generic code, whose block paths may round differently)."""
    import hf_fixtures as H

    from cmf.runtime.batched import decoder

    with cmf.load(H.converted(kind, "q8"), kv_cache="f16") as m:
        prompts = [[5, 9, 13, 17, 21, 8], [7, 3], [11, 12, 13, 14]]
        caches, alone, nxt = [], [], []
        for ids in prompts:
            c = m.new_cache()
            nxt.append(int(np.argmax(m.forward(ids, c)[-1])))
            caches.append(c)
            a = m.new_cache()
            m.forward(ids, a)
            alone.append(a)
        bd = decoder(m)
        for _ in range(4):
            out = bd.step(nxt, caches)
            for r in range(len(prompts)):
                ref = m.forward([nxt[r]], alone[r])[-1]
                np.testing.assert_allclose(out[r], ref, rtol=0, atol=1e-4 * float(np.abs(ref).max()))
                nxt[r] = int(np.argmax(ref))
