"""config.json -> the header ``arch`` block (spec §2, REFERENCE_NOTES §1.2, §3).

Hub configs and transformers-5 configs spell the same model two ways (top-level ``rope_theta`` /
``rope_scaling`` / ``partial_rotary_factor`` / ``rope_local_base_freq`` against a nested
``rope_parameters``; ``full_attention_interval`` against ``layer_types``; ``num_experts`` against
``num_local_experts``); both normalise here to the same arch. Keys a config leaves out take the
transformers defaults of its type (the profile's ``defaults``, :mod:`.profiles`) — nested
``text_config`` blocks on the hub omit everything equal to the class default. What differs
between architectures is read from their :class:`~.profiles.Profile`; the rules a profile names
(layer schedules, MoE blocks) are the tables :data:`LAYER_RULES` and :data:`MOE_KINDS` here.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ConvertError
from .profiles import DEFAULTS, SUPPORTED, TEXT_TYPES, WRAPPERS, Profile, profile

log = logging.getLogger(__name__)

# Kept importable under their old names: derived from the profiles.
__all__ = ["ACTIVATIONS", "DEFAULTS", "LAYER_RULES", "LAYER_TYPE_NAMES", "MOE_KINDS", "ModelConfig", "SUPPORTED",
           "TEXT_TYPES", "WRAPPERS", "load_config", "text_config"]

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

    @property
    def profile(self) -> Profile:
        """What the converter knows of the text model_type."""
        return profile(self.model_type)


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
    if mt not in TEXT_TYPES:  # not profile(mt): the message names the wrapper too
        raise ConvertError(f"model_type {top_type!r}" + (f" (text model {mt!r})" if mt != top_type else "")
                           + f" is not supported; supported: {', '.join(SUPPORTED)}")
    p = profile(mt)
    text = dict(p.defaults)
    text.update({k: v for k, v in raw.items()})
    for spelling, key in p.key_aliases:  # the alias beats the default of the key it stands for
        if spelling in raw and key not in raw:
            text[key] = raw[spelling]
    if text.get("use_bidirectional_attention"):
        raise ConvertError(f"{mt}: use_bidirectional_attention models are encoders, not causal LMs")
    mc = ModelConfig(source_type=top_type, model_type=mt, arch_name=p.arch_name, family=p.family, text=text, arch={})
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
    c, mt, p = mc.text, mc.model_type, mc.profile
    hidden = int(_req(c, "hidden_size", mt))
    layers = int(_req(c, "num_hidden_layers", mt))
    heads = int(_req(c, "num_attention_heads", mt))
    kv = int(c.get("num_key_value_heads") or heads)
    mla = p.mla
    if mla:
        head_dim = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
    else:
        head_dim = int(c.get("head_dim") or hidden // heads)
    inter = c.get("intermediate_size")
    if inter is None:
        inter = c.get("moe_intermediate_size")
    if inter is None:
        raise ConvertError(f"config.json ({mt}) has neither intermediate_size nor moe_intermediate_size")
    act = c.get(p.activation_key) or c.get("hidden_act") or "silu"
    if p.legacy_gelu_tanh and act == "gelu":
        act = "gelu_pytorch_tanh"  # transformers reads gemma's legacy "gelu" as the tanh form
    if act not in ACTIVATIONS:
        raise ConvertError(f"{mt}: activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    layer_types = _layer_types(c, p, layers)
    a: dict[str, Any] = {
        "arch_name": mc.arch_name, "hidden_size": hidden, "intermediate_size": int(inter), "num_layers": layers,
        "num_attention_heads": heads, "num_kv_heads": kv, "head_dim": head_dim,
        "vocab_size": int(_req(c, "vocab_size", mt)), "layer_types": layer_types,
        "rms_norm_eps": float(c.get("rms_norm_eps") or 1e-6),
        "max_position_embeddings": int(_req(c, "max_position_embeddings", mt)),
        "norm_style": p.norm_style,
        "hidden_act": ACTIVATIONS[act], "tie_word_embeddings": mc.tie_word_embeddings,
    }
    rotary_head = int(c["qk_rope_head_dim"]) if mla else head_dim
    _rope(mc, a, rotary_head, layer_types)
    if p.embed_scale:
        a["embed_multiplier"] = math.sqrt(hidden)  # transformers scales embeddings by √hidden
    if "SlidingAttention" in layer_types:
        a["sliding_window"] = int(_req(c, "sliding_window", mt))
        if p.records_sliding_pattern and "FullAttention" in layer_types:
            # The every-Nth-layer-is-global schedule, for runtimes that read it instead of layer_types.
            pattern = layer_types.index("FullAttention") + 1
            if layer_types == _pattern_types(layers, pattern):
                a["sliding_window_pattern"] = pattern
    for key in p.softcap_keys:
        if c.get(key) is not None:
            a[key] = float(c[key])
    for key in p.ignored_keys:  # the header carries only what the runtime should apply
        if c.get(key) is not None:
            log.info("%s: %s %s not recorded: transformers' %s does not apply it", mt, key, c[key], p.causal_lm)
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
    if p.moe is not None:
        a["moe"] = MOE_KINDS[p.moe](c, p)
    mc.arch = a
    mc.dims = {k: a[k] for k in ("num_attention_heads", "num_kv_heads", "head_dim", "hidden_size")}
    mc.dims.update({k: a[k] for k in a if k.startswith("linear_") and k != "linear_core"})
    if p.mtp_key is not None:
        mc.mtp_config_layers = int(c.get(p.mtp_key) or 0)


def _pattern_types(layers: int, pattern: int) -> list[str]:
    return ["FullAttention" if (i + 1) % pattern == 0 else "SlidingAttention" for i in range(layers)]


_FULL, _SLIDE = "FullAttention", "SlidingAttention"


def _full(c: dict[str, Any], n: int) -> list[str]:
    return [_FULL] * n


def _linear_interval(c: dict[str, Any], n: int) -> list[str]:
    k = int(c.get("full_attention_interval") or 4)
    return [_FULL if (i + 1) % k == 0 else "LinearAttention" for i in range(n)]


def _alternate(c: dict[str, Any], n: int) -> list[str]:
    return _pattern_types(n, 2)


def _sliding_pattern(c: dict[str, Any], n: int) -> list[str]:
    return _pattern_types(n, int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6))


def _max_window_layers(c: dict[str, Any], n: int) -> list[str]:
    on = bool(c.get("use_sliding_window")) and c.get("sliding_window") is not None
    mwl = int(c.get("max_window_layers") or 0)
    return [_SLIDE if on and i >= mwl else _FULL for i in range(n)]


def _odd_below_max_window(c: dict[str, Any], n: int) -> list[str]:
    on, mwl = bool(c.get("use_sliding_window")), int(c.get("max_window_layers") or 0)
    return [_SLIDE if on and (i + 1) % 2 and i < mwl else _FULL for i in range(n)]


def _window_if_enabled(c: dict[str, Any], n: int) -> list[str]:
    return [_SLIDE if c.get("use_sliding_window") and c.get("sliding_window") is not None else _FULL] * n


def _window(c: dict[str, Any], n: int) -> list[str]:
    return [_SLIDE if c.get("sliding_window") is not None else _FULL] * n


# Profile.layer_rule -> the schedule transformers derives when a config has no layer_types.
LAYER_RULES: dict[str, Callable[[dict[str, Any], int], list[str]]] = {
    "full": _full,  # every layer global
    "linear_interval": _linear_interval,  # qwen3_next: every full_attention_interval-th global, else linear
    "alternate": _alternate,  # gemma2: sliding, global, sliding, ...
    "sliding_pattern": _sliding_pattern,  # gemma3: every sliding_window_pattern-th global
    "max_window_layers": _max_window_layers,  # qwen2/3: sliding from max_window_layers on, if enabled
    "odd_below_max_window": _odd_below_max_window,  # qwen2_moe: 1st, 3rd, .. layer below max_window_layers
    "window_if_enabled": _window_if_enabled,  # all sliding when use_sliding_window and a window
    "window": _window,  # all sliding when the config has a window
}


def _layer_types(c: dict[str, Any], p: Profile, n: int) -> list[str]:
    """Per-layer attention kinds: explicit ``layer_types`` or the profile's rule (as transformers)."""
    mt = p.name
    lt = c.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != n:
            raise ConvertError(f"{mt}: layer_types must list {n} entries")
        bad = sorted({t for t in lt if t not in LAYER_TYPE_NAMES}, key=str)
        if bad:
            raise ConvertError(f"{mt}: layer type(s) {', '.join(map(str, bad))} are not supported")
        return [LAYER_TYPE_NAMES[t] for t in lt]
    return LAYER_RULES[p.layer_rule](c, n)


# ----------------------------------------------------------------------------------- rope


def _rope_dicts(c: dict[str, Any], p: Profile) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global profile, local profile or None) in one normalised shape, from either config style."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        glob = _norm_rope(rp.get("full_attention"), c, p, local=False)
        loc = _norm_rope(rp.get("sliding_attention"), c, p, local=True) if "sliding_attention" in rp else None
        return glob, loc
    if isinstance(rp, dict):
        glob = _norm_rope(rp, c, p, local=False)
    else:
        glob = _norm_rope(c.get("rope_scaling"), c, p, local=False)
    loc = None
    if p.local_rope_base:  # legacy: a local base of its own, never scaled
        loc = _norm_rope(None, c, p, local=True)
    return glob, loc


def _norm_rope(d: Any, c: dict[str, Any], p: Profile, local: bool) -> dict[str, Any]:
    d = dict(d) if isinstance(d, dict) else {}
    kind = d.pop("rope_type", None) or d.pop("type", None) or "default"
    d.pop("type", None)
    kind = {"su": "longrope", "mrope": "default"}.get(kind, kind)
    theta = d.pop("rope_theta", None)
    if theta is None:
        if local and p.local_rope_base:
            theta = c.get("rope_local_base_freq") or 10000.0
        else:
            theta = c.get("rope_theta") or p.defaults["rope_theta"]
    prf = d.pop("partial_rotary_factor", None)
    if prf is None:
        prf = c.get("partial_rotary_factor") or p.defaults["partial_rotary_factor"]
    if "original_max_position_embeddings" not in d and c.get("original_max_position_embeddings"):
        d["original_max_position_embeddings"] = c["original_max_position_embeddings"]
    for k in ("mrope_section", "mrope_interleaved"):  # text-only positions: M-RoPE == RoPE
        d.pop(k, None)
    return {"rope_type": kind, "rope_theta": float(theta), "partial_rotary_factor": float(prf), **d}


def _rope(mc: ModelConfig, a: dict[str, Any], head_dim: int, layer_types: list[str]) -> None:
    c, mt, p = mc.text, mc.model_type, mc.profile
    glob, loc = _rope_dicts(c, p)
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
        a["yarn"] = _yarn(glob, a, mla=p.mla)
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


def _qwen_moe(c: dict[str, Any], p: Profile) -> dict[str, Any]:
    n = c.get("num_experts") or c.get("num_local_experts")
    norm = bool(c.get("norm_topk_prob")) if p.moe_norm_topk is None else p.moe_norm_topk
    m: dict[str, Any] = {"num_experts": int(n), "top_k": int(c["num_experts_per_tok"]),
                         "moe_intermediate_size": int(c["moe_intermediate_size"]), "norm_topk_prob": norm}
    if p.moe_shared_expert and c.get("shared_expert_intermediate_size"):
        m["shared_expert_intermediate_size"] = int(c["shared_expert_intermediate_size"])
    return m


def _mixtral_moe(c: dict[str, Any], p: Profile) -> dict[str, Any]:
    return {"num_experts": int(c.get("num_local_experts") or c.get("num_experts")),
            "top_k": int(c["num_experts_per_tok"]), "moe_intermediate_size": int(c["intermediate_size"]),
            "norm_topk_prob": True}


def _deepseek_moe(c: dict[str, Any], p: Profile) -> dict[str, Any]:
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


# Profile.moe -> the header moe block from the config.
MOE_KINDS: dict[str, Callable[[dict[str, Any], Profile], dict[str, Any]]] = {
    "qwen": _qwen_moe,  # softmax router, optional gated shared expert (qwen2_moe .. qwen3_5_moe)
    "mixtral": _mixtral_moe,  # softmax router over intermediate_size experts, always renormalised
    "deepseek": _deepseek_moe,  # sigmoid router with groups, bias and scaling; dense first layers
}
