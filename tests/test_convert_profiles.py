"""The converter's architecture profiles (cmf/convert/profiles.py): each complete and consistent,
and the only place in cmf/convert/ that lists model types or branches on one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cmf.convert import names
from cmf.convert.config import LAYER_RULES, MOE_KINDS, load_config
from cmf.convert.errors import ConvertError
from cmf.convert.profiles import (ARCH_TO_TYPE, CAUSAL_LM, DEFAULTS, GGUF_EXPORTS, GGUF_IMPORTS, PROFILES, SUPPORTED,
                                  TEXT_TYPES, WRAPPERS, profile)

CONVERT = Path(__file__).resolve().parent.parent / "src" / "cmf" / "convert"
ALL = sorted(PROFILES)


@pytest.mark.parametrize("mt", ALL)
def test_profile_is_complete(mt: str) -> None:
    p = profile(mt)
    assert p.name == mt
    assert p.causal_lm.endswith("ForCausalLM") and CAUSAL_LM[mt] == p.causal_lm
    assert TEXT_TYPES[mt] == (p.arch_name, p.family) and DEFAULTS[mt] is p.defaults
    # every rule a profile names exists where it is applied
    assert p.layer_rule in LAYER_RULES
    assert p.moe is None or p.moe in MOE_KINDS
    assert p.family == "llama" or p.family in names.RENAMES or p.family in names._SPLITS
    assert p.norm_style in ("qwen", "gemma") and p.mtp_style in ("qwen", "deepseek")
    # defaults hold every key the converter falls back on
    for key in ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", p.activation_key, *p.softcap_keys, *p.ignored_keys):
        assert key in p.defaults, key
    if p.moe is not None:
        assert "num_experts_per_tok" in p.defaults
    if p.mla:
        assert {"kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"} <= set(p.defaults)
    for spelling, key in p.key_aliases:
        assert spelling != key and key in p.defaults


def test_tables_round_trip() -> None:
    # export maps a header's arch_name back to exactly one profile
    assert len(ARCH_TO_TYPE) == len(PROFILES)
    assert all(ARCH_TO_TYPE[p.arch_name] == mt for mt, p in PROFILES.items())
    # wrappers lead to a text profile and are not text types themselves
    assert all(WRAPPERS[w] == mt for mt, p in PROFILES.items() for w in p.wrappers)
    assert not set(WRAPPERS) & set(PROFILES)
    assert SUPPORTED == tuple(sorted(set(PROFILES) | set(WRAPPERS)))
    # GGUF: one model_type per imported arch; every arch's profiles agree on llama.cpp's conventions
    importers = [p.gguf.arch for p in PROFILES.values() if p.gguf and p.gguf.imports]
    assert len(importers) == len(set(importers)) == len(GGUF_IMPORTS)
    for arch, mt in GGUF_IMPORTS.items():
        assert PROFILES[mt].gguf.arch == arch
    for mt, arch in GGUF_EXPORTS.items():
        assert PROFILES[mt].gguf.arch == arch
        assert PROFILES[mt].gguf.permute_qk == PROFILES[GGUF_IMPORTS[arch]].gguf.permute_qk


def test_old_table_names_importable() -> None:
    import sys

    from cmf.convert import config, gguf, gguf_export

    export = sys.modules["cmf.convert.export"]
    assert config.TEXT_TYPES is TEXT_TYPES and config.WRAPPERS is WRAPPERS and config.DEFAULTS is DEFAULTS
    assert export.CAUSAL_LM is CAUSAL_LM and export.ARCH_TO_TYPE is ARCH_TO_TYPE
    assert gguf.ARCH_TO_MODEL_TYPE == {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                                       "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
    assert gguf_export.MODEL_TYPE_TO_ARCH == {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                                              "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}


def test_unsupported_type_is_named() -> None:
    with pytest.raises(ConvertError, match="'bert'.*supported: deepseek_v3"):
        profile("bert")
    with pytest.raises(ConvertError, match="model_type 'bert' is not supported"):
        load_config({"model_type": "bert"})


@pytest.mark.parametrize("mt", ALL)
def test_minimal_config_follows_profile(mt: str) -> None:
    """A config of four keys converts with the profile's defaults, and the header shows its flags."""
    p = profile(mt)
    mc = load_config({"model_type": mt, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                      "intermediate_size": 128})
    a = mc.arch
    assert mc.profile is p and mc.family == p.family and a["arch_name"] == p.arch_name
    assert a["norm_style"] == p.norm_style
    assert ("moe" in a) == (p.moe is not None)
    assert ("mla" in a) == p.mla
    assert ("embed_multiplier" in a) == p.embed_scale
    assert ("LinearAttention" in a["layer_types"]) == (p.layer_rule == "linear_interval")
    for w in p.wrappers:  # a wrapper config reaches the same profile
        assert load_config({"model_type": w, "text_config": {"hidden_size": 64, "num_hidden_layers": 4,
                                                             "num_attention_heads": 4, "intermediate_size": 128}
                            }).profile is p


# Rule tables keyed by a name family or MoE kind named after the model that introduced it, the
# fallback family, and llama.cpp pre-tokenizer ids: string literals that equal a model type but
# do not list model types.
LITERAL_OK = {("names.py", "mixtral"), ("names.py", "phi3"), ("names.py", "qwen3_next"), ("config.py", "mixtral"),
              ("export.py", "mixtral"), ("export.py", "llama"), ("gguf_pretok.py", "qwen2")}
# Variables that hold a model type, a name family or a GGUF arch.
TYPE_VARS = {"mt", "model_type", "family", "arch", "arch_name", "top_type", "ttype", "source_type"}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _var(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _strings(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_strings(e) for e in node.elts)
    return False


def test_profiles_are_the_only_list_of_model_types() -> None:
    known = set(PROFILES) | set(WRAPPERS) | {p.arch_name for p in PROFILES.values()}
    branches, literals = [], []
    for path in sorted(CONVERT.glob("*.py")):
        if path.name == "profiles.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Compare) and _var(n.left) in TYPE_VARS and any(_strings(c) for c in n.comparators):
                branches.append(f"{path.name}:{n.lineno}")
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "startswith"
                    and _var(n.func.value) in TYPE_VARS):
                branches.append(f"{path.name}:{n.lineno}")
            if (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in known and id(n) not in docs
                    and (path.name, n.value) not in LITERAL_OK):
                literals.append(f"{path.name}:{n.lineno} {n.value!r}")
    assert not branches, f"branches on a model type outside profiles.py: {branches}"
    assert not literals, f"model types named outside profiles.py: {literals}"
