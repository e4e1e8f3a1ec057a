"""config.json -> the header ``arch`` block (spec §2, REFERENCE_NOTES §1.2, §3).

Hub configs and transformers-5 configs spell the same model two ways (top-level ``rope_theta`` /
``rope_scaling`` / ``partial_rotary_factor`` / ``rope_local_base_freq`` against a nested
``rope_parameters``; ``full_attention_interval`` against ``layer_types``; ``num_experts`` against
``num_local_experts``); both normalise here to the same arch. Keys a config leaves out take the
transformers defaults of its family (:data:`DEFAULTS`) — nested ``text_config`` blocks on the hub
omit everything equal to the class default (gemma3 relies on that for its head geometry).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ConvertError

log = logging.getLogger(__name__)

# Multimodal wrappers -> the model_type of their text tower.
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma3": "gemma3_text"}
# Text model_type -> (arch_name, family for name rules).
TEXT_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "llama"), "mistral": ("mistral", "llama"), "qwen2": ("qwen2", "llama"),
    "qwen3": ("qwen3", "llama"), "qwen2_moe": ("qwen2_moe", "llama"), "qwen3_moe": ("qwen3_moe", "llama"),
    "qwen3_next": ("qwen3_next", "qwen3_next"), "qwen3_5_text": ("qwen3_5", "llama"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "llama"), "gemma": ("gemma", "llama"), "gemma2": ("gemma2", "llama"),
    "gemma3_text": ("gemma3", "llama"), "phi3": ("phi3", "phi3"), "mixtral": ("mixtral", "mixtral"),
    "deepseek_v3": ("deepseek_v3", "deepseek"), "glm4_moe": ("glm4_moe", "deepseek"),
}
SUPPORTED = tuple(sorted(set(TEXT_TYPES) | set(WRAPPERS)))
GEMMA_NORM = ("gemma", "gemma2", "gemma3_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

_B = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", rope_theta=10000.0,
          partial_rotary_factor=1.0)
_QWEN_SW = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
_LIN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
            linear_num_value_heads=32, full_attention_interval=4, partial_rotary_factor=0.25)
# transformers 5.24 class defaults of every key read below (data; see the module docstring).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_B, max_position_embeddings=2048, vocab_size=32000),
    "mistral": dict(_B, sliding_window=4096, max_position_embeddings=131072, vocab_size=32000),
    "qwen2": dict(_B, **_QWEN_SW, max_position_embeddings=32768, vocab_size=151936),
    "qwen3": dict(_B, **_QWEN_SW, max_position_embeddings=32768, vocab_size=151936),
    "qwen2_moe": dict(_B, **_QWEN_SW, max_position_embeddings=32768, vocab_size=151936, num_experts=60,
                      num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(_B, use_sliding_window=False, sliding_window=4096, max_position_embeddings=32768,
                      vocab_size=151936, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_next": dict(_B, **_LIN, max_position_embeddings=32768, vocab_size=151936, num_experts=512,
                       num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], head_dim=256),
    "qwen3_5_text": dict(_B, **_LIN, max_position_embeddings=32768, vocab_size=248320, head_dim=256),
    "qwen3_5_moe_text": dict(_B, **_LIN, max_position_embeddings=32768, vocab_size=248320, head_dim=256,
                             num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512),
    "gemma": dict(_B, max_position_embeddings=8192, vocab_size=256000, tie_word_embeddings=True,
                  hidden_act="gelu_pytorch_tanh", head_dim=256),
    "gemma2": dict(_B, max_position_embeddings=8192, vocab_size=256000, tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", head_dim=256, sliding_window=4096,
                   query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(_B, max_position_embeddings=131072, vocab_size=262208, tie_word_embeddings=True,
                        hidden_activation="gelu_pytorch_tanh", head_dim=256, sliding_window=4096,
                        query_pre_attn_scalar=256, attn_logit_softcapping=None, final_logit_softcapping=None,
                        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                        num_key_value_heads=4),
    "phi3": dict(_B, rms_norm_eps=1e-5, max_position_embeddings=4096, vocab_size=32064, sliding_window=None),
    "mixtral": dict(_B, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=131072, vocab_size=32000,
                    sliding_window=None, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(_B, max_position_embeddings=4096, vocab_size=129280, n_routed_experts=256,
                        num_experts_per_tok=8, moe_intermediate_size=2048, norm_topk_prob=True,
                        first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                        n_shared_experts=1, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, rope_interleave=True),
    "glm4_moe": dict(_B, rms_norm_eps=1e-5, max_position_embeddings=131072, vocab_size=151552, n_routed_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=1408, norm_topk_prob=True,
                     first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                     n_shared_experts=1, partial_rotary_factor=0.5),
}

# The scale and soft-capping keys each family's transformers model actually applies: Gemma 3
# keeps attn_logit_softcapping in its config but never passes it to attention (only Gemma 2 does),
# and the header must carry only what the runtime should apply.
SOFTCAP_KEYS: dict[str, tuple[str, ...]] = {
    "gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
    "gemma3_text": ("query_pre_attn_scalar", "final_logit_softcapping"),
}

LAYER_TYPE_NAMES = {"full_attention": "FullAttention", "sliding_attention": "SlidingAttention",
                    "linear_attention": "LinearAttention"}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu": "gelu"}


@dataclass
class ModelConfig:
    """A source config understood: the text-tower config with defaults, and the header arch."""

    source_type: str  # top-level model_type (a wrapper for VL checkpoints)
    model_type: str  # the text tower's model_type
    arch_name: str
    family: str  # which name rules apply (names.RENAMES / split_rules)
    text: dict[str, Any]  # text config with family defaults filled in
    arch: dict[str, Any]
    dims: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    mtp_config_layers: int = 0  # MTP modules the config announces (tensors decide)


def text_config(config: dict[str, Any]) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    """(source model_type, text model_type, raw text config, top-level config) of a config.json."""
    if not isinstance(config, dict):
        raise ConvertError("config.json is not a JSON object")
    top_type = config.get("model_type")
    if not isinstance(top_type, str):
        raise ConvertError("config.json has no model_type")
    if top_type in WRAPPERS:
        text = config.get("text_config")
        if text is None:  # a wrapper type spelled with a flat text config
            text = {k: v for k, v in config.items() if k != "vision_config"}
        if not isinstance(text, dict):
            raise ConvertError(f"config.json: text_config of a {top_type} model is not an object")
        text = dict(text)
        ttype = text.get("model_type") or WRAPPERS[top_type]
        if ttype in WRAPPERS:  # some hub configs repeat the wrapper type inside text_config
            ttype = WRAPPERS[ttype]
        return top_type, ttype, text, config
    return top_type, top_type, dict(config), config


def load_config(config: dict[str, Any]) -> ModelConfig:
    """Understand a config.json; raises ConvertError naming an unsupported model_type."""
    top_type, mt, raw, top = text_config(config)
    if mt not in TEXT_TYPES:
        raise ConvertError(f"model_type {top_type!r}" + (f" (text model {mt!r})" if mt != top_type else "")
                           + f" is not supported; supported: {', '.join(SUPPORTED)}")
    text = dict(DEFAULTS[mt])
    text.update({k: v for k, v in raw.items()})
    if mt in ("qwen3_moe",) and "num_local_experts" in raw and "num_experts" not in raw:
        text["num_experts"] = raw["num_local_experts"]
    if text.get("use_bidirectional_attention"):
        raise ConvertError(f"{mt}: use_bidirectional_attention models are encoders, not causal LMs")
    arch_name, family = TEXT_TYPES[mt]
    mc = ModelConfig(source_type=top_type, model_type=mt, arch_name=arch_name, family=family, text=text, arch={})
    tie = top.get("tie_word_embeddings") if top is not raw and "tie_word_embeddings" in top else None
    mc.tie_word_embeddings = bool(text.get("tie_word_embeddings") if tie is None else tie)
    _build_arch(mc)
    return mc


def _req(c: dict[str, Any], key: str, mt: str) -> Any:
    v = c.get(key)
    if v is None:
        raise ConvertError(f"config.json ({mt}) has no {key}")
    return v


def _build_arch(mc: ModelConfig) -> None:
    c, mt = mc.text, mc.model_type
    hidden = int(_req(c, "hidden_size", mt))
    layers = int(_req(c, "num_hidden_layers", mt))
    heads = int(_req(c, "num_attention_heads", mt))
    kv = int(c.get("num_key_value_heads") or heads)
    mla = mt == "deepseek_v3"
    if mla:
        head_dim = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
    else:
        head_dim = int(c.get("head_dim") or hidden // heads)
    inter = c.get("intermediate_size")
    if inter is None:
        inter = c.get("moe_intermediate_size")
    if inter is None:
        raise ConvertError(f"config.json ({mt}) has neither intermediate_size nor moe_intermediate_size")
    act_key = "hidden_activation" if mt in ("gemma2", "gemma3_text") else "hidden_act"
    act = c.get(act_key) or c.get("hidden_act") or "silu"
    if mt == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"  # transformers reads gemma's legacy "gelu" as the tanh form
    if act not in ACTIVATIONS:
        raise ConvertError(f"{mt}: activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    layer_types = _layer_types(c, mt, layers)
    a: dict[str, Any] = {
        "arch_name": mc.arch_name, "hidden_size": hidden, "intermediate_size": int(inter), "num_layers": layers,
        "num_attention_heads": heads, "num_kv_heads": kv, "head_dim": head_dim,
        "vocab_size": int(_req(c, "vocab_size", mt)), "layer_types": layer_types,
        "rms_norm_eps": float(c.get("rms_norm_eps") or 1e-6),
        "max_position_embeddings": int(_req(c, "max_position_embeddings", mt)),
        "norm_style": "gemma" if mt in GEMMA_NORM else "qwen",
        "hidden_act": ACTIVATIONS[act], "tie_word_embeddings": mc.tie_word_embeddings,
    }
    rotary_head = int(c["qk_rope_head_dim"]) if mla else head_dim
    _rope(mc, a, rotary_head, layer_types)
    if mt.startswith("gemma"):
        a["embed_multiplier"] = math.sqrt(hidden)  # transformers scales embeddings by √hidden
    if "SlidingAttention" in layer_types:
        a["sliding_window"] = int(_req(c, "sliding_window", mt))
        if mt in ("gemma2", "gemma3_text") and "FullAttention" in layer_types:
            # The every-Nth-layer-is-global schedule, for runtimes that read it instead of layer_types.
            pattern = layer_types.index("FullAttention") + 1
            if layer_types == _pattern_types(layers, pattern):
                a["sliding_window_pattern"] = pattern
    for key in SOFTCAP_KEYS.get(mt, ()):
        if c.get(key) is not None:
            a[key] = float(c[key])
    if mt == "gemma3_text" and c.get("attn_logit_softcapping") is not None:
        log.info("%s: attn_logit_softcapping %s not recorded: transformers' Gemma 3 does not apply it",
                 mt, c["attn_logit_softcapping"])
    if "LinearAttention" in layer_types:
        for key in ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                    "linear_key_head_dim", "linear_value_head_dim"):
            a[key] = int(_req(c, key, mt))
        a["linear_core"] = {"kind": "gated_delta_net", "num_heads": a["linear_num_value_heads"],
                            "value_head_dim": a["linear_value_head_dim"]}
    if mla:
        a["mla"] = {"q_lora_rank": None if c.get("q_lora_rank") is None else int(c["q_lora_rank"]),
                    "kv_lora_rank": int(c["kv_lora_rank"]), "qk_rope_head_dim": int(c["qk_rope_head_dim"]),
                    "qk_nope_head_dim": int(c["qk_nope_head_dim"]), "v_head_dim": int(c["v_head_dim"])}
        # No rope_interleave key: the rows are stored in the interchange layout (rope-first heads,
        # rope dims in half-split order; convert/mla_layout.py), which is how the key's absence
        # reads, here and in the reference.
    moe = _moe(c, mt)
    if moe is not None:
        a["moe"] = moe
    mc.arch = a
    mc.dims = {k: a[k] for k in ("num_attention_heads", "num_kv_heads", "head_dim", "hidden_size")}
    mc.dims.update({k: a[k] for k in a if k.startswith("linear_") and k != "linear_core"})
    if mt in ("deepseek_v3", "glm4_moe"):
        mc.mtp_config_layers = int(c.get("num_nextn_predict_layers") or 0)
    elif mt in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        mc.mtp_config_layers = int(c.get("mtp_num_hidden_layers") or 0)


def _gemma3_pattern(c: dict[str, Any]) -> int:
    return int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6)


def _pattern_types(layers: int, pattern: int) -> list[str]:
    return ["FullAttention" if (i + 1) % pattern == 0 else "SlidingAttention" for i in range(layers)]


def _layer_types(c: dict[str, Any], mt: str, n: int) -> list[str]:
    """Per-layer attention kinds: explicit ``layer_types`` or the family's rule (as transformers)."""
    lt = c.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != n:
            raise ConvertError(f"{mt}: layer_types must list {n} entries")
        bad = sorted({t for t in lt if t not in LAYER_TYPE_NAMES}, key=str)
        if bad:
            raise ConvertError(f"{mt}: layer type(s) {', '.join(map(str, bad))} are not supported")
        return [LAYER_TYPE_NAMES[t] for t in lt]
    full, slide = "FullAttention", "SlidingAttention"
    if mt in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        k = int(c.get("full_attention_interval") or 4)
        return [full if (i + 1) % k == 0 else "LinearAttention" for i in range(n)]
    if mt == "gemma2":
        return _pattern_types(n, 2)
    if mt == "gemma3_text":
        return _pattern_types(n, _gemma3_pattern(c))
    sw = c.get("sliding_window")
    if mt in ("qwen2", "qwen3"):
        on = bool(c.get("use_sliding_window")) and sw is not None
        mwl = int(c.get("max_window_layers") or 0)
        return [slide if on and i >= mwl else full for i in range(n)]
    if mt == "qwen2_moe":
        on, mwl = bool(c.get("use_sliding_window")), int(c.get("max_window_layers") or 0)
        return [slide if on and (i + 1) % 2 and i < mwl else full for i in range(n)]
    if mt == "qwen3_moe":
        return [slide if c.get("use_sliding_window") and sw is not None else full] * n
    if mt in ("mistral", "mixtral", "phi3"):
        return [slide if sw is not None else full] * n
    return [full] * n


# ----------------------------------------------------------------------------------- rope


def _rope_dicts(c: dict[str, Any], mt: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global profile, local profile or None) in one normalised shape, from either config style."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        glob = _norm_rope(rp.get("full_attention"), c, mt, local=False)
        loc = _norm_rope(rp.get("sliding_attention"), c, mt, local=True) if "sliding_attention" in rp else None
        return glob, loc
    if isinstance(rp, dict):
        glob = _norm_rope(rp, c, mt, local=False)
    else:
        glob = _norm_rope(c.get("rope_scaling"), c, mt, local=False)
    loc = None
    if mt == "gemma3_text":  # legacy: a local base of its own, never scaled
        loc = _norm_rope(None, c, mt, local=True)
    return glob, loc


def _norm_rope(d: Any, c: dict[str, Any], mt: str, local: bool) -> dict[str, Any]:
    d = dict(d) if isinstance(d, dict) else {}
    kind = d.pop("rope_type", None) or d.pop("type", None) or "default"
    d.pop("type", None)
    kind = {"su": "longrope", "mrope": "default"}.get(kind, kind)
    theta = d.pop("rope_theta", None)
    if theta is None:
        if local and mt == "gemma3_text":
            theta = c.get("rope_local_base_freq") or 10000.0
        else:
            theta = c.get("rope_theta") or DEFAULTS[mt]["rope_theta"]
    prf = d.pop("partial_rotary_factor", None)
    if prf is None:
        prf = c.get("partial_rotary_factor") or DEFAULTS[mt]["partial_rotary_factor"]
    if "original_max_position_embeddings" not in d and c.get("original_max_position_embeddings"):
        d["original_max_position_embeddings"] = c["original_max_position_embeddings"]
    for k in ("mrope_section", "mrope_interleaved"):  # text-only positions: M-RoPE == RoPE
        d.pop(k, None)
    return {"rope_type": kind, "rope_theta": float(theta), "partial_rotary_factor": float(prf), **d}


def _rope(mc: ModelConfig, a: dict[str, Any], head_dim: int, layer_types: list[str]) -> None:
    c, mt = mc.text, mc.model_type
    glob, loc = _rope_dicts(c, mt)
    a["rope_theta"] = glob["rope_theta"]
    a["partial_rotary_factor"] = glob["partial_rotary_factor"]
    rot = int(head_dim * glob["partial_rotary_factor"])
    kind = glob["rope_type"]
    if kind == "default":
        pass
    elif kind == "linear":
        a["rope_freq_factors"] = [float(glob["factor"])] * (rot // 2)
    elif kind == "llama3":
        a["rope_freq_factors"] = _llama3_factors(glob, rot)
    elif kind == "longrope":
        # The short factors serve the native window; transformers scales cos/sin by
        # attention_factor at every length, so the runtime must too.
        short = [float(x) for x in glob["short_factor"]]
        if len(short) != rot // 2:
            raise ConvertError(f"{mt}: longrope short_factor has {len(short)} entries, expected {rot // 2}")
        a["rope_freq_factors"] = short
        factor = glob.get("factor") or a["max_position_embeddings"] / glob["original_max_position_embeddings"]
        att = glob.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor)
                                                        / math.log(glob["original_max_position_embeddings"]))
        if att != 1.0:
            a["rope_attention_factor"] = float(att)
    elif kind == "yarn":
        a["yarn"] = _yarn(glob, a, mla=mt == "deepseek_v3")
    elif kind == "dynamic":
        log.info("%s: dynamic NTK RoPE equals plain RoPE within max_position_embeddings; stored as plain", mt)
    else:
        raise ConvertError(f"{mt}: rope type {kind!r} is not supported (default, linear, llama3, yarn, longrope)")
    if "SlidingAttention" in layer_types:
        if loc is None:
            if kind not in ("default", "dynamic"):
                log.warning("%s: sliding layers share the scaled %s RoPE, which the header cannot express "
                            "for local layers; they get the plain base frequency", mt, kind)
            loc = glob
        if loc["rope_type"] not in ("default", "dynamic"):
            raise ConvertError(f"{mt}: scaled RoPE ({loc['rope_type']}) on sliding layers is not supported")
        a["rope_local_base_freq"] = loc["rope_theta"]
        a["local_partial_rotary_factor"] = loc["partial_rotary_factor"]


def _llama3_factors(r: dict[str, Any], dim: int) -> list[float]:
    """Per-frequency divisors equal to Llama 3.1's scaling (transformers' formula, in f64)."""
    factor, lo, hi = float(r["factor"]), float(r["low_freq_factor"]), float(r["high_freq_factor"])
    old = float(r["original_max_position_embeddings"])
    base = r["rope_theta"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            s = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - s) / factor + s))
    return out


def _yarn(r: dict[str, Any], a: dict[str, Any], mla: bool) -> dict[str, Any]:
    orig = r.get("original_max_position_embeddings")
    if orig is None:
        raise ConvertError("yarn RoPE needs original_max_position_embeddings")
    factor = r.get("factor")
    if factor is None:
        factor = a["max_position_embeddings"] / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = r.get("attention_factor")
    if att is None:
        m, mad = r.get("mscale"), r.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, mad) if m and mad else mscale(factor)
    y: dict[str, Any] = {"factor": factor, "original_max_position_embeddings": int(orig),
                         "beta_fast": float(r.get("beta_fast") or 32.0), "beta_slow": float(r.get("beta_slow") or 1.0),
                         "attention_factor": float(att)}
    if mla and r.get("mscale_all_dim"):
        y["mscale_all_dim"] = float(r["mscale_all_dim"])  # DeepSeek folds mscale² into the softmax scale
    if r.get("truncate") is False:
        y["truncate"] = False
    return y


# ----------------------------------------------------------------------------------- MoE


def _moe(c: dict[str, Any], mt: str) -> dict[str, Any] | None:
    if mt in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        n = c.get("num_experts") or c.get("num_local_experts")
        m: dict[str, Any] = {"num_experts": int(n), "top_k": int(c["num_experts_per_tok"]),
                             "moe_intermediate_size": int(c["moe_intermediate_size"]),
                             # qwen3_5_moe renormalises whatever its config says
                             "norm_topk_prob": True if mt == "qwen3_5_moe_text" else bool(c.get("norm_topk_prob"))}
        if mt != "qwen3_moe" and c.get("shared_expert_intermediate_size"):
            m["shared_expert_intermediate_size"] = int(c["shared_expert_intermediate_size"])
        return m
    if mt == "mixtral":
        return {"num_experts": int(c.get("num_local_experts") or c.get("num_experts")),
                "top_k": int(c["num_experts_per_tok"]), "moe_intermediate_size": int(c["intermediate_size"]),
                "norm_topk_prob": True}
    if mt in ("deepseek_v3", "glm4_moe"):
        m = {"num_experts": int(c.get("n_routed_experts") or c.get("num_local_experts")),
             "top_k": int(c["num_experts_per_tok"]), "moe_intermediate_size": int(c["moe_intermediate_size"]),
             "norm_topk_prob": bool(c.get("norm_topk_prob"))}
        if c.get("n_shared_experts"):
            m["shared_expert_intermediate_size"] = int(c["n_shared_experts"]) * int(c["moe_intermediate_size"])
        m["router_sigmoid"] = True
        m["routed_scaling_factor"] = float(c.get("routed_scaling_factor") or 1.0)
        m["n_group"] = int(c.get("n_group") or 1)
        m["topk_group"] = int(c.get("topk_group") or 1)
        m["first_k_dense_replace"] = int(c.get("first_k_dense_replace") or 0)
        return m
    return None
