"""A tiny random Qwen3 checkpoint built offline (numpy + safetensors + a BPE trained here).

The quick start's last resort when neither the real model (package index) nor
``../shared/models/base`` can be had: it shows the pipeline, not a model that answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "A CMF file carries quantized weights, the tokenizer, the chat template and task masks.",
    "Every tensor has a 64-bit hash, so a truncated download cannot become a bad model.",
    "The reader maps the file and checks every offset before it touches a byte.",
] * 20


def build_tokenizer(vocab_size: int) -> str:
    """Train a tiny byte-level BPE tokenizer with the `tokenizers` library (a fraction of a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def build_model(seed: int = 0) -> tuple[dict, dict[str, np.ndarray]]:
    """Config + seeded random weights of a tiny Qwen3-shaped decoder (norms perturbed, not constant)."""
    cfg = dict(hidden=64, inter=160, layers=2, heads=4, kv=2, head_dim=16, vocab=384)
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {}
    h, d = cfg["hidden"], cfg["head_dim"]

    def mat(r: int, c: int) -> np.ndarray:
        return (rng.standard_normal((r, c)) * 0.05).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w["model.embed_tokens.weight"] = mat(cfg["vocab"], h)
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(cfg["heads"] * d, h)
        w[p + "self_attn.k_proj.weight"] = mat(cfg["kv"] * d, h)
        w[p + "self_attn.v_proj.weight"] = mat(cfg["kv"] * d, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, cfg["heads"] * d)
        w[p + "self_attn.q_norm.weight"] = norm(d)
        w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = mat(cfg["inter"], h)
        w[p + "mlp.up_proj.weight"] = mat(cfg["inter"], h)
        w[p + "mlp.down_proj.weight"] = mat(h, cfg["inter"])
    w["model.norm.weight"] = norm(h)
    w["lm_head.weight"] = mat(cfg["vocab"], h)
    return cfg, w


def write_hf_folder(folder: Path, cfg: dict, weights: dict[str, np.ndarray], tokenizer_json: str) -> Path:
    """Save the random checkpoint the way Hugging Face does: config.json + model.safetensors + tokenizer."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": cfg["hidden"],
        "intermediate_size": cfg["inter"], "num_hidden_layers": cfg["layers"],
        "num_attention_heads": cfg["heads"], "num_key_value_heads": cfg["kv"], "head_dim": cfg["head_dim"],
        "vocab_size": cfg["vocab"], "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "eos_token_id": 2, "bos_token_id": None, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder
