"""Converter pieces that need neither torch nor transformers: config normalisation, the dtype
policy, name tables and splits, the tokenizer bundle, the lazy safetensors reader (bf16, partial
reads), hub-id resolution offline, refusals, and an end-to-end conversion of a numpy-built
checkpoint."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import cmf
from cmf.cli import main
from cmf.convert import ConvertError, convert
from cmf.convert.config import load_config
from cmf.convert.names import Cut, RenameTable, rename_table, sort_key, split_rules, unwrap
from cmf.convert.policy import Policy
from cmf.convert.source import Checkpoint, resolve
from cmf.convert.tokenizer import read_tokenizer

H, I, NH, NKV, HD, V, L = 64, 96, 4, 2, 16, 128, 2


def llama_config(**over) -> dict:
    c = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": I,
         "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NKV, "vocab_size": V,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "rope_theta": 500000.0, "tie_word_embeddings": False,
         "eos_token_id": 2, "bos_token_id": 1,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}}
    c.update(over)
    return c


def write_llama(folder: Path, seed: int = 0, **over) -> dict[str, np.ndarray]:
    """A llama checkpoint written with numpy only (no torch)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((V, H)),
                                "lm_head.weight": rng.standard_normal((V, H)), "model.norm.weight": 1 + rng.standard_normal(H) * 0.1}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(H)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(H)
        for n, shape in (("self_attn.q_proj", (NH * HD, H)), ("self_attn.k_proj", (NKV * HD, H)),
                         ("self_attn.v_proj", (NKV * HD, H)), ("self_attn.o_proj", (H, NH * HD)),
                         ("mlp.gate_proj", (I, H)), ("mlp.up_proj", (I, H)), ("mlp.down_proj", (H, I))):
            t[p + n + ".weight"] = rng.standard_normal(shape) * 0.05
    t = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(llama_config(**over)))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "added_tokens": [
        {"id": 2, "content": "</s>", "special": True}], "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "chat_template": [{"name": "tool_use", "template": "T"},
                                               {"name": "default", "template": "{{ messages }}"}]}))
    return t


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file by hand (numpy cannot save bf16)."""
    head, data, at = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        data += raw
        at += len(raw)
    h = json.dumps(head).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


# ----------------------------------------------------------------------------------- end to end


def test_numpy_checkpoint_converts_exactly_and_quantizes(tmp_path) -> None:
    src = write_llama(tmp_path / "src")
    out = convert(tmp_path / "src", tmp_path / "m.cmf", quant="f32").paths[0]
    with cmf.open(out) as f:
        assert f.verify() == []
        assert sorted(f.keys()) == sorted(src)
        for k, v in src.items():
            np.testing.assert_array_equal(f.array(k), v)
        a = f.header.raw["arch"]
        assert a["head_dim"] == HD and a["rope_theta"] == 500000.0 and len(a["rope_freq_factors"]) == HD // 2
        tc = f.header.tokenizer_config
        assert tc.chat_template == "{{ messages }}" and list(tc.eos_token_ids) == [2] and tc.bos_token_id == 1
    q8 = convert(tmp_path / "src", tmp_path / "q.cmf", quant="q8").paths[0]
    with cmf.open(q8) as f:
        for k, v in src.items():
            t = f.tensor(k)
            assert t.dtype.label == ("f16" if v.ndim == 1 else "q8_row"), k
            amax = np.abs(v.reshape(v.shape[0], -1)).max(axis=-1, keepdims=True) if v.ndim == 2 else np.abs(v)
            bound = 0.51 * amax / 127 + 1e-7 if v.ndim == 2 else np.abs(v) * 2.0**-11
            assert (np.abs(f.array(k) - v) <= bound).all(), k


def test_dry_run_and_cli_plan(tmp_path, capsys) -> None:
    write_llama(tmp_path / "src")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["convert", "-m", str(tmp_path / "src"), "-o", str(tmp_path / "x.cmf"), "--quant", "q4tp",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.down_proj.weight" in out and "q4tp" in out and "total: 21 tensors" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert main(["convert", "-m", str(tmp_path / "src"), "--dry-run", "--json", "--quant", "vbit"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "vbit" in data["dtypes"] and "vbit_ro" not in data["dtypes"]  # what every reference reader decodes
    assert data["options"] == {"quant": "vbit", "mean_bits": 4.25}
    assert main(["convert", "-m", str(tmp_path / "src"), "--dry-run", "--json", "--quant", "vbit_ro"]) == 0
    data = json.loads(capsys.readouterr().out)  # the row-offset form only when asked for by name
    assert "vbit_ro" in data["dtypes"] and "vbit" not in data["dtypes"]
    assert data["options"] == {"quant": "vbit_ro", "mean_bits": 4.25}


def test_unsupported_model_type_is_refused_by_name(tmp_path, capsys) -> None:
    write_llama(tmp_path / "src", model_type="gpt2")
    with pytest.raises(ConvertError, match="model_type 'gpt2' is not supported"):
        convert(tmp_path / "src", tmp_path / "m.cmf")
    assert main(["convert", "-m", str(tmp_path / "src"), "-o", str(tmp_path / "m.cmf")]) == 2
    assert "gpt2" in capsys.readouterr().err
    assert not (tmp_path / "m.cmf").exists()
    cfg = {"model_type": "gemma3", "text_config": {"model_type": "gemma4_text"}}
    with pytest.raises(ConvertError, match="gemma4_text"):
        load_config(cfg)


def test_refusals_leave_nothing_behind(tmp_path) -> None:
    from safetensors.numpy import save_file

    t = write_llama(tmp_path / "src")
    t["vision_model.patch.weight"] = np.zeros((4, 4), np.float32)  # an unknown tower: never guess
    save_file(t, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(ConvertError, match="vision_model.patch.weight"):
        convert(tmp_path / "src", tmp_path / "m.cmf")
    del t["vision_model.patch.weight"]
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(t, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(ConvertError, match="NaN"):
        convert(tmp_path / "src", tmp_path / "m.cmf", quant="q8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no spool, no temp
    del t["lm_head.weight"]
    save_file(t, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(ConvertError, match="lm_head.weight is missing"):
        convert(tmp_path / "src", tmp_path / "m.cmf", quant="f32")


def test_hub_ids_offline_and_bad_paths(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ConvertError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve("someorg/some-model")
    with pytest.raises(ConvertError, match="no such model folder"):
        resolve(str(tmp_path / "nope"))
    with pytest.raises(ConvertError, match="no such model folder"):
        resolve("./a/b/c")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ConvertError, match="it is a file"):
        resolve(str(tmp_path / "file.txt"))
    assert resolve(tmp_path) == tmp_path


# ----------------------------------------------------------------------------------- source reader


def test_bf16_widening_and_partial_reads(tmp_path) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 10, 6)).astype(np.float32)
    bits = (w.view(np.uint32) >> 16).astype("<u2")  # truncate to bf16
    want = (bits.astype(np.uint32) << 16).view(np.float32)
    h16 = rng.standard_normal((5, 4)).astype("<f2")
    write_safetensors(tmp_path / "model.safetensors", {
        "bank": ("BF16", w.shape, bits.tobytes()), "half": ("F16", h16.shape, h16.tobytes()),
        "ids": ("I64", (3,), np.arange(3, dtype="<i8").tobytes()),
        "fp8": ("F8_E4M3", (4,), bytes(4))})
    with Checkpoint(tmp_path) as ck:
        np.testing.assert_array_equal(ck.read("bank"), want)
        np.testing.assert_array_equal(ck.read("half"), h16.astype(np.float32))
        np.testing.assert_array_equal(ck.read("bank", Cut(index=2)), want[2])
        np.testing.assert_array_equal(ck.read("bank", Cut(index=1, rows=((6, 10), (0, 2)))),
                                      np.concatenate([want[1, 6:10], want[1, 0:2]]))
        np.testing.assert_array_equal(ck.read("half", Cut(rows=((1, 3),))), h16[1:3].astype(np.float32))
        with pytest.raises(ConvertError, match="I64"):
            ck.read("ids")
        with pytest.raises(ConvertError, match="FP8"):
            ck.read("fp8")
        with pytest.raises(ConvertError, match="outside"):
            ck.read("bank", Cut(index=3))


def test_sharded_index_and_broken_files(tmp_path) -> None:
    from safetensors.numpy import save_file

    save_file({"a": np.ones((2, 2), np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": np.zeros(3, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with Checkpoint(tmp_path) as ck:
        assert sorted(ck) == ["a", "b"]
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ConvertError, match="not a valid safetensors file"):
        Checkpoint(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConvertError, match="missing file"):
        Checkpoint(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConvertError, match="convert it to safetensors first"):
        Checkpoint(empty)


# ----------------------------------------------------------------------------------- config


def test_legacy_and_nested_rope_styles_agree() -> None:
    legacy = llama_config()
    nested = llama_config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
    del nested["rope_scaling"], nested["rope_theta"]
    assert load_config(legacy).arch == load_config(nested).arch
    yarn_l = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 10, "intermediate_size": 32, "max_position_embeddings": 4096, "rope_theta": 1e6,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    yarn_n = dict(yarn_l, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                           "original_max_position_embeddings": 1024})
    del yarn_n["rope_scaling"], yarn_n["rope_theta"]
    a = load_config(yarn_l).arch
    assert a == load_config(yarn_n).arch
    assert a["yarn"] == {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0,
                         "beta_slow": 1.0, "attention_factor": pytest.approx(0.1 * np.log(4.0) + 1)}
    assert a["head_dim"] == 16 and a["layer_types"] == ["FullAttention"] * 2


def test_hub_style_gemma3_text_config_takes_class_defaults() -> None:
    """Hub gemma3 configs list only what differs from Gemma3TextConfig's defaults."""
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}, "vision_config": {"model_type": "siglip_vision_model"}}
    mc = load_config(cfg)
    a = mc.arch
    assert (a["num_attention_heads"], a["num_kv_heads"], a["head_dim"], a["vocab_size"]) == (8, 4, 256, 262208)
    assert a["rope_theta"] == 1e6 and a["rope_local_base_freq"] == 10000.0
    assert a["rope_freq_factors"] == [8.0] * 128 and a["query_pre_attn_scalar"] == 256.0
    assert a["layer_types"][:6] == ["SlidingAttention"] * 5 + ["FullAttention"] and a["sliding_window_pattern"] == 6
    assert a["norm_style"] == "gemma" and a["hidden_act"] == "gelu_tanh" and a["embed_multiplier"] == 2560**0.5
    assert a["tie_word_embeddings"] is True and mc.source_type == "gemma3" and mc.model_type == "gemma3_text"


@pytest.mark.parametrize("cfg, types", [
    ({"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 2},
     ["LinearAttention", "FullAttention"] * 2),
    ({"model_type": "qwen2", "num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 8,
      "max_window_layers": 1}, ["FullAttention", "SlidingAttention", "SlidingAttention"]),
    ({"model_type": "qwen2", "num_hidden_layers": 2, "use_sliding_window": False, "sliding_window": 8},
     ["FullAttention"] * 2),
    ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 8}, ["SlidingAttention"] * 2),
    ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": None}, ["FullAttention"] * 2),
    ({"model_type": "gemma2", "num_hidden_layers": 3}, ["SlidingAttention", "FullAttention", "SlidingAttention"]),
])
def test_layer_type_schedules(cfg: dict, types: list[str]) -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 32,
            "moe_intermediate_size": 16}
    assert load_config({**base, **cfg}).arch["layer_types"] == types


def test_moe_blocks_per_family() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 10,
            "intermediate_size": 32, "moe_intermediate_size": 16, "num_experts_per_tok": 2}
    hub = load_config({**base, "model_type": "qwen3_moe", "num_experts": 8})
    v5 = load_config({**base, "model_type": "qwen3_moe", "num_local_experts": 8})
    assert hub.arch["moe"] == v5.arch["moe"] == {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 16,
                                                 "norm_topk_prob": False}
    q2 = load_config({**base, "model_type": "qwen2_moe", "num_experts": 4, "shared_expert_intermediate_size": 40})
    assert q2.arch["moe"]["shared_expert_intermediate_size"] == 40 and q2.arch["moe"]["norm_topk_prob"] is False
    q35 = load_config({**base, "model_type": "qwen3_5_moe_text", "num_experts": 4, "norm_topk_prob": False})
    assert q35.arch["moe"]["norm_topk_prob"] is True  # qwen3_5_moe always renormalises
    ds = load_config({**base, "model_type": "deepseek_v3", "n_routed_experts": 4, "n_shared_experts": 2,
                      "first_k_dense_replace": 1, "kv_lora_rank": 8, "q_lora_rank": None, "qk_rope_head_dim": 4,
                      "qk_nope_head_dim": 8, "v_head_dim": 8, "routed_scaling_factor": 2.5})
    m = ds.arch["moe"]
    assert m["router_sigmoid"] and m["routed_scaling_factor"] == 2.5 and m["shared_expert_intermediate_size"] == 32
    assert ds.arch["mla"]["q_lora_rank"] is None and ds.arch["head_dim"] == 12
    mx = load_config({**base, "model_type": "mixtral", "num_local_experts": 8})
    assert mx.arch["moe"] == {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}


def test_config_refusals() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 10,
            "intermediate_size": 32, "max_position_embeddings": 64}
    with pytest.raises(ConvertError, match="rope type 'fancy'"):
        load_config({**base, "model_type": "llama", "rope_scaling": {"type": "fancy", "factor": 2.0}})
    with pytest.raises(ConvertError, match="bidirectional"):
        load_config({**base, "model_type": "gemma3_text", "use_bidirectional_attention": True})
    with pytest.raises(ConvertError, match="activation 'relu2'"):
        load_config({**base, "model_type": "llama", "hidden_act": "relu2"})
    with pytest.raises(ConvertError, match="no model_type"):
        load_config({"hidden_size": 4})


# ----------------------------------------------------------------------------------- policy


@pytest.mark.parametrize("quant, attn, name, shape, dtype", [
    ("q4tp", None, "model.layers.0.input_layernorm.weight", (64,), "f16"),
    ("q4tp", None, "model.layers.0.mlp.gate.weight", (8, 64), "f16"),
    ("q4tp", None, "model.layers.0.mlp.shared_expert_gate.weight", (1, 64), "f16"),
    ("q4tp", None, "model.layers.0.linear_attn.in_proj_a.weight", (32, 64), "f16"),
    ("q4tp", None, "model.layers.0.linear_attn.conv1d.weight", (96, 1, 4), "f16"),
    ("q4tp", None, "model.layers.0.self_attn.g_proj.weight", (8, 64), "f16"),
    ("q4tp", None, "model.layers.0.mlp.down_proj.weight", (64, 48), "q8_2f"),
    ("q4tp", None, "model.layers.0.mlp.down_proj.weight", (64, 96), "q4tp"),
    ("q4", None, "model.layers.0.mlp.down_proj.weight", (64, 48), "q4_block"),
    ("q8", None, "model.embed_tokens.weight", (10, 64), "q8_row"),
    ("q4tp", "q8", "model.layers.0.self_attn.q_proj.weight", (64, 64), "q8_row"),
    ("q4tp", "q8", "model.layers.0.linear_attn.in_proj_qkv.weight", (64, 64), "q8_row"),
    ("q4tp", "q8", "model.layers.0.mlp.up_proj.weight", (64, 64), "q4tp"),
    ("q8", "q4t", "model.layers.0.self_attn.o_proj.weight", (64, 40), "q8_2f"),
    ("f32", None, "model.norm.weight", (64,), "f32"),
    ("f16", "q8", "model.layers.0.self_attn.q_proj.weight", (64, 64), "q8_row"),
    ("f16", "q8", "model.layers.0.self_attn.q_norm.weight", (16,), "f16"),
    ("q2tp", None, "model.layers.0.mlp.up_proj.weight", (96, 64), "q2tp"),
    ("q2tp", None, "model.layers.0.mlp.down_proj.weight", (64, 96), "q4tp"),
    ("vbit", None, "model.layers.0.mlp.down_proj.weight", (64, 96), "vbit"),
    ("vbit_ro", None, "model.layers.0.mlp.down_proj.weight", (64, 96), "vbit_ro"),
    ("q1p", None, "model.layers.0.mlp.down_proj.weight", (64, 96), "q1"),
    ("q8_row", None, "lm_head.weight", (10, 64), "q8_row"),
    # the token table / output head stays q8_row under every sub-8-bit quant, any input width
    ("q4tp", None, "model.embed_tokens.weight", (128, 64), "q8_row"),
    ("q4tp", None, "lm_head.weight", (128, 64), "q8_row"),
    ("q4t", None, "model.language_model.embed_tokens.weight", (128, 64), "q8_row"),
    ("q4", None, "lm_head.weight", (128, 48), "q8_row"),
    ("q2tp", None, "model.embed_tokens.weight", (128, 64), "q8_row"),
    ("vbit", None, "lm_head.weight", (128, 64), "q8_row"),
    ("q1t", None, "model.embed_tokens.weight", (128, 64), "q8_row"),
    ("q4tp", "q4", "lm_head.weight", (128, 64), "q8_row"),
    ("q8_2f", None, "lm_head.weight", (128, 64), "q8_2f"),  # 8-bit quants keep their own choice
    ("f16", None, "model.embed_tokens.weight", (128, 64), "f16"),
    ("q4tp", None, "model.embed_tokens.weight", (128,), "f16"),  # not 2-D: the f16 rule first
    ("q4tp", None, "model.layers.0.embed_tokens_proj.weight", (128, 64), "q4tp"),  # exact names only
])
def test_dtype_policy(quant, attn, name, shape, dtype) -> None:
    assert Policy.make(quant, attn).choose(name, shape).dtype == dtype


def test_policy_options_and_errors() -> None:
    assert Policy.make("q1p").choose("x.mlp.up_proj.weight", (64, 64)).options == {"diffusion": True}
    assert Policy.make("vbit", mean_bits=5).choose("x.mlp.up_proj.weight", (64, 64)).options == {"mean_bits": 5.0}
    moe = Policy.make("q2tp", has_experts=True)
    assert moe.choose("m.layers.0.mlp.experts.3.gate_proj.weight", (64, 64)).dtype == "q2tp"
    assert moe.choose("m.layers.0.mlp.shared_expert.gate_proj.weight", (64, 64)).dtype == "q4tp"
    assert moe.choose("m.layers.0.mlp.gate_proj.weight", (64, 64)).dtype == "q4tp"  # dense layer of a MoE
    with pytest.raises(ConvertError, match="unknown quant 'q5'"):
        Policy.make("q5")
    with pytest.raises(ConvertError, match="outside 3..8"):
        Policy.make("vbit", mean_bits=9)


# ----------------------------------------------------------------------------------- names


def test_qwen3_next_split_matches_the_reference_reordering() -> None:
    nk, nv, dk, dv, hid = 2, 6, 4, 3, 5
    r = nv // nk
    dims = {"linear_num_key_heads": nk, "linear_num_value_heads": nv, "linear_key_head_dim": dk,
            "linear_value_head_dim": dv}
    w = np.arange(nk * (2 * dk + 2 * r * dv) * hid, dtype=np.float32).reshape(-1, hid)
    ba = np.arange(nk * 2 * r * hid, dtype=np.float32).reshape(-1, hid) + 1000
    # transformers: view [nk, 2dk + 2r·dv] per group, split q|k|v|z, then flatten heads in order
    g = w.reshape(nk, 2 * dk + 2 * r * dv, hid)
    q, k, v, z = g[:, :dk], g[:, dk:2 * dk], g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
    want_qkv = np.concatenate([q.reshape(-1, hid), k.reshape(-1, hid), v.reshape(-1, hid)])
    gb = ba.reshape(nk, 2 * r, hid)
    rules = dict((rx.pattern, fn) for rx, fn in split_rules("qwen3_next", dims))
    got = {}
    for rx, fn in split_rules("qwen3_next", dims):
        for src_name, src in (("model.layers.0.linear_attn.in_proj_qkvz.weight", w),
                              ("model.layers.0.linear_attn.in_proj_ba.weight", ba)):
            m = rx.match(src_name)
            if m:
                for name, cut in fn(m, src.shape):
                    got[name] = np.concatenate([src[a:b] for a, b in cut.rows])
    assert rules
    p = "model.layers.0.linear_attn."
    np.testing.assert_array_equal(got[p + "in_proj_qkv.weight"], want_qkv)
    np.testing.assert_array_equal(got[p + "in_proj_z.weight"], z.reshape(-1, hid))
    np.testing.assert_array_equal(got[p + "in_proj_b.weight"], gb[:, :r].reshape(-1, hid))
    np.testing.assert_array_equal(got[p + "in_proj_a.weight"], gb[:, r:].reshape(-1, hid))


def test_rename_tables_round_trip() -> None:
    t = rename_table("mixtral", 2, None)
    assert t.forward("model.layers.1.block_sparse_moe.experts.7.w3.weight") == "model.layers.1.mlp.experts.7.up_proj.weight"
    assert t.backward("model.layers.1.mlp.gate.weight") == "model.layers.1.block_sparse_moe.gate.weight"
    ds = rename_table("deepseek", 3, "deepseek")
    for hf, c in (("model.layers.3.mlp.shared_experts.up_proj.weight", "model.mtp.layers.0.mlp.shared_expert.up_proj.weight"),
                  ("model.layers.3.mlp.gate.e_score_correction_bias", "model.mtp.layers.0.mlp.expert_bias"),
                  ("model.layers.3.shared_head.norm.weight", "model.mtp.norm.weight"),
                  ("model.layers.3.eh_proj.weight", "model.mtp.eh_proj.weight"),
                  ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.expert_bias"),
                  ("model.layers.2.self_attn.kv_b_proj.weight", "model.layers.2.self_attn.kv_b_proj.weight")):
        assert ds.forward(hf) == c and ds.backward(c) == hf
    qm = rename_table("qwen3_next", 2, "qwen")
    assert qm.forward("mtp.pre_fc_norm_hidden.weight") == "model.mtp.hnorm.weight"
    assert qm.backward("model.mtp.layers.0.mlp.experts.1.up_proj.weight") == "mtp.layers.0.mlp.experts.1.up_proj.weight"
    assert isinstance(t, RenameTable)
    assert unwrap("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert unwrap("language_model.model.norm.weight") == "model.norm.weight"
    assert unwrap("model.visual.blocks.0.attn.qkv.weight") is None
    assert unwrap("model.rotary_emb.inv_freq") is None


def test_canonical_order() -> None:
    names = ["lm_head.weight", "model.layers.10.mlp.up_proj.weight", "model.layers.2.self_attn.q_proj.weight",
             "model.mtp.norm.weight", "model.layers.2.mlp.experts.10.down_proj.weight", "model.norm.weight",
             "model.layers.2.mlp.experts.2.up_proj.weight", "model.layers.2.mlp.experts.10.gate_proj.weight",
             "model.layers.2.mlp.experts.2.gate_proj.weight", "model.mtp.layers.0.mlp.gate.weight",
             "model.embed_tokens.weight", "model.layers.2.mlp.gate.weight"]
    assert sorted(names, key=sort_key) == [
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.2.mlp.experts.2.gate_proj.weight", "model.layers.2.mlp.experts.10.gate_proj.weight",
        "model.layers.2.mlp.experts.2.up_proj.weight", "model.layers.2.mlp.experts.10.down_proj.weight",
        "model.layers.2.mlp.gate.weight", "model.layers.2.self_attn.q_proj.weight",
        "model.layers.10.mlp.up_proj.weight", "model.mtp.norm.weight", "model.mtp.layers.0.mlp.gate.weight"]


# ----------------------------------------------------------------------------------- tokenizer


def test_tokenizer_bundle_rules(tmp_path) -> None:
    tj = {"added_tokens": [{"id": 7, "content": "<|im_end|>"}, {"id": 8, "content": "<|endoftext|>"}],
          "model": {"vocab": {"hi": 3}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"},
                                                                "chat_template": "from-config",
                                                                "added_tokens_decoder": {"7": {}}}))
    (tmp_path / "chat_template.jinja").write_text("  \n")  # blank: ignored
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 8, "pad_token_id": 8}))
    t = read_tokenizer(tmp_path, {"eos_token_id": 99, "bos_token_id": 3}, {})
    assert t.bundle == {"chat_template": "from-config", "eos_token_ids": [8, 7], "bos_token_id": 3, "pad_token_id": 8}
    assert "added_tokens_decoder" not in t.tokenizer_config and "chat_template" not in t.tokenizer_config
    assert t.tokenizer_json == (tmp_path / "tokenizer.json").read_bytes()
    (tmp_path / "chat_template.jinja").write_text("from-jinja")
    (tmp_path / "generation_config.json").unlink()
    t = read_tokenizer(tmp_path, {"eos_token_id": [99, 7]}, {})
    assert t.bundle["chat_template"] == "from-jinja" and t.bundle["eos_token_ids"] == [99, 7]
    bare = tmp_path / "bare"
    bare.mkdir()
    assert read_tokenizer(bare, {}, {}).bundle is None


def test_hub_id_resolves_from_the_cache_offline(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants as hc

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = cache / "models--someorg--tiny-llama" / "snapshots" / commit
    src = write_llama(snap)
    (cache / "models--someorg--tiny-llama" / "refs").mkdir()
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    assert resolve("someorg/tiny-llama") == snap
    out = convert("someorg/tiny-llama", tmp_path / "m.cmf", quant="f32").paths[0]
    with cmf.open(out) as f:
        assert f.header.provenance["source_model"] == "someorg/tiny-llama"
        np.testing.assert_array_equal(f.array("lm_head.weight"), src["lm_head.weight"])
