"""Converter behaviour across source variants and options: config styles, fused experts, VL
wrappers, sharded sources and outputs, bf16 sources, MTP heads, quantized lattices, the q2tp
profile, --attn-quant, vbit with route stats, determinism, dry runs and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cmf  # noqa: E402
import hf_fixtures as H  # noqa: E402
from cmf.cli import main  # noqa: E402
from cmf.convert import ConvertError, convert  # noqa: E402
from test_convert_models import check_header, expected  # noqa: E402


def content(path) -> dict:
    """Everything in a converted file except where it came from (provenance.source_model)."""
    with cmf.open(path) as f:
        head = f.header.to_dict()
        prov = head.pop("provenance")
        prov.pop("source_model")
        return {"header": head, "provenance": prov, "vocab": f.tokenizer_json,
                "tensors": [(t.name, t.dtype.label, t.shape, t.hash) for t in f.tensors()]}


@pytest.mark.parametrize("kind", list(H.SPECS))
def test_legacy_and_nested_configs_give_identical_files(kind: str, tmp_path) -> None:
    a, b = content(H.converted(kind)), content(H.converted(kind, legacy=True))
    assert a["provenance"]["hf_config"] != b["provenance"]["hf_config"]  # the sources differ...
    a["provenance"].pop("hf_config")
    b["provenance"].pop("hf_config")
    assert a == b  # ...everything derived from them does not


@pytest.mark.parametrize("kind", H.MOE_KINDS)
def test_fused_and_per_expert_sources_give_identical_files(kind: str) -> None:
    fused = H.fixture(kind, fused=True)
    from safetensors import safe_open

    with safe_open(str(fused / "model.safetensors"), "np") as f:
        assert any(".experts.gate_up_proj" in k for k in f.keys())  # really the fused layout
    a, b = content(H.converted(kind)), content(H.converted(kind, fused=True))
    assert a == b


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3_text"])
def test_vl_wrapper_converts_the_text_tower(kind: str) -> None:
    folder = H.fixture(kind, vl=True)
    model = H.make_model(kind, vl=True)
    with cmf.open(H.converted(kind, vl=True)) as f:
        assert f.verify() == []
        assert not any("visual" in n or "vision" in n or "multi_modal" in n for n in f.keys())
        check_header(kind, f.header.raw["arch"], folder, model.model.language_model.rotary_emb)
        want = expected(kind, folder)
        assert sorted(f.keys()) == sorted(want)
        for name, value in want.items():
            np.testing.assert_array_equal(f.array(name), value, err_msg=name)
        assert f.header.raw["arch"]["arch_name"] == {"qwen3_5": "qwen3_5", "gemma3_text": "gemma3"}[kind]


@pytest.mark.parametrize("kind", ["qwen3_moe", "phi3"])
def test_sharded_source_equals_unsharded(kind: str) -> None:
    folder = H.fixture(kind, shards=3)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) >= 2
    assert content(H.converted(kind, shards=3)) == content(H.converted(kind))


def test_shard_max_gb_output_opens_as_one_model(tmp_path) -> None:
    res = convert(H.fixture("qwen3_moe"), tmp_path / "m.cmf", quant="q8", shard_max_gb=0.00004)
    assert len(res.paths) > 2 and not (tmp_path / "m.cmf").exists()
    assert res.paths[0].name == f"m-00001-of-{len(res.paths):05d}.cmf"
    whole = convert(H.fixture("qwen3_moe"), tmp_path / "whole.cmf", quant="q8")
    with cmf.open(res.paths[-1]) as f, cmf.open(whole.paths[0]) as g:
        assert f.verify() == [] and len(f.paths) == len(res.paths)
        assert [(t.name, t.hash) for t in f.tensors()] == [(t.name, t.hash) for t in g.tensors()]
        assert f.tokenizer_json == g.tokenizer_json
        assert f.header.tokenizer_config == g.header.tokenizer_config
    for p in res.paths:  # every shard is a valid file on its own
        with cmf.open(p, shards=False) as s:
            assert s.verify() == []


@pytest.mark.parametrize("quant", ["f32", "q4tp"])
def test_conversion_is_deterministic(quant: str, tmp_path) -> None:
    src = H.fixture("qwen3_next")
    a = convert(src, tmp_path / "a.cmf", quant=quant).paths[0].read_bytes()
    b = convert(src, tmp_path / "b.cmf", quant=quant).paths[0].read_bytes()
    assert a == b


def test_dry_run_writes_nothing(tmp_path, capsys) -> None:
    out = tmp_path / "never.cmf"
    p = convert(H.fixture("qwen3_moe"), out, quant="q4tp", dry_run=True)
    assert list(tmp_path.iterdir()) == []
    d = p.summary()
    assert d["dtypes"]["q4tp"]["tensors"] > 0 and d["bytes"] > 0 and len(d["tensors"]) == 45
    assert main(["convert", "-m", str(H.fixture("qwen3_moe")), "-o", str(out), "--dry-run", "--quant", "q4tp"]) == 0
    text = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in text and "q8_2f" in text and "in % 32" in text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_sources_widen_exactly(dtype: str) -> None:
    folder = H.fixture("qwen3", dtype=dtype)
    with cmf.open(H.converted("qwen3", dtype=dtype)) as f:
        assert f.header.provenance["source_dtypes"] == [{"bfloat16": "BF16", "float16": "F16"}[dtype]]
        want = expected("qwen3", folder)
        for name, value in want.items():
            np.testing.assert_array_equal(f.array(name), value, err_msg=name)


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5"])
def test_mtp_heads_move_to_model_mtp(kind: str) -> None:
    from safetensors.torch import load_file

    folder = H.fixture(kind, mtp=True)
    src = load_file(str(folder / "model.safetensors"))
    with cmf.open(H.converted(kind, mtp=True)) as f:
        assert f.verify() == []
        arch = f.header.raw["arch"]
        assert arch["mtp"] == {"num_layers": 1, "share_lm_head": True, "share_embed": True}
        names = set(f.keys())
        for n in ("enorm", "hnorm", "eh_proj", "norm"):
            assert f"model.mtp.{n}.weight" in names
        assert "model.mtp.layers.0.self_attn.o_proj.weight" in names
        assert not any(n.startswith("mtp.") or n.startswith("model.layers.2.") for n in names)
        if kind in ("deepseek_v3", "glm4_moe"):
            pairs = {"model.mtp.eh_proj.weight": "model.layers.2.eh_proj.weight",
                     "model.mtp.norm.weight": "model.layers.2.shared_head.norm.weight",
                     "model.mtp.layers.0.mlp.shared_expert.up_proj.weight":
                         "model.layers.2.mlp.shared_experts.up_proj.weight",
                     "model.mtp.layers.0.mlp.expert_bias": "model.layers.2.mlp.gate.e_score_correction_bias"}
            assert "model.mtp.lm_head.weight" not in names  # identical copies are shared, not stored
        else:
            pairs = {"model.mtp.eh_proj.weight": "mtp.fc.weight", "model.mtp.enorm.weight":
                     "mtp.pre_fc_norm_embedding.weight", "model.mtp.layers.0.self_attn.q_proj.weight":
                     "mtp.layers.0.self_attn.q_proj.weight"}
        for cmf_name, hf_name in pairs.items():
            np.testing.assert_array_equal(f.array(cmf_name), src[hf_name].numpy(), err_msg=cmf_name)


def _row_amax(x: np.ndarray) -> np.ndarray:
    return np.abs(x.reshape(x.shape[0], -1)).max(axis=1, keepdims=True)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "qwen3_next", "phi3", "gemma3_text"])
@pytest.mark.parametrize("quant", ["q8", "q4tp"])
def test_quantized_within_lattice_bounds(kind: str, quant: str) -> None:
    with cmf.open(H.converted(kind)) as ref, cmf.open(H.converted(kind, quant)) as f:
        assert f.verify() == []
        seen = set()
        for t in f.tensors():
            src = ref.array(t.name)
            got = f.array(t.name)
            err = np.abs(got - src)
            seen.add(t.dtype.label)
            if t.dtype.label == "f16":
                assert src.ndim != 2 or src.size < 32 or ".mlp.gate." in t.name or "conv1d" in t.name \
                    or "in_proj_" in t.name or "shared_expert_gate" in t.name, t.name
                assert (err <= np.abs(src) * 2.0**-11 + 2.0**-25).all(), t.name
            elif t.dtype.label == "q8_row":
                assert (err.reshape(err.shape[0], -1) <= 0.51 * _row_amax(src) / 127 + 1e-7).all(), t.name
            elif t.dtype.label == "q4tp":
                assert (err.reshape(err.shape[0], -1) <= 1.6 * _row_amax(src) / 7).all(), t.name
                assert src.shape[1] % 32 == 0
            elif t.dtype.label == "q8_2f":
                assert quant == "q4tp" and src.shape[1] % 32 != 0, t.name  # the in%32 fallback
                assert np.sqrt((err**2).mean() / (src**2).mean()) < 0.01, t.name
            else:
                raise AssertionError(f"{t.name}: unexpected dtype {t.dtype.label}")
        assert {"q8": "q8_row", "q4tp": "q4tp"}[quant] in seen


def test_q2tp_profile_and_attn_quant(tmp_path) -> None:
    moe = convert(H.fixture("qwen3_moe"), tmp_path / "moe.cmf", quant="q2tp", attn_quant="q8").paths[0]
    with cmf.open(moe) as f:
        d = {t.name: t.dtype.label for t in f.tensors()}
        h = f.header
    assert d["model.layers.0.mlp.experts.2.gate_proj.weight"] == "q2tp"
    assert d["model.layers.0.mlp.experts.2.up_proj.weight"] == "q2tp"
    assert d["model.layers.0.mlp.experts.2.down_proj.weight"] == "q8_2f"  # in = 48
    assert d["model.layers.0.self_attn.q_proj.weight"] == "q8_row"
    assert d["model.layers.0.mlp.gate.weight"] == "f16"
    assert d["lm_head.weight"] == "q8_row"  # the output head stays 8-bit under sub-8-bit quants
    assert h.quant_type == "Q4_BLOCK" and h.provenance["options"] == {"quant": "q2tp", "attn_quant": "q8"}
    dense = convert(H.fixture("qwen3_5"), tmp_path / "dense.cmf", quant="q2tp", attn_quant="q4").paths[0]
    with cmf.open(dense) as f:
        d = {t.name: t.dtype.label for t in f.tensors()}
    assert d["model.layers.0.mlp.gate_proj.weight"] == "q2tp" and d["model.layers.0.mlp.down_proj.weight"] == "q4tp"
    assert d["model.layers.0.linear_attn.in_proj_qkv.weight"] == "q4_block"
    assert d["model.layers.0.linear_attn.in_proj_a.weight"] == "f16"
    assert d["model.layers.0.linear_attn.conv1d.weight"] == "f16"
    assert d["model.layers.1.self_attn.o_proj.weight"] == "q4_block"


def test_vbit_experts_share_a_budget_and_follow_route_stats(tmp_path) -> None:
    from cmf.quant.vbit import VbitCodec, VbitRoCodec

    src = H.fixture("qwen3_moe")
    plain = convert(src, tmp_path / "plain.cmf", quant="vbit", mean_bits=4.0).paths[0]
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"0": [1000, 1, 1, 1], "1": [1, 1, 1, 1000]}))
    routed = convert(src, tmp_path / "routed.cmf", quant="vbit", mean_bits=4.0, route_stats=stats).paths[0]

    def mean_width(f, name):
        t = f.tensor(name)
        codec = VbitRoCodec() if t.dtype.label == "vbit_ro" else VbitCodec()
        return float(codec.widths(t.numpy(), t.shape).mean())

    with cmf.open(plain) as a, cmf.open(routed) as b:
        assert b.verify() == []
        assert b.header.provenance["options"]["mean_bits"] == 4.0
        assert "route_stats_hash64" in b.header.provenance["options"]
        fam = [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4)]
        wa = [mean_width(a, n) for n in fam]
        wb = [mean_width(b, n) for n in fam]
        assert abs(np.mean(wa) - 4.0) < 0.6 and abs(np.mean(wb) - 4.0) < 0.6
        assert wb[0] > wa[0] and wb[0] == max(wb)  # the busy expert gets more bits
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"0": [1, 2]}))
    with pytest.raises(ConvertError, match="2 counts for 4 experts"):
        convert(src, tmp_path / "bad.cmf", quant="vbit", route_stats=bad)
    assert not (tmp_path / "bad.cmf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no spool/temp left behind


def test_cli_convert_and_errors(tmp_path, capsys) -> None:
    out = tmp_path / "m.cmf"
    rc = main(["convert", "-m", str(H.fixture("gemma2")), "-o", str(out), "--quant", "q8_row", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["paths"] == [str(out)] and data["tensors"] > 0 and data["plan"]["quant_type"] == "Q8_ROW"
    with cmf.open(out) as f:
        assert f.verify() == []
    rc = main(["convert", "-m", str(H.fixture("gemma2")), "-o", str(tmp_path / "x.cmf"), "--quant", "q3"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown quant 'q3'" in err and err.count("\n") == 1
    assert main(["convert", "-m", str(H.fixture("gemma2"))]) == 2
    assert "-o/--output is required" in capsys.readouterr().err
    assert not (tmp_path / "x.cmf").exists()


def test_mtp_head_copy_that_differs_is_kept(tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from cmf.convert import export

    src = tmp_path / "src"
    shutil.copytree(H.fixture("deepseek_v3", mtp=True), src)
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.2.shared_head.head.weight"] = sd["model.layers.2.shared_head.head.weight"] + 0.5
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = convert(src, tmp_path / "m.cmf", quant="f32").paths[0]
    with cmf.open(out) as f:
        assert f.header.raw["arch"]["mtp"] == {"num_layers": 1, "share_lm_head": False, "share_embed": True}
        np.testing.assert_array_equal(f.array("model.mtp.lm_head.weight"),
                                      sd["model.layers.2.shared_head.head.weight"].numpy())
    export(out, tmp_path / "exp")
    back = load_file(str(tmp_path / "exp" / "model.safetensors"))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_thread_count_does_not_change_the_bytes(tmp_path) -> None:
    from cmf.convert import execute, plan

    src = H.fixture("qwen3_5_moe")
    one = execute(plan(src, "q4tp"), tmp_path / "one.cmf", workers=1).paths[0]
    four = execute(plan(src, "q4tp"), tmp_path / "four.cmf", workers=4).paths[0]
    assert one.read_bytes() == four.read_bytes()


def test_no_progress_bar_without_a_tty(tmp_path, capsys) -> None:
    src = H.fixture("qwen2")
    capsys.readouterr()  # transformers' own bars while building the fixture
    assert main(["convert", "-m", str(src), "-o", str(tmp_path / "m.cmf"), "--quant", "q4"]) == 0
    cap = capsys.readouterr()
    assert cap.err == "" and "m.cmf: " in cap.out and "GB/s" in cap.out
