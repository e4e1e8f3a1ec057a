"""HF -> CMF at f32 for every supported model type: the file verifies, the header says what the
transformers config says (transformers is the oracle, RoPE included), and every tensor decodes to
exactly the source values under its canonical name (fused tensors split as transformers does)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cmf  # noqa: E402
import hf_fixtures as H  # noqa: E402
from _mla_reference import reference_rows  # noqa: E402

KINDS = list(H.SPECS)
GEMMA_STYLE = {"gemma", "gemma2", "gemma3_text", "qwen3_next", "qwen3_5", "qwen3_5_moe"}


def source_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for p in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


def expected(kind: str, folder, model=None) -> dict[str, np.ndarray]:
    """What the CMF file must hold, derived independently of the converter's tables."""
    src = source_tensors(folder)
    cfg = transformers.AutoConfig.from_pretrained(folder).get_text_config()
    out: dict[str, torch.Tensor] = {}
    for name, t in src.items():
        n = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
        if n.startswith(("model.visual.", "vision_tower.", "multi_modal_projector.")):
            continue
        if kind == "mixtral":
            n = n.replace("block_sparse_moe.gate.", "mlp.gate.")
            for w, role in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                n = n.replace(f"block_sparse_moe.experts.", "mlp.experts.").replace(f".{w}.weight", f".{role}.weight")
        if kind in ("deepseek_v3", "glm4_moe"):
            n = n.replace("mlp.shared_experts.", "mlp.shared_expert.").replace("mlp.gate.e_score_correction_bias",
                                                                              "mlp.expert_bias")
        if kind == "deepseek_v3":  # MLA rows in the reference layout (tests/_mla_reference.py)
            t = reference_rows(n, t, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                               bool(cfg.rope_interleave))
        if kind.startswith("phi3") and n.endswith("qkv_proj.weight"):
            q = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
            kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
            p = n[: -len("qkv_proj.weight")]
            out[p + "q_proj.weight"], out[p + "k_proj.weight"], out[p + "v_proj.weight"] = t[:q], t[q:q + kv], t[q + kv:]
            continue
        if kind.startswith("phi3") and n.endswith("gate_up_proj.weight"):
            p = n[: -len("gate_up_proj.weight")]
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t.chunk(2, dim=0)
            continue
        if kind == "qwen3_next" and n.endswith("in_proj_qkvz.weight"):
            p = n[: -len("in_proj_qkvz.weight")]
            layer = model.model.layers[int(n.split(".")[2])].linear_attn
            ba = src[name.replace("in_proj_qkvz", "in_proj_ba")]
            # transformers' own reordering, applied to the weight rows as "activations".
            q, k, v, z, b, a = layer.fix_query_key_value_ordering(t.T[None], ba.T[None])
            h = t.shape[1]
            out[p + "in_proj_qkv.weight"] = torch.cat([q.reshape(h, -1), k.reshape(h, -1), v.reshape(h, -1)], -1).T
            out[p + "in_proj_z.weight"] = z.reshape(h, -1).T
            out[p + "in_proj_b.weight"] = b.reshape(h, -1).T
            out[p + "in_proj_a.weight"] = a.reshape(h, -1).T
            continue
        if kind == "qwen3_next" and n.endswith("in_proj_ba.weight"):
            continue
        out[n] = t
    tied = transformers.AutoConfig.from_pretrained(folder).tie_word_embeddings
    if tied:
        out.pop("lm_head.weight", None)
    return {k: v.detach().float().contiguous().numpy() for k, v in out.items()}


def rope_inv_freq(arch: dict, local: bool = False) -> tuple[np.ndarray, float]:
    """inv_freq and cos/sin scale a runtime derives from the header (spec §2, REFERENCE_NOTES §3)."""
    if arch.get("mla"):
        dim = arch["mla"]["qk_rope_head_dim"]
    else:
        prf = arch.get("local_partial_rotary_factor" if local else "partial_rotary_factor", 1.0)
        dim = int(arch["head_dim"] * prf)
    base = arch["rope_local_base_freq"] if local else arch["rope_theta"]
    inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if local:
        return inv, 1.0
    y = arch.get("yarn")
    if y:
        def corr(rot: float) -> float:
            return dim * math.log(y["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = max(math.floor(corr(y["beta_fast"])), 0), min(math.ceil(corr(y["beta_slow"])), dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = np.clip((np.arange(dim // 2) - lo) / (hi - lo), 0, 1)
        extra = 1 - ramp
        inv = inv / y["factor"] * (1 - extra) + inv * extra
        return inv, y["attention_factor"]
    if arch.get("rope_freq_factors"):
        inv = inv / np.asarray(arch["rope_freq_factors"])
    return inv, arch.get("rope_attention_factor", 1.0)


def check_header(kind: str, arch: dict, folder, rot) -> None:
    """Header fields against the transformers config of ``folder``; ``rot`` is the model's
    rotary embedding module (RoPE is checked through the frequencies it computes)."""
    top = transformers.AutoConfig.from_pretrained(folder)
    c = top.get_text_config()
    assert arch["hidden_size"] == c.hidden_size
    assert arch["num_layers"] == c.num_hidden_layers
    assert arch["num_attention_heads"] == c.num_attention_heads
    assert arch["num_kv_heads"] == c.num_key_value_heads
    if kind == "deepseek_v3":
        assert arch["head_dim"] == c.qk_nope_head_dim + c.qk_rope_head_dim
        assert arch["mla"] == {"q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank,
                               "qk_rope_head_dim": c.qk_rope_head_dim, "qk_nope_head_dim": c.qk_nope_head_dim,
                               "v_head_dim": c.v_head_dim}  # no rope_interleave: the interchange layout
    else:
        assert arch["head_dim"] == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert arch["vocab_size"] == c.vocab_size
    assert arch["rms_norm_eps"] == c.rms_norm_eps
    assert arch["max_position_embeddings"] == c.max_position_embeddings
    assert arch["tie_word_embeddings"] == top.tie_word_embeddings
    assert arch["norm_style"] == ("gemma" if kind in GEMMA_STYLE else "qwen")
    kinds = getattr(c, "layer_types", None)
    if kinds is None:
        sw = getattr(c, "sliding_window", None)
        kinds = ["sliding_attention" if sw else "full_attention"] * c.num_hidden_layers
    names = {"full_attention": "FullAttention", "sliding_attention": "SlidingAttention",
             "linear_attention": "LinearAttention"}
    assert arch["layer_types"] == [names[k] for k in kinds]
    if "SlidingAttention" in arch["layer_types"]:
        assert arch["sliding_window"] == c.sliding_window
    act = getattr(c, "hidden_activation", None) or c.hidden_act
    assert arch["hidden_act"] == {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}[act]
    if kind.startswith("gemma"):
        assert arch["embed_multiplier"] == pytest.approx(math.sqrt(c.hidden_size), rel=1e-12)
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, key, None) is not None:
            assert arch[key] == getattr(c, key)
    if "LinearAttention" in arch["layer_types"]:
        for key in ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                    "linear_key_head_dim", "linear_value_head_dim"):
            assert arch[key] == getattr(c, key)
        assert arch["linear_core"] == {"kind": "gated_delta_net", "num_heads": c.linear_num_value_heads,
                                       "value_head_dim": c.linear_value_head_dim}
    if kind in H.MOE_KINDS:
        moe = arch["moe"]
        n = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or c.n_routed_experts
        assert moe["num_experts"] == n
        assert moe["top_k"] == c.num_experts_per_tok
        inter = c.intermediate_size if kind == "mixtral" else c.moe_intermediate_size
        assert moe["moe_intermediate_size"] == inter
        norm = {"mixtral": True, "qwen3_5_moe": True}.get(kind, getattr(c, "norm_topk_prob", None))
        assert moe["norm_topk_prob"] == norm
        shared = getattr(c, "shared_expert_intermediate_size", None)
        if kind in ("deepseek_v3", "glm4_moe"):
            shared = c.n_shared_experts * c.moe_intermediate_size
            assert moe["router_sigmoid"] is True
            assert moe["routed_scaling_factor"] == c.routed_scaling_factor
            assert (moe["n_group"], moe["topk_group"]) == (c.n_group, c.topk_group)
            assert moe["first_k_dense_replace"] == c.first_k_dense_replace
        assert moe.get("shared_expert_intermediate_size") == shared
    else:
        assert "moe" not in arch
    # RoPE: the header must reproduce transformers' own inverse frequencies and cos/sin scale.
    if kind == "gemma3_text":
        pairs = [(False, rot.full_attention_inv_freq, rot.full_attention_attention_scaling),
                 (True, rot.sliding_attention_inv_freq, rot.sliding_attention_attention_scaling)]
    else:
        pairs = [(False, rot.inv_freq, rot.attention_scaling)]
        if "SlidingAttention" in arch["layer_types"]:
            pairs.append((True, rot.inv_freq, rot.attention_scaling))
    for local, hf_inv, hf_scale in pairs:
        inv, scale = rope_inv_freq(arch, local)
        np.testing.assert_allclose(inv, hf_inv.double().numpy(), rtol=2e-6)
        assert scale == pytest.approx(hf_scale, rel=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_f32_conversion_is_exact(kind: str) -> None:
    folder = H.fixture(kind)
    out = H.converted(kind)
    model = H.make_model(kind)
    with cmf.open(out) as f:
        assert f.verify() == []
        h = f.header
        check_header(kind, h.raw["arch"], folder, model.model.rotary_emb)
        want = expected(kind, folder, model)
        assert sorted(f.keys()) == sorted(want)
        for name, value in want.items():
            t = f.tensor(name)
            assert t.dtype.label == "f32", name
            got = f.array(name)
            assert got.shape == value.shape, name
            np.testing.assert_array_equal(got, value, err_msg=name)
        assert f.tokenizer_json == (folder / "tokenizer.json").read_bytes()
        tc = h.tokenizer_config
        assert tc is not None and tc.chat_template == (folder / "chat_template.jinja").read_text()
        assert list(tc.eos_token_ids) == [2, 1]  # generation_config, then tokenizer_config's <|im_end|> (=2)
        prov = h.provenance
        assert prov["hf_config"]["model_type"] == transformers.AutoConfig.from_pretrained(folder).model_type
        assert prov["options"] == {"quant": "f32"}


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next", "deepseek_v3"])
def test_expert_tensors_are_role_contiguous(kind: str) -> None:
    with cmf.open(H.converted(kind)) as f:
        names = [n for n in f.keys() if ".mlp.experts." in n]
    layer = names[0].split(".mlp.")[0]
    roles = [n.rsplit(".", 2)[-2] for n in names if n.startswith(layer + ".")]
    e = len(roles) // 3
    assert roles == ["gate_proj"] * e + ["up_proj"] * e + ["down_proj"] * e
    idx = [int(n.split(".experts.")[1].split(".")[0]) for n in names if n.startswith(layer + ".")]
    assert idx == list(range(e)) * 3
