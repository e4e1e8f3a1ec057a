"""Gemma 3 against transformers: no attention soft-capping, and the sliding_window_pattern schedule.

- transformers' Gemma 3 keeps ``attn_logit_softcapping`` in its config but never applies it (only
  Gemma 2 does); the converter must not record it, so the runtime does not apply it either.
- A file carrying ``arch.sliding_window_pattern`` without SlidingAttention tags (what a writer that
  stores only the pattern emits) must run the Gemma-3 schedule: sliding layers windowed, with
  the local RoPE base.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_fixtures as H  # noqa: E402

import cmf  # noqa: E402
from cmf.format.writer import CmfWriter  # noqa: E402

TOL = 1e-4
PROMPT_LEN = 48  # three times the fixture's 16-token sliding window


def _gemma3_softcap():
    cfg, cls, kw = H._spec_gemma3_text()
    # A cap of 1.0 would squash every attention score: applying it is far outside the tolerance.
    return cfg, cls, dict(kw, attn_logit_softcapping=1.0, final_logit_softcapping=5.0)


H.SPECS.setdefault("gemma3_softcap", _gemma3_softcap)
_HF: dict[str, object] = {}


def hf_logits(kind: str, ids: np.ndarray) -> np.ndarray:
    if kind not in _HF:
        _HF[kind] = transformers.AutoModelForCausalLM.from_pretrained(str(H.fixture(kind)),
                                                                      dtype=torch.float32).eval()
    with torch.no_grad():
        return _HF[kind](torch.tensor(ids)[None]).logits[0].float().numpy()


def prompt(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, H.VOCAB, PROMPT_LEN)


def test_gemma3_attn_softcapping_is_not_recorded_nor_applied():
    path = H.converted("gemma3_softcap")
    with cmf.open(path) as f:
        arch = f.header.raw["arch"]
    assert "attn_logit_softcapping" not in arch
    assert arch["final_logit_softcapping"] == 5.0  # transformers' Gemma 3 does apply this one
    ids = prompt()
    ref = hf_logits("gemma3_softcap", ids)
    assert np.abs(ref).max() <= 5.0  # the final cap is in effect in the oracle
    with cmf.load(path) as m:
        assert all(layer.attn.softcap is None for layer in m.plan.layers)
        np.testing.assert_allclose(m.logits(ids), ref, atol=TOL, rtol=0)


def test_gemma2_keeps_attn_softcapping():
    from cmf.convert.config import load_config

    _, _, kw = H._spec_gemma2()
    arch = load_config(dict(kw, model_type="gemma2")).arch
    assert (arch["attn_logit_softcapping"], arch["final_logit_softcapping"]) == (50.0, 30.0)


def _rewrite_arch(src, dst, **changes) -> None:
    """Copy ``src`` to ``dst`` byte for byte except for ``arch`` keys (None deletes), with CmfWriter."""
    with cmf.open(src) as f:
        header = f.header.to_dict()
        for k, v in changes.items():
            if v is None:
                header["arch"].pop(k, None)
            else:
                header["arch"][k] = v
        with CmfWriter(dst, header) as w:
            for t in f.tensors():
                w.add(t.name, t.dtype, t.shape, t.numpy(), hash=t.hash)
            if f.tokenizer_json is not None:
                w.set_vocab(f.tokenizer_json)


@pytest.mark.parametrize("tags", [["FullAttention"] * 3, []], ids=["all-full-tags", "no-tags"])
def test_sliding_window_pattern_without_tags_matches_hf(tmp_path, tags):
    src = H.converted("gemma3_text")
    with cmf.open(src) as f:
        arch = f.header.raw["arch"]
        assert arch["layer_types"] == ["SlidingAttention", "SlidingAttention", "FullAttention"]
        assert arch["sliding_window_pattern"] == 3 and arch["sliding_window"] == 16
    dst = tmp_path / "pattern-only.cmf"
    _rewrite_arch(src, dst, layer_types=tags)
    ids = prompt(1)
    ref = hf_logits("gemma3_text", ids)
    with cmf.load(dst) as m:
        assert [layer.kind for layer in m.plan.layers] == ["SlidingAttention", "SlidingAttention", "FullAttention"]
        a0, a2 = m.plan.layers[0].attn, m.plan.layers[2].attn
        assert (a0.window, a2.window) == (16, None)
        # local layers: the plain 10000 base; the global one: 1e6 with linear factor 8
        np.testing.assert_allclose(a0.rope.inv_freq, 10000.0 ** (-np.arange(0, 24, 2) / 24), rtol=1e-6)
        np.testing.assert_allclose(a2.rope.inv_freq, 1e6 ** (-np.arange(0, 24, 2) / 24) / 8, rtol=1e-6)
        np.testing.assert_allclose(m.logits(ids), ref, atol=TOL, rtol=0)
        cache = m.new_cache()
        steps = np.stack([m.forward([t], cache)[0] for t in ids])
        np.testing.assert_allclose(steps, ref, atol=TOL, rtol=0)


def test_without_the_pattern_every_layer_is_global(tmp_path):
    """The control: the same untagged file minus the pattern runs all layers global and so differs."""
    dst = tmp_path / "no-pattern.cmf"
    _rewrite_arch(H.converted("gemma3_text"), dst, layer_types=["FullAttention"] * 3, sliding_window_pattern=None)
    ids = prompt(1)
    with cmf.load(dst) as m:
        assert [layer.kind for layer in m.plan.layers] == ["FullAttention"] * 3
        assert np.abs(m.logits(ids) - hf_logits("gemma3_text", ids)).max() > 1e-2
