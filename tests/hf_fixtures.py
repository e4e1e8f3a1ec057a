"""Tiny, seeded Hugging Face checkpoints of every architecture the converter supports.

Built on the fly with transformers (no network): a small config per model type with non-square
matrices (hidden 64, 4 heads of 24, 2 KV heads, FFN 96, experts 48), seeded init, then every
parameter and persistent float buffer perturbed so no norm weight, bias or routing bias is
constant (FIXTURES.md: otherwise a dropped bias or a wrong norm offset hides in 1e-5 margins).
The folder gets a byte-level BPE tokenizer.json trained in a fraction of a second, a
tokenizer_config.json, a ChatML chat_template.jinja and a generation_config.json.

``build(kind, folder, ...)`` writes one fixture; options select the variants the converter
tests compare: legacy (hub) config style, fused expert storage, sharded safetensors, bf16
weights, injected MTP tensors.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable

VOCAB = 384
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
          " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                              bos_token_id=None, eos_token_id=2, pad_token_id=0)
MOE: dict[str, Any] = dict(moe_intermediate_size=48, num_experts_per_tok=2)
LINEAR: dict[str, Any] = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
                              linear_num_key_heads=2, linear_num_value_heads=4,
                              layer_types=["linear_attention", "full_attention"])


def _spec_llama() -> tuple[str, str, dict[str, Any]]:
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return "LlamaConfig", "LlamaForCausalLM", dict(COMMON, rope_parameters=rope, attention_bias=True)


def _spec_mistral() -> tuple[str, str, dict[str, Any]]:
    return "MistralConfig", "MistralForCausalLM", dict(COMMON, sliding_window=16,
                                                         rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 50000.0})


def _spec_qwen2() -> tuple[str, str, dict[str, Any]]:
    c = dict(COMMON, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    c.pop("head_dim")  # qwen2 derives head_dim = hidden / heads (16)
    return "Qwen2Config", "Qwen2ForCausalLM", c


def _spec_qwen3() -> tuple[str, str, dict[str, Any]]:
    rope = {"rope_type": "yarn", "rope_theta": 100000.0, "factor": 4.0, "original_max_position_embeddings": 128}
    return "Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, rope_parameters=rope)


def _spec_qwen2_moe() -> tuple[str, str, dict[str, Any]]:
    c = dict(COMMON, **MOE, num_experts=4, shared_expert_intermediate_size=80, mlp_only_layers=[1],
             norm_topk_prob=False)
    c.pop("head_dim")
    return "Qwen2MoeConfig", "Qwen2MoeForCausalLM", c


def _spec_qwen3_moe() -> tuple[str, str, dict[str, Any]]:
    return "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(COMMON, **MOE, num_experts=4, norm_topk_prob=True)


def _spec_qwen3_next() -> tuple[str, str, dict[str, Any]]:
    c = dict(COMMON, **MOE, **LINEAR, num_experts=4, shared_expert_intermediate_size=80, norm_topk_prob=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    return "Qwen3NextConfig", "Qwen3NextForCausalLM", c


def _spec_qwen3_5() -> tuple[str, str, dict[str, Any]]:
    c = dict(COMMON, **LINEAR,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    return "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", c


def _spec_qwen3_5_moe() -> tuple[str, str, dict[str, Any]]:
    c = dict(COMMON, **MOE, **LINEAR, num_experts=4, shared_expert_intermediate_size=80,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    c.pop("intermediate_size")
    return "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", c


def _spec_gemma() -> tuple[str, str, dict[str, Any]]:
    return "GemmaConfig", "GemmaForCausalLM", dict(COMMON, tie_word_embeddings=True, bos_token_id=1)


def _spec_gemma2() -> tuple[str, str, dict[str, Any]]:
    return "Gemma2Config", "Gemma2ForCausalLM", dict(
        COMMON, num_hidden_layers=3, sliding_window=16, query_pre_attn_scalar=20, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, tie_word_embeddings=True, bos_token_id=1)


def _gemma3_text_config() -> dict[str, Any]:
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return dict(COMMON, num_hidden_layers=3, sliding_window=16, query_pre_attn_scalar=20,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                rope_parameters=rope, tie_word_embeddings=True, bos_token_id=1)


def _spec_gemma3_text() -> tuple[str, str, dict[str, Any]]:
    return "Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3_text_config()


def _spec_phi3() -> tuple[str, str, dict[str, Any]]:
    half = 16 // 2  # phi3 derives head_dim = hidden / heads
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)]}
    c = dict(COMMON, rope_parameters=rope, original_max_position_embeddings=128)
    c.pop("head_dim")
    return "Phi3Config", "Phi3ForCausalLM", c


def _spec_mixtral() -> tuple[str, str, dict[str, Any]]:
    return "MixtralConfig", "MixtralForCausalLM", dict(COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                         rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1000000.0})


def _spec_deepseek_v3() -> tuple[str, str, dict[str, Any]]:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    c = dict(COMMON, **MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
             topk_group=1, routed_scaling_factor=2.5, q_lora_rank=40, kv_lora_rank=32, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=20, num_key_value_heads=4, rope_parameters=rope,
             num_nextn_predict_layers=1)
    c.pop("head_dim")
    return "DeepseekV3Config", "DeepseekV3ForCausalLM", c


def _spec_glm4_moe() -> tuple[str, str, dict[str, Any]]:
    c = dict(COMMON, **MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
             topk_group=1, routed_scaling_factor=1.5, use_qk_norm=True, attention_bias=True,
             num_nextn_predict_layers=1,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return "Glm4MoeConfig", "Glm4MoeForCausalLM", c


SPECS: dict[str, Callable[[], tuple[str, str, dict[str, Any]]]] = {
    "llama": _spec_llama, "mistral": _spec_mistral, "qwen2": _spec_qwen2, "qwen3": _spec_qwen3,
    "qwen2_moe": _spec_qwen2_moe, "qwen3_moe": _spec_qwen3_moe, "qwen3_next": _spec_qwen3_next,
    "qwen3_5": _spec_qwen3_5, "qwen3_5_moe": _spec_qwen3_5_moe, "gemma": _spec_gemma, "gemma2": _spec_gemma2,
    "gemma3_text": _spec_gemma3_text, "phi3": _spec_phi3, "mixtral": _spec_mixtral,
    "deepseek_v3": _spec_deepseek_v3, "glm4_moe": _spec_glm4_moe,
}
MOE_KINDS = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "mixtral", "deepseek_v3", "glm4_moe")


# ----------------------------------------------------------------------------------- tokenizer


def train_tokenizer(folder: Path) -> None:
    """A Qwen2-style byte-level BPE with ChatML specials, deterministic, trained in ~50 ms."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    words = ["model", "tensor", "convert", "weight", "layer", "expert", "token", "hello", "world", "rope",
             "quant", "shard", "format", "header", "vocab", "attention", "norm", "bias", "gate", "router"]
    text = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i}." for i in range(400)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 512, "clean_up_tokenization_spaces": False}, indent=2))
    (folder / "chat_template.jinja").write_text(CHATML)


# ----------------------------------------------------------------------------------- models


def perturb(model: Any, seed: int) -> None:
    """Seeded noise on every parameter and persistent float buffer (FIXTURES.md)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = list(model.named_parameters())
        persistent = {k for k in model.state_dict()}
        tensors += [(n, b) for n, b in model.named_buffers() if n in persistent]
        for _, t in tensors:
            if not t.is_floating_point():
                continue
            scale = 0.1 if t.dim() <= 1 else 0.08
            t.add_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * scale)


def _text_class_names(kind: str) -> tuple[str, str, dict[str, Any]]:
    return SPECS[kind]()


def make_model(kind: str, seed: int = 0, vl: bool = False) -> Any:
    """The perturbed torch model of fixture ``kind`` (``vl``: the qwen3_5 / gemma3 VL wrapper)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg_name, cls_name, kwargs = SPECS[kind]()
    if vl:
        cfg, cls = _vl_config(kind, kwargs)
    else:
        cfg = getattr(transformers, cfg_name)(**kwargs)
        cls = getattr(transformers, cls_name)
    model = cls(cfg).eval().float()
    if kind in MOE_KINDS or vl:
        # transformers may leave some expert banks uninitialised (FIXTURES.md): define them.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not torch.isfinite(p).all():
                    p.copy_(torch.randn(p.shape) * 0.02)
    perturb(model, seed + 1)
    return model


def _vl_config(kind: str, text_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    import transformers

    if kind == "qwen3_5":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
        text = dict(text_kwargs)
        cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=VOCAB - 4,
                                         video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2,
                                         vision_end_token_id=VOCAB - 1)
        return cfg, transformers.Qwen3_5ForConditionalGeneration
    if kind == "gemma3_text":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=32, patch_size=8)
        cfg = transformers.Gemma3Config(text_config=dict(text_kwargs), vision_config=vision, mm_tokens_per_image=4,
                                        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                                        image_token_index=VOCAB - 1)
        return cfg, transformers.Gemma3ForConditionalGeneration
    raise ValueError(f"no VL wrapper fixture for {kind}")


# ----------------------------------------------------------------------------------- variants


def legacy_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a transformers-5 config.json into the hub's legacy form: top-level rope keys,
    ``rope_scaling`` with ``type``, no ``layer_types`` (each family's older schedule key instead),
    ``num_experts`` for qwen3_moe."""
    out = dict(cfg)
    if "text_config" in out and isinstance(out["text_config"], dict):
        out["text_config"] = legacy_config(out["text_config"])
    mt = out.get("model_type", "")
    lt = out.pop("layer_types", None)
    out.pop("_sliding_window_pattern", None)
    if lt is not None and mt in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        out["full_attention_interval"] = lt.index("full_attention") + 1
    elif lt is not None and mt.startswith("gemma3"):
        out["sliding_window_pattern"] = lt.index("full_attention") + 1
    if mt == "qwen3_moe" and "num_local_experts" in out:
        out["num_experts"] = out.pop("num_local_experts")
    rp = out.pop("rope_parameters", None)
    if rp is None:
        return out
    if mt.startswith("gemma3") and "full_attention" in rp:
        full, slide = dict(rp["full_attention"]), dict(rp["sliding_attention"])
        out["rope_theta"] = full.pop("rope_theta")
        out["rope_local_base_freq"] = slide["rope_theta"]
        kind = full.pop("rope_type", "default")
        out["rope_scaling"] = None if kind == "default" else dict(full, rope_type=kind)
        return out
    rp = dict(rp)
    out["rope_theta"] = rp.pop("rope_theta")
    if "partial_rotary_factor" in rp:
        out["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
    kind = rp.pop("rope_type", "default")
    # Hub configs spell the kind `type` (older) or `rope_type`; use the older one.
    out["rope_scaling"] = None if kind == "default" and not rp else dict(rp, type=kind)
    return out


def inject_mtp(folder: Path, kind: str, model: Any, seed: int = 7) -> None:
    """Add hub-layout MTP tensors (which transformers never saves) to ``model.safetensors``."""
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    sd = load_file(str(path))
    cfg = json.loads((folder / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    extra: dict[str, torch.Tensor] = {}

    def rnd(*shape: int, vec: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, generator=g) * (0.1 if vec else 0.08)
        return t + 1.0 if vec and kind in ("deepseek_v3", "glm4_moe") else t

    if kind in ("deepseek_v3", "glm4_moe"):
        n = cfg["num_hidden_layers"]
        src = f"model.layers.{n - 1}."
        dst = f"model.layers.{n}."
        for k, v in sd.items():  # the MTP block is an ordinary decoder layer (MoE here)
            if k.startswith(src):
                extra[dst + k[len(src):]] = v + torch.randn(v.shape, generator=g) * 0.01
        extra[dst + "enorm.weight"] = rnd(h, vec=True)
        extra[dst + "hnorm.weight"] = rnd(h, vec=True)
        extra[dst + "eh_proj.weight"] = rnd(h, 2 * h)
        extra[dst + "shared_head.norm.weight"] = rnd(h, vec=True)
        extra[dst + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
        extra[dst + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    else:  # qwen3_next / qwen3_5: `mtp.*`, block = a full-attention layer
        full = cfg.get("layer_types", []).index("full_attention") if "layer_types" in cfg else 1
        src = f"model.layers.{full}."
        for k, v in sd.items():
            if k.startswith(src):
                extra["mtp.layers.0." + k[len(src):]] = v + torch.randn(v.shape, generator=g) * 0.01
        extra["mtp.fc.weight"] = rnd(h, 2 * h)
        extra["mtp.pre_fc_norm_embedding.weight"] = rnd(h, vec=True)
        extra["mtp.pre_fc_norm_hidden.weight"] = rnd(h, vec=True)
        extra["mtp.norm.weight"] = rnd(h, vec=True)
        cfg["mtp_num_hidden_layers"] = 1
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    sd.update({k: v.contiguous() for k, v in extra.items()})
    save_file(sd, str(path), metadata={"format": "pt"})


def build(kind: str, folder: str | Path, *, legacy: bool = False, fused: bool = False, shards: int = 0,
          dtype: str | None = None, mtp: bool = False, vl: bool = False, seed: int = 0) -> Path:
    """Write fixture ``kind`` into ``folder``; returns the folder.

    ``legacy``: config.json in the hub's top-level rope style; ``fused``: experts saved as
    transformers-5 fused banks; ``shards``: split the safetensors into about this many files with
    an index; ``dtype``: "bfloat16"/"float16" weights; ``mtp``: add hub-layout MTP tensors;
    ``vl``: save the VL wrapper (qwen3_5, gemma3_text only).
    """
    import torch

    folder = Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = make_model(kind, seed, vl=vl)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    kw: dict[str, Any] = {"safe_serialization": True}
    if fused:
        kw["save_original_format"] = False
    if shards:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        kw["max_shard_size"] = max(int(math.ceil(total / shards)) + 1, 1024)
    model.save_pretrained(str(folder), **kw)
    train_tokenizer(folder)
    gen = {"eos_token_id": [2, 1], "bos_token_id": None, "pad_token_id": 0, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if mtp:
        inject_mtp(folder, kind, model)
    if legacy:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(legacy_config(cfg), indent=2))
    return folder


# ----------------------------------------------------------------------------------- session cache

_ROOT: list[Path] = []


def root() -> Path:
    """A per-process folder for built fixtures (removed at exit)."""
    if not _ROOT:
        import atexit
        import tempfile

        _ROOT.append(Path(tempfile.mkdtemp(prefix="cmf-hf-fixtures-")))
        atexit.register(shutil.rmtree, str(_ROOT[0]), True)
    return _ROOT[0]


_CACHE: dict[tuple[Any, ...], Path] = {}


def fixture(kind: str, **variant: Any) -> Path:
    """``build(kind, ...)`` once per process and variant; returns the (read-only by convention) folder."""
    key = (kind, tuple(sorted(variant.items())))
    if key not in _CACHE:
        tag = "-".join(f"{k}{v}" for k, v in sorted(variant.items()) if v) or "base"
        _CACHE[key] = build(kind, root() / f"{kind}-{tag}", **variant)
    return _CACHE[key]


def converted(kind: str, quant: str = "f32", **variant: Any) -> Path:
    """The fixture converted with ``cmf.convert.convert`` at ``quant`` (cached like ``fixture``)."""
    from cmf.convert import convert

    key = ("cmf", kind, quant, tuple(sorted(variant.items())))
    if key not in _CACHE:
        src = fixture(kind, **variant)
        out = src.parent / f"{src.name}.{quant}.cmf"
        convert(src, out, quant=quant)
        _CACHE[key] = out
    return _CACHE[key]
