"""Server test fixtures: a tiny seeded qwen3 checkpoint built with numpy alone (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import hf_fixtures as H  # its tokenizer trainer needs only `tokenizers`


def tiny_qwen3(folder: Path, seed: int = 0) -> Path:
    """A seeded qwen3 checkpoint (hidden 64, 2 layers, ctx 4096) with the fixtures' BPE + ChatML."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    V, D, F, L, NH, KV, HD = H.VOCAB, 64, 96, 2, 4, 2, 16

    def mat(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    t = {"model.embed_tokens.weight": mat(V, D), "model.norm.weight": norm(D), "lm_head.weight": mat(V, D, scale=0.3)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
                  p + "self_attn.q_proj.weight": mat(NH * HD, D), p + "self_attn.k_proj.weight": mat(KV * HD, D),
                  p + "self_attn.v_proj.weight": mat(KV * HD, D), p + "self_attn.o_proj.weight": mat(D, NH * HD),
                  p + "self_attn.q_norm.weight": norm(HD), p + "self_attn.k_norm.weight": norm(HD),
                  p + "mlp.gate_proj.weight": mat(F, D), p + "mlp.up_proj.weight": mat(F, D),
                  p + "mlp.down_proj.weight": mat(D, F)})
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=V, hidden_size=D,
               intermediate_size=F, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
               head_dim=HD, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
               rope_theta=10000.0, hidden_act="silu", eos_token_id=2, bos_token_id=None)
    (folder / "config.json").write_text(json.dumps(cfg))
    H.train_tokenizer(folder)
    return folder


def tiny_qwen3_cmf(root: Path, quant: str = "q8") -> Path:
    """:func:`tiny_qwen3` under ``root/hf``, converted to ``root/tiny-<quant>.cmf``."""
    from cmf.convert import convert

    out = root / f"tiny-{quant}.cmf"
    convert(tiny_qwen3(root / "hf"), out, quant=quant)
    return out
