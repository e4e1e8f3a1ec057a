"""Gated DeltaNet hybrids against transformers and the conformance oracle.

qwen3_next (fused in_proj_qkvz/ba split at convert, gated full attention, MoE with a gated shared
expert), qwen3_5 (dense) and qwen3_5_moe. Chunked prefill (both the token-by-token and the
chunked delta rule), cached step decode and greedy tokens; the GDN layer alone against
``shared/conformance/gdn_golden.json``; rollback of the linear-attention state.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _hf_oracle as O  # noqa: E402
import hf_fixtures as H  # noqa: E402

import cmf  # noqa: E402
from cmf.runtime.cache import LinearState  # noqa: E402
from cmf.runtime.ops import gdn  # noqa: E402

FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "conformance" / "gdn_golden.json"


@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_decode_and_chunked_prefill_match_hf(kind):
    O.check_logits(kind)


@pytest.mark.parametrize("kind", FAMILIES)
def test_sixteen_greedy_tokens_equal_hf(kind):
    O.check_greedy(kind)


def test_hybrid_plan_and_state():
    with cmf.load(H.converted("qwen3_next")) as m:
        lin, full = m.plan.layers
        assert type(lin.attn).__name__ == "GdnPlan" and lin.attn.conv_dim == 2 * 2 * 16 + 4 * 24
        assert full.attn.output_gate and full.attn.q_norm is not None  # q_proj rows = 2·heads·head_dim
        cache = m.new_cache()
        m.forward([3, 4, 5], cache)
        st = cache.layers[0]
        assert isinstance(st, LinearState) and st.S.shape == (4, 16, 24) and st.conv.shape == (3, 160)
        assert st.pos == 3 and cache.layers[1].n == 3


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.is_file():
        pytest.skip(f"{GOLDEN} is absent")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("chunked", [False, True])
def test_gdn_layer_matches_conformance_golden(golden, chunked):
    c = golden["cfg"]
    w = {k: np.asarray(v, np.float32) for k, v in golden["weights"].items()}
    nv, nk, dk, dv, kern, hid = (c[k] for k in ("num_v_heads", "num_k_heads", "key_head_dim", "value_head_dim",
                                                "conv_kernel", "hidden_size"))
    conv_dim = 2 * nk * dk + nv * dv
    x = np.asarray(golden["x"], np.float32)
    expect = np.asarray(golden["expect"], np.float32)
    qkv = x @ w["in_proj_qkv"].reshape(conv_dim, hid).T
    z = (x @ w["in_proj_z"].reshape(nv * dv, hid).T).reshape(-1, nv, dv)
    a, b = x @ w["in_proj_a"].reshape(nv, hid).T, x @ w["in_proj_b"].reshape(nv, hid).T
    y, _ = gdn.causal_conv(qkv, np.zeros((kern - 1, conv_dim), np.float32), w["conv1d"].reshape(conv_dim, kern))
    q, k, v = gdn.split_heads(y, nk, nv, dk, dv)
    g, beta = gdn.gates(a, b, w["A_log"], w["dt_bias"])
    s0 = np.zeros((nv, dk, dv), np.float32)
    o, _ = gdn.delta_rule_chunked(q, k, v, g, beta, s0, chunk=4) if chunked else gdn.delta_rule_steps(
        q, k, v, g, beta, s0)
    out = gdn.gated_rms_norm(o, z, w["norm"], c["rms_eps"]).reshape(len(x), -1) @ w["out_proj"].reshape(hid, -1).T
    rel = np.abs(out - expect).max(axis=1) / np.abs(expect).max(axis=1)
    assert rel.max() < 1e-3


def test_chunked_delta_rule_equals_steps_from_a_state():
    rng = np.random.default_rng(0)
    t, h, dk, dv = 37, 3, 8, 5
    q = gdn.l2norm(rng.standard_normal((t, h, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    k = gdn.l2norm(rng.standard_normal((t, h, dk)).astype(np.float32))
    v = rng.standard_normal((t, h, dv)).astype(np.float32)
    g, beta = gdn.gates(rng.standard_normal((t, h)).astype(np.float32), rng.standard_normal((t, h)).astype(np.float32),
                        np.log(rng.uniform(0.5, 4, h)).astype(np.float32), np.zeros(h, np.float32))
    s0 = rng.standard_normal((h, dk, dv)).astype(np.float32) * 0.3
    o1, s1 = gdn.delta_rule_steps(q, k, v, g, beta, s0)
    o2, s2 = gdn.delta_rule_chunked(q, k, v, g, beta, s0, chunk=8)
    np.testing.assert_allclose(o2, o1, atol=2e-5)
    np.testing.assert_allclose(s2, s1, atol=2e-5)


def test_linear_state_rolls_back_to_any_position_of_the_last_forward():
    ids = O.prompt(9, 20).tolist()
    with cmf.load(H.converted("qwen3_next")) as m:
        ref = m.logits(ids)
        cache = m.new_cache()
        m.prefill(ids[:10], cache)
        cache.record(True)
        m.forward(ids[10:15] + [7, 8], cache)  # 5 true tokens + 2 wrong "drafts"
        cache.truncate(13)  # keep 3 of them
        assert cache.pos == 13 and cache.layers[0].pos == 13 and cache.layers[1].n == 13
        cache.record(False)
        rest = m.forward(ids[13:], cache, all_logits=True)
        np.testing.assert_allclose(rest, ref[13:], atol=O.TOL, rtol=0)
        with pytest.raises(ValueError, match="no snapshot"):
            cache.truncate(5)  # older than the last forward call
