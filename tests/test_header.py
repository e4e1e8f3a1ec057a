"""Header JSON: typed views, defaults, unknown-key round trip, and every ParseError case."""

from __future__ import annotations

import copy
import json

import pytest

from cmf.format.errors import ParseError
from cmf.format.header import (
    MTP, Arch, Header, LinearCore, MoE, Shard, SkillRecord, TokenizerConfig, Yarn, as_arch,
    parse_header, serialize_header,
)

ARCH_REQUIRED = ("arch_name", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                 "num_kv_heads", "head_dim", "vocab_size", "layer_types", "rms_norm_eps",
                 "max_position_embeddings")


def _arch(**kw):
    a = {"arch_name": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
         "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 128,
         "layer_types": ["FullAttention", "LinearAttention"], "rms_norm_eps": 1e-6,
         "max_position_embeddings": 256}
    a.update(kw)
    return a


def _hdr(**kw):
    h = {"format": "cmf", "version": 2, "arch": _arch(), "quant_type": "Q4_BLOCK"}
    h.update(kw)
    return h


def _enc(d) -> bytes:
    return json.dumps(d).encode()


def test_minimal_header_and_arch_defaults():
    h = parse_header(_enc(_hdr()))
    assert isinstance(h, Header) and isinstance(h.arch, Arch)
    assert (h.format, h.version, h.quant_type) == ("cmf", 2, "Q4_BLOCK")
    a = h.arch
    assert a.layer_types == ("FullAttention", "LinearAttention")
    assert (a.rope_theta, a.partial_rotary_factor, a.hidden_act) == (10000.0, 1.0, "silu")
    assert (a.embed_multiplier, a.num_loops, a.norm_style, a.tie_word_embeddings) == (1.0, 1, "qwen", False)
    assert a.sliding_window is None and a.yarn is None and a.attention_heads_per_layer is None
    assert h.moe is None and h.mtp is None and a.num_experts == 0
    assert h.skills == [] and h.tokenizer_config is None and h.shard is None
    assert h.section_hashes == {} and h.provenance is None


def test_format_defaults_to_cmf():
    d = _hdr()
    del d["format"]
    assert parse_header(_enc(d)).format == "cmf"


def test_optional_blocks_are_typed():
    arch = _arch(
        norm_style="gemma", rope_theta=1000000, sliding_window=512, rope_local_base_freq=10000.0,
        local_partial_rotary_factor=0.5, attention_heads_per_layer=[4, 8],
        query_pre_attn_scalar=256, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        num_loops=2, tie_word_embeddings=True,
        yarn={"factor": 4, "original_max_position_embeddings": 8192},
        moe={"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
             "shared_expert_intermediate_size": 64, "routed_scaling_factor": 2.5},
        mtp={"num_layers": 1},
        linear_core={"kind": "gated_delta_net", "num_heads": 4, "value_head_dim": 16},
        sliding_window_pattern=None)
    h = parse_header(_enc(_hdr(arch=arch)))
    a = h.arch
    assert a.norm_style == "gemma" and a.rope_theta == 1e6 and isinstance(a.rope_theta, float)
    assert a.sliding_window == 512 and a.attention_heads_per_layer == (4, 8) and a.num_loops == 2
    assert a.query_pre_attn_scalar == 256.0 and a.final_logit_softcapping == 30.0
    assert a.sliding_window_pattern is None  # null is the same as absent for optional keys
    assert a.yarn == Yarn(factor=4.0, original_max_position_embeddings=8192, raw=arch["yarn"])
    assert (a.yarn.beta_fast, a.yarn.beta_slow, a.yarn.attention_factor) == (32.0, 1.0, 1.0)
    assert isinstance(h.moe, MoE) and h.moe.num_experts == 8 and h.moe.norm_topk_prob
    assert h.moe.router_sigmoid is False and h.moe.routed_scaling_factor == 2.5
    assert a.num_experts == 8
    assert h.mtp == MTP(num_layers=1, share_lm_head=True, share_embed=True, raw=arch["mtp"])
    assert isinstance(a.linear_core, LinearCore) and a.linear_core.nphase is None


def test_skills_tokenizer_shard_hashes_provenance():
    skills = [{"id": "sql", "name": "SQL", "layers": [3, 4],
               "selection": {"metric": "mse", "phi_layer": 1, "mean": "AA==", "basis": "AA==", "rank": 2,
                             "holdout_n": 3},
               "input_mask_task": None, "quality": {"metric": "ppl", "backbone": 21.4}},
              {"id": "gfx", "base_dir_hash": "9f22593eb458bc6f", "base_arch": "nanbeige",
               "task": "specialist", "provenance": {"tensors": 30}}]
    tok = {"chat_template": "{{ x }}", "eos_token_ids": [5, 6], "bos_token_id": None, "pad_token_id": 7}
    h = parse_header(_enc(_hdr(skills=skills, tokenizer_config=tok, shard={"no": 2, "count": 3},
                               section_hashes={"masks": "00000000000000ff", "vocab": "1"},
                               provenance={"tool": "t", "source_model": "m"})))
    assert [s.id for s in h.skills] == ["sql", "gfx"] and isinstance(h.skills[0], SkillRecord)
    assert h.skills[0].layers == (3, 4) and h.skills[0].selection["rank"] == 2
    assert h.skills[0].base_dir_hash is None and h.skills[1].base_dir_hash == "9f22593eb458bc6f"
    assert h.skills[1].layers == () and h.skills[1].provenance == {"tensors": 30}
    assert h.tokenizer_config == TokenizerConfig(chat_template="{{ x }}", eos_token_ids=(5, 6),
                                                 bos_token_id=None, pad_token_id=7, raw=tok)
    assert h.shard == Shard(no=2, count=3, raw={"no": 2, "count": 3})
    assert h.section_hashes == {"masks": "00000000000000ff", "vocab": "1"}
    assert h.provenance == {"tool": "t", "source_model": "m"}


def test_python_writer_nulls_are_accepted():
    h = parse_header(_enc(_hdr(skills=None, shard=None, tokenizer_config=None)))
    assert h.skills == [] and h.shard is None and h.tokenizer_config is None


def test_unknown_keys_round_trip_unchanged():
    d = _hdr(calibration={"temperature": 1.3}, routing={"temperature": 0.5}, zz_future=[1, {"é": None}],
             provenance={"tool": "x", "defrag": {"kept": [1, 2]}})
    d["arch"].update(mla={"kv_lora_rank": 4}, qwen4_exp={"hc_count": 4}, g3n=None)
    d["arch"]["moe"] = {"num_experts": 4, "top_k": 1, "moe_intermediate_size": 8, "future": True}
    raw = serialize_header(d)
    h = parse_header(raw)
    assert h.to_dict() == d
    assert list(h.to_dict()) == list(d)  # key order kept
    assert serialize_header(h.to_dict()) == raw
    assert h.to_bytes() == raw
    assert h.arch.raw["qwen4_exp"] == {"hc_count": 4} and h.moe.raw["future"] is True
    assert h.raw is not h.to_dict()  # a copy: editing it cannot corrupt the parsed view


def test_replace_and_from_dict():
    h = Header.from_dict(_hdr(zz=1))
    h2 = h.replace({"section_hashes": {"vocab": "ab"}, "quant_type": "F16"}, remove=["zz"])
    assert h2.section_hashes == {"vocab": "ab"} and h2.quant_type == "F16" and "zz" not in h2.raw
    assert h.quant_type == "Q4_BLOCK" and "zz" in h.raw  # the original is untouched
    with pytest.raises(ParseError, match="quant_type"):
        h.replace({"quant_type": "Q3"})


def test_as_arch():
    h = parse_header(_enc(_hdr()))
    assert as_arch(h) is h.arch and as_arch(h.arch) is h.arch
    assert as_arch(_arch()) == h.arch
    with pytest.raises(ParseError):
        as_arch({"arch_name": "x"})


def test_serialize_header_exact_bytes():
    d = {"b": 1, "a": ["é", 1.5, None, True], "c": {"x": "\u0001"}}
    assert serialize_header(d) == b'{"b":1,"a":["\xc3\xa9",1.5,null,true],"c":{"x":"\\u0001"}}'
    with pytest.raises(ValueError):
        serialize_header({"x": float("nan")})


# ----------------------------------------------------------------------------- ParseError cases


@pytest.mark.parametrize("raw, match", [
    (b'{"version": 2, "arch": {}, "quant_type": "F32", "x": "\xff"}', "UTF-8"),
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "must be an object"),
    (b'"cmf"', "must be an object"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply|not valid JSON"),
    (b'{"version": NaN}', "not valid JSON"),
    (b'{"version": 2, "version": 2}', "duplicate key"),
    (b'{"x": "\\ud800"}', "surrogate"),
    (b'\xef\xbb\xbf{"version": 2}', "not valid JSON"),
])
def test_malformed_json(raw, match):
    with pytest.raises(ParseError, match=match):
        parse_header(raw)


def test_paired_surrogate_escape_is_fine():
    h = parse_header(_enc(_hdr(provenance={"emoji": "\U0001f600"})))  # json.dumps escapes as a pair
    assert h.provenance == {"emoji": "\U0001f600"}


@pytest.mark.parametrize("key", ["version", "arch", "quant_type"])
def test_missing_top_level_key(key):
    d = _hdr()
    del d[key]
    with pytest.raises(ParseError, match=f"missing required key '{key}'"):
        parse_header(_enc(d))


@pytest.mark.parametrize("key", ARCH_REQUIRED)
def test_missing_arch_key(key):
    d = _hdr()
    del d["arch"][key]
    with pytest.raises(ParseError, match=f"arch is missing required key '{key}'"):
        parse_header(_enc(d))


@pytest.mark.parametrize("patch, match", [
    ({"quant_type": "Q3_K"}, "quant_type"),
    ({"quant_type": 3}, "quant_type must be a string"),
    ({"version": "2"}, "version must be an integer"),
    ({"version": -1}, "version must be an integer"),
    ({"version": 2**32}, "version must be an integer"),
    ({"version": True}, "version must be an integer"),
    ({"format": 1}, "format must be a string"),
    ({"arch": []}, "arch must be an object"),
    ({"skills": {}}, "skills must be an array"),
    ({"skills": [{"name": "x"}]}, r"skills\[0\] is missing required key 'id'"),
    ({"skills": [{"id": "a", "layers": [1, "2"]}]}, r"skills\[0\].layers\[1\]"),
    ({"skills": [{"id": "a", "selection": {"metric": "mse", "phi_layer": 1, "mean": "", "basis": ""}}]},
     "selection is missing required key 'rank'"),
    ({"tokenizer_config": {"eos_token_ids": [1, -2]}}, r"eos_token_ids\[1\]"),
    ({"tokenizer_config": "chatml"}, "tokenizer_config must be an object"),
    ({"shard": {"no": 1}}, "shard is missing required key 'count'"),
    ({"shard": {"no": 3, "count": 2}}, "shard.no"),
    ({"shard": {"no": 0, "count": 2}}, "shard.no"),
    ({"section_hashes": {"masks": 5}}, "section_hashes.masks must be a string"),
    ({"section_hashes": []}, "section_hashes must be an object"),
])
def test_bad_top_level_values(patch, match):
    with pytest.raises(ParseError, match=match):
        parse_header(_enc(_hdr(**patch)))


@pytest.mark.parametrize("patch, match", [
    ({"hidden_size": "64"}, "arch.hidden_size must be an integer"),
    ({"hidden_size": -1}, "arch.hidden_size must be an integer"),
    ({"hidden_size": 64.0}, "arch.hidden_size must be an integer"),
    ({"num_layers": True}, "arch.num_layers must be an integer"),
    ({"num_layers": None}, "arch.num_layers must be an integer"),
    ({"arch_name": 3}, "arch.arch_name must be a string"),
    ({"rms_norm_eps": "1e-6"}, "arch.rms_norm_eps must be a number"),
    ({"rms_norm_eps": 10**400}, "out of the float range"),
    ({"layer_types": "FullAttention"}, "arch.layer_types must be an array"),
    ({"layer_types": ["FullAttention", "Mamba"]}, r"arch.layer_types\[1\] = 'Mamba' is not one of"),
    ({"layer_types": [1]}, r"arch.layer_types\[0\] must be a string"),
    ({"norm_style": "llama"}, "arch.norm_style = 'llama' is not one of"),
    ({"norm_style": None}, "arch.norm_style must be a string"),
    ({"rope_theta": None}, "arch.rope_theta must be a number"),
    ({"tie_word_embeddings": 0}, "arch.tie_word_embeddings must be a boolean"),
    ({"sliding_window": 1.5}, "arch.sliding_window must be an integer"),
    ({"attention_heads_per_layer": [4, -1]}, r"arch.attention_heads_per_layer\[1\]"),
    ({"moe": {"num_experts": 4, "top_k": 2}}, "arch.moe is missing required key 'moe_intermediate_size'"),
    ({"moe": {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 8, "router_sigmoid": "yes"}},
     "arch.moe.router_sigmoid must be a boolean"),
    ({"moe": 4}, "arch.moe must be an object"),
    ({"mtp": {}}, "arch.mtp is missing required key 'num_layers'"),
    ({"yarn": {"factor": 4}}, "arch.yarn is missing required key 'original_max_position_embeddings'"),
    ({"linear_core": {"kind": "gdn", "num_heads": 2}}, "arch.linear_core is missing required key"),
    ({"mla": [1]}, "arch.mla must be an object"),
])
def test_bad_arch_values(patch, match):
    with pytest.raises(ParseError, match=match):
        parse_header(_enc(_hdr(arch=_arch(**patch))))


def test_memoryview_input_and_no_mutation_of_input():
    d = _hdr()
    raw = _enc(d)
    h = parse_header(memoryview(raw))
    assert h.raw == d
    snapshot = copy.deepcopy(h.raw)
    h.to_dict()["arch"]["hidden_size"] = 1
    assert h.raw == snapshot


# ----------------------------------------------------------------------------- layer schedule


@pytest.mark.parametrize("types", [["FullAttention"], ["FullAttention"] * 3])
def test_layer_types_length_must_equal_num_layers(types):
    with pytest.raises(ParseError) as exc:
        parse_header(_enc(_hdr(arch=_arch(layer_types=types))))
    assert str(exc.value) == (f"header: arch.layer_types lists {len(types)} entries but arch.num_layers is 2; "
                              "give one per layer (or [] for untagged layers)")
    with pytest.raises(ParseError, match="lists 1 entries but arch.num_layers is 2"):
        Arch.from_dict(_arch(layer_types=["FullAttention"]))


def test_empty_layer_types_means_untagged():
    a = parse_header(_enc(_hdr(arch=_arch(layer_types=[])))).arch
    assert a.layer_types == () and a.layer_kinds == ("FullAttention", "FullAttention")


def test_layer_kinds_from_sliding_window_pattern():
    full, slide, lin = "FullAttention", "SlidingAttention", "LinearAttention"
    a = Arch.from_dict(_arch(num_layers=7, layer_types=[full] * 7, sliding_window=16, sliding_window_pattern=3))
    assert a.layer_kinds == (slide, slide, full, slide, slide, full, slide)
    a = Arch.from_dict(_arch(num_layers=4, layer_types=[], sliding_window=16, sliding_window_pattern=2))
    assert a.layer_kinds == (slide, full, slide, full)
    # Tags win over the pattern; a pattern leaves non-attention layers alone.
    tagged = [slide, full, full, slide]
    assert Arch.from_dict(_arch(num_layers=4, layer_types=tagged, sliding_window_pattern=2)).layer_kinds == tuple(tagged)
    mixed = Arch.from_dict(_arch(num_layers=4, layer_types=[lin, full, lin, full], sliding_window_pattern=4))
    assert mixed.layer_kinds == (lin, slide, lin, full)
    for pattern in (None, 0, 1):  # absent, degenerate, or every layer global
        a = Arch.from_dict(_arch(layer_types=[full, full], sliding_window_pattern=pattern))
        assert a.layer_kinds == (full, full)
