"""One :class:`Profile` per supported text ``model_type``: all the converter knows of an architecture.

The other converter modules never compare a model_type (or a name family) with a string; they
read a profile's fields, each naming a rule that lives next to the code applying it:

- ``layer_rule`` -> :data:`cmf.convert.config.LAYER_RULES` (the layer schedule when a config has
  no ``layer_types``), ``moe`` -> :data:`cmf.convert.config.MOE_KINDS` (the header ``moe`` block);
- ``family`` -> the name rules of :mod:`cmf.convert.names` (renames, fused tensors to split);
- ``gguf`` -> llama.cpp's architecture and its conventions (:mod:`.gguf`, :mod:`.gguf_export`).

A new ``model_type`` that reuses known operators is one entry of :data:`PROFILES` (plus a tiny
fixture in tests/hf_fixtures.py). ``defaults`` are the transformers 5.24 class defaults of every
key the converter reads: nested ``text_config`` blocks on the hub omit everything equal to the
class default (gemma3 relies on that for its head geometry). This module imports nothing of the
converter but its error, so every other module can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from .errors import ConvertError


@dataclass(frozen=True)
class GgufArch:
    """How a model_type meets llama.cpp's GGUF."""

    arch: str  # llama.cpp's general.architecture
    imports: bool = False  # a GGUF of this arch reads back as this model_type
    exports: bool = False  # cmf export-gguf writes this model_type as ``arch``
    permute_qk: bool = False  # llama.cpp interleaves the Q/K rows of this arch (its ``permute``)
    attention_bias: bool = False  # the config's attention_bias follows the presence of a Q bias
    norm_topk_default: bool = False  # norm_topk_prob when the metadata has no expert_weights_norm


@dataclass(frozen=True)
class Profile:
    """What the converter needs to know of one text model_type (see the module docstring)."""

    name: str  # the text tower's model_type
    arch_name: str  # the header's arch_name
    causal_lm: str  # the transformers class of a text-only export
    defaults: Mapping[str, Any]
    family: str = "llama"  # name rules (names.RENAMES / split rules); "llama": names pass unchanged
    wrappers: tuple[str, ...] = ()  # multimodal model_types whose text tower this is
    key_aliases: tuple[tuple[str, str], ...] = ()  # (spelling, key): the spelling fills a key left out
    activation_key: str = "hidden_act"
    legacy_gelu_tanh: bool = False  # transformers reads a legacy "gelu" as the tanh form
    norm_style: str = "qwen"  # "gemma": RMSNorm weights are stored minus one
    embed_scale: bool = False  # embeddings scaled by sqrt(hidden_size)
    mla: bool = False  # DeepSeek multi-head latent attention
    layer_rule: str = "full"  # config.LAYER_RULES
    records_sliding_pattern: bool = False  # header sliding_window_pattern when the schedule is one
    softcap_keys: tuple[str, ...] = ()  # scale/soft-capping keys transformers applies
    ignored_keys: tuple[str, ...] = ()  # config keys transformers never applies: logged, not recorded
    local_rope_base: bool = False  # legacy configs: sliding layers have a base of their own, unscaled
    moe: str | None = None  # config.MOE_KINDS
    moe_shared_expert: bool = True  # reads shared_expert_intermediate_size
    moe_norm_topk: bool | None = None  # renormalises the top-k whatever the config says
    mtp_key: str | None = None  # config key counting the MTP modules
    mtp_style: str = "qwen"  # "deepseek": the MTP module is the layer after the last
    gguf: GgufArch | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))


_B = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", rope_theta=10000.0,
          partial_rotary_factor=1.0)
_QWEN_SW = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
_LIN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
            linear_num_value_heads=32, full_attention_interval=4, partial_rotary_factor=0.25)
_QWEN_LIN = dict(norm_style="gemma", layer_rule="linear_interval", mtp_key="mtp_num_hidden_layers")
_DEEPSEEK = dict(family="deepseek", moe="deepseek", mtp_key="num_nextn_predict_layers", mtp_style="deepseek")
_LLAMA_GGUF = dict(permute_qk=True, attention_bias=True)


def _p(name: str, arch_name: str, causal_lm: str, defaults: dict[str, Any], **kw: Any) -> Profile:
    return Profile(name=name, arch_name=arch_name, causal_lm=causal_lm, defaults=defaults, **kw)


_ALL = (
    _p("llama", "llama", "LlamaForCausalLM", dict(_B, max_position_embeddings=2048, vocab_size=32000),
       gguf=GgufArch("llama", imports=True, exports=True, **_LLAMA_GGUF)),
    _p("mistral", "mistral", "MistralForCausalLM",
       dict(_B, sliding_window=4096, max_position_embeddings=131072, vocab_size=32000),
       layer_rule="window", gguf=GgufArch("llama", exports=True, **_LLAMA_GGUF)),
    _p("qwen2", "qwen2", "Qwen2ForCausalLM", dict(_B, **_QWEN_SW, max_position_embeddings=32768, vocab_size=151936),
       layer_rule="max_window_layers", gguf=GgufArch("qwen2", imports=True, exports=True)),
    _p("qwen3", "qwen3", "Qwen3ForCausalLM", dict(_B, **_QWEN_SW, max_position_embeddings=32768, vocab_size=151936),
       layer_rule="max_window_layers", gguf=GgufArch("qwen3", imports=True, exports=True)),
    _p("qwen2_moe", "qwen2_moe", "Qwen2MoeForCausalLM",
       dict(_B, **_QWEN_SW, max_position_embeddings=32768, vocab_size=151936, num_experts=60, num_experts_per_tok=4,
            moe_intermediate_size=1408, shared_expert_intermediate_size=5632, norm_topk_prob=False,
            decoder_sparse_step=1, mlp_only_layers=[]),
       layer_rule="odd_below_max_window", moe="qwen", gguf=GgufArch("qwen2moe", imports=True)),
    _p("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM",
       dict(_B, use_sliding_window=False, sliding_window=4096, max_position_embeddings=32768, vocab_size=151936,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
            decoder_sparse_step=1, mlp_only_layers=[]),
       key_aliases=(("num_local_experts", "num_experts"),), layer_rule="window_if_enabled", moe="qwen",
       moe_shared_expert=False, gguf=GgufArch("qwen3moe", imports=True, exports=True, norm_topk_default=True)),
    _p("qwen3_next", "qwen3_next", "Qwen3NextForCausalLM",
       dict(_B, **_LIN, max_position_embeddings=32768, vocab_size=151936, num_experts=512, num_experts_per_tok=10,
            moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], head_dim=256),
       family="qwen3_next", moe="qwen", **_QWEN_LIN),
    _p("qwen3_5_text", "qwen3_5", "Qwen3_5ForCausalLM",
       dict(_B, **_LIN, max_position_embeddings=32768, vocab_size=248320, head_dim=256),
       wrappers=("qwen3_5",), **_QWEN_LIN),
    _p("qwen3_5_moe_text", "qwen3_5_moe", "Qwen3_5MoeForCausalLM",
       dict(_B, **_LIN, max_position_embeddings=32768, vocab_size=248320, head_dim=256, num_experts=256,
            num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512),
       wrappers=("qwen3_5_moe",), moe="qwen", moe_norm_topk=True, **_QWEN_LIN),
    _p("gemma", "gemma", "GemmaForCausalLM",
       dict(_B, max_position_embeddings=8192, vocab_size=256000, tie_word_embeddings=True,
            hidden_act="gelu_pytorch_tanh", head_dim=256),
       legacy_gelu_tanh=True, norm_style="gemma", embed_scale=True),
    _p("gemma2", "gemma2", "Gemma2ForCausalLM",
       dict(_B, max_position_embeddings=8192, vocab_size=256000, tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh", head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
       activation_key="hidden_activation", norm_style="gemma", embed_scale=True, layer_rule="alternate",
       records_sliding_pattern=True,
       softcap_keys=("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")),
    # Gemma 3 keeps attn_logit_softcapping in its config but never passes it to attention (only
    # Gemma 2 does), and the header must carry only what the runtime should apply.
    _p("gemma3_text", "gemma3", "Gemma3ForCausalLM",
       dict(_B, max_position_embeddings=131072, vocab_size=262208, tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh", head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
            attn_logit_softcapping=None, final_logit_softcapping=None, sliding_window_pattern=6,
            rope_theta=1000000.0, rope_local_base_freq=10000.0, hidden_size=2304, intermediate_size=9216,
            num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4),
       wrappers=("gemma3",), activation_key="hidden_activation", norm_style="gemma", embed_scale=True,
       layer_rule="sliding_pattern", records_sliding_pattern=True,
       softcap_keys=("query_pre_attn_scalar", "final_logit_softcapping"), ignored_keys=("attn_logit_softcapping",),
       local_rope_base=True),
    _p("phi3", "phi3", "Phi3ForCausalLM",
       dict(_B, rms_norm_eps=1e-5, max_position_embeddings=4096, vocab_size=32064, sliding_window=None),
       family="phi3", layer_rule="window"),
    _p("mixtral", "mixtral", "MixtralForCausalLM",
       dict(_B, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=131072, vocab_size=32000,
            sliding_window=None, num_local_experts=8, num_experts_per_tok=2),
       family="mixtral", layer_rule="window", moe="mixtral"),
    _p("deepseek_v3", "deepseek_v3", "DeepseekV3ForCausalLM",
       dict(_B, max_position_embeddings=4096, vocab_size=129280, n_routed_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=2048, norm_topk_prob=True, first_k_dense_replace=3, n_group=8, topk_group=4,
            routed_scaling_factor=2.5, n_shared_experts=1, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rope_interleave=True),
       mla=True, **_DEEPSEEK),
    _p("glm4_moe", "glm4_moe", "Glm4MoeForCausalLM",
       dict(_B, rms_norm_eps=1e-5, max_position_embeddings=131072, vocab_size=151552, n_routed_experts=128,
            num_experts_per_tok=8, moe_intermediate_size=1408, norm_topk_prob=True, first_k_dense_replace=1,
            n_group=1, topk_group=1, routed_scaling_factor=1.0, n_shared_experts=1, partial_rotary_factor=0.5),
       **_DEEPSEEK),
)
PROFILES: Mapping[str, Profile] = MappingProxyType({p.name: p for p in _ALL})
# Derived views (the names the modules exported before the profiles; read-only).
WRAPPERS: Mapping[str, str] = MappingProxyType({w: p.name for p in _ALL for w in p.wrappers})
TEXT_TYPES: Mapping[str, tuple[str, str]] = MappingProxyType({p.name: (p.arch_name, p.family) for p in _ALL})
DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({p.name: p.defaults for p in _ALL})
SUPPORTED = tuple(sorted(set(PROFILES) | set(WRAPPERS)))
CAUSAL_LM: Mapping[str, str] = MappingProxyType({p.name: p.causal_lm for p in _ALL})
ARCH_TO_TYPE: Mapping[str, str] = MappingProxyType({p.arch_name: p.name for p in _ALL})
GGUF_IMPORTS: Mapping[str, str] = MappingProxyType({p.gguf.arch: p.name for p in _ALL if p.gguf and p.gguf.imports})
GGUF_EXPORTS: Mapping[str, str] = MappingProxyType({p.name: p.gguf.arch for p in _ALL if p.gguf and p.gguf.exports})


def profile(model_type: str) -> Profile:
    """The profile of a text model_type; ConvertError naming it (and what is supported) otherwise."""
    p = PROFILES.get(model_type)
    if p is None:
        raise ConvertError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    return p


def family_of(model_type: str, default: str = "llama") -> str:
    """The name-rule family of a model_type, ``default`` for one without a profile."""
    p = PROFILES.get(model_type)
    return default if p is None else p.family
