"""MLA files in the reference's layout run here, and pycmf writes that layout (docs/INTERCHANGE.md).

Fixtures are written with pycmf's own writer after applying the reference converter's
permutations (tests/_mla_reference.py) to the tensors of tiny seeded HF checkpoints:

- DeepSeek-V3 in the reference layout (rope-first heads, rope rows even-first, no
  ``rope_interleave`` key): HF parity, and pycmf's converter writes exactly those rows;
- the same model in the legacy pycmf layout (HF row order, ``mla.rope_interleave: true``);
- DeepSeek-V3 with ``rope_interleave: false`` (half-split rotary): converted (rope rows only
  moved), legacy layout with the key false, and ``cmf export`` back to the source tensors;
- Kimi Linear's NoPE MLA (transformers' KimiLinear with every layer full attention and a dense
  FFN), reference layout with ``mla.nope: true``: HF parity.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cmf  # noqa: E402
import hf_fixtures as H  # noqa: E402
from _interchange import (build_hf, check_logits, file_parts, hf_logits, hf_tensors, prompt,  # noqa: E402
                          write_cmf)
from _mla_reference import reference_rows  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.convert.export import export  # noqa: E402

MLA_PARTS = ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
             "self_attn.kv_a_proj_with_mqa.bias")
KIMI = dict(vocab_size=H.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=20, layer_types=["full_attention"] * 2, mlp_layer_types=["dense"] * 2,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=2, pad_token_id=0)


def _mla_geometry(folder) -> tuple[int, int, int, bool]:
    c = transformers.AutoConfig.from_pretrained(folder)
    return c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, bool(getattr(c, "rope_interleave", True))


def _relaid(converted, folder, tmp_path, name: str, *, legacy: bool | None = None):
    """The converted file with its MLA tensors replaced by the source's, laid out as the reference
    converter lays them out (``legacy``: instead HF row order and ``mla.rope_interleave``)."""
    head, arrays, vocab = file_parts(converted)
    src = hf_tensors(folder)
    nope, rope, rank, inter = _mla_geometry(folder)
    head = copy.deepcopy(head)
    head["provenance"] = {"tool": "cortiq convert", "source_model": str(folder)}  # as the reference writes it
    for n in arrays:
        if n.endswith(MLA_PARTS):
            t = src[n].float()
            arrays[n] = (t if legacy is not None else reference_rows(n, t, nope, rope, rank, inter)).numpy()
    if legacy is not None:
        head["arch"]["mla"]["rope_interleave"] = legacy
    return write_cmf(tmp_path / name, head, arrays, vocab)


@pytest.fixture(scope="module")
def deepseek():
    folder = H.fixture("deepseek_v3")
    return folder, H.converted("deepseek_v3"), hf_logits(folder, prompt(0))


def test_reference_layout_deepseek_matches_hf(deepseek, tmp_path) -> None:
    folder, converted, ref = deepseek
    path = _relaid(converted, folder, tmp_path, "ref.cmf")
    with cmf.open(path) as f:
        assert "rope_interleave" not in f.header.arch.mla
    check_logits(path, ref, prompt(0))


def test_converter_writes_the_reference_rows(deepseek, tmp_path) -> None:
    folder, converted, _ = deepseek
    ref_head, ref_arrays, _ = file_parts(_relaid(converted, folder, tmp_path, "ref.cmf"))
    head, arrays, _ = file_parts(converted)
    assert head["arch"]["mla"] == ref_head["arch"]["mla"]
    permuted = [n for n in arrays if n.endswith(MLA_PARTS)]
    assert len(permuted) == 4  # q_b_proj and kv_a_proj_with_mqa of both layers
    for n in permuted:
        np.testing.assert_array_equal(arrays[n], ref_arrays[n], err_msg=n)


def test_legacy_pycmf_layout_still_runs(deepseek, tmp_path) -> None:
    folder, converted, ref = deepseek
    check_logits(_relaid(converted, folder, tmp_path, "legacy.cmf", legacy=True), ref, prompt(0))


@pytest.fixture(scope="module")
def half_split(tmp_path_factory):
    """DeepSeek-V3 whose source rotates half-split pairs (rope_interleave false)."""
    folder = build_hf("deepseek_v3", tmp_path_factory.mktemp("ds-half") / "hf", rope_interleave=False)
    out = folder.parent / "conv.cmf"
    convert(folder, out, quant="f32")
    return folder, out, hf_logits(folder, prompt(1))


def test_half_split_source_converts_and_runs(half_split, tmp_path) -> None:
    folder, converted, ref = half_split
    check_logits(converted, ref, prompt(1))
    src = hf_tensors(folder)
    _, arrays, _ = file_parts(converted)
    nope, rope, rank, inter = _mla_geometry(folder)
    assert inter is False
    n = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    np.testing.assert_array_equal(arrays[n], src[n].numpy())  # no even-first fix for a half-split source
    n = "model.layers.0.self_attn.q_b_proj.weight"
    np.testing.assert_array_equal(arrays[n], reference_rows(n, src[n], nope, rope, rank, False).numpy())
    check_logits(_relaid(converted, folder, tmp_path, "legacy.cmf", legacy=False), ref, prompt(1))


def test_export_undoes_the_layout(half_split, tmp_path) -> None:
    folder, converted, _ = half_split
    export(converted, tmp_path / "hf")
    a, b = hf_tensors(folder), hf_tensors(tmp_path / "hf")
    assert sorted(a) == sorted(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_export_of_a_legacy_file_keeps_hf_rows(deepseek, tmp_path) -> None:
    folder, converted, _ = deepseek
    export(_relaid(converted, folder, tmp_path, "legacy.cmf", legacy=True), tmp_path / "hf")
    a, b = hf_tensors(folder), hf_tensors(tmp_path / "hf")
    for n in a:
        assert torch.equal(a[n], b[n]), n


def _kimi_arch() -> dict:
    c = KIMI
    return {"arch_name": "kimi_linear", "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
            "num_layers": c["num_hidden_layers"], "num_attention_heads": c["num_attention_heads"],
            "num_kv_heads": c["num_key_value_heads"], "head_dim": c["qk_rope_head_dim"] + c["qk_nope_head_dim"],
            "vocab_size": c["vocab_size"], "layer_types": ["FullAttention"] * c["num_hidden_layers"],
            "rms_norm_eps": c["rms_norm_eps"], "max_position_embeddings": c["max_position_embeddings"],
            "norm_style": "qwen", "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0,
            "mla": {"kv_lora_rank": c["kv_lora_rank"], "qk_rope_head_dim": c["qk_rope_head_dim"],
                    "qk_nope_head_dim": c["qk_nope_head_dim"], "v_head_dim": c["v_head_dim"], "nope": True}}


def test_kimi_nope_reference_layout_matches_hf(tmp_path) -> None:
    folder = build_hf("kimi_linear", tmp_path / "hf", "KimiLinearConfig", "KimiLinearForCausalLM", **KIMI)
    template, _, _ = file_parts(H.converted("llama"))
    head = {k: template[k] for k in ("format", "version", "quant_type", "tokenizer_config")}
    head["arch"] = _kimi_arch()
    head["provenance"] = {"tool": "cortiq convert", "source_model": str(folder)}
    # the reference's canon_name: Kimi's hub `block_sparse_moe.` is the CMF `mlp.`
    arrays = {n.replace(".block_sparse_moe.", ".mlp."): reference_rows(
        n, t.float(), KIMI["qk_nope_head_dim"], KIMI["qk_rope_head_dim"], KIMI["kv_lora_rank"], False).numpy()
        for n, t in hf_tensors(folder).items()}
    assert not np.array_equal(arrays["model.layers.0.self_attn.q_proj.weight"],
                              hf_tensors(folder)["model.layers.0.self_attn.q_proj.weight"].numpy())
    path = write_cmf(tmp_path / "kimi.cmf", head, arrays, (folder / "tokenizer.json").read_bytes())
    ids = prompt(2)
    check_logits(path, hf_logits(folder, ids), ids)
    with cmf.load(path) as m:  # the rope dims really are left unrotated
        assert not m.plan.layers[0].attn.rotate and m.plan.layers[0].attn.rope_first
