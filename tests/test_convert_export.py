"""CMF -> Hugging Face export: HF -> CMF(f32) -> HF gives the source tensors back byte for byte,
transformers loads the folder and computes the original logits, and the config, tokenizer and
generation files come back too."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cmf  # noqa: E402
import hf_fixtures as H  # noqa: E402
from cmf.cli import main  # noqa: E402
from cmf.convert import ConvertError, convert, export  # noqa: E402
from cmf.format.writer import CmfWriter  # noqa: E402

IDS = torch.tensor([[3, 17, 42, 9, 88, 21, 5, 100, 7, 250]])


def load_st(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for p in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


def logits(folder, **kw) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
    with torch.no_grad():
        return m(IDS).logits.float()


@pytest.mark.parametrize("kind", list(H.SPECS))
def test_round_trip_tensors_and_logits(kind: str, tmp_path) -> None:
    src = H.fixture(kind)
    res = export(H.converted(kind), tmp_path)
    assert res.dtype == "f32" and [p.name for p in res.files] == ["model.safetensors"]
    a, b = load_st(src), load_st(tmp_path)
    assert sorted(a) == sorted(b)  # the hub layout: fused phi3/qwen3_next, mixtral w1/w2/w3, ...
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert torch.equal(logits(src), logits(tmp_path))
    assert (tmp_path / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (tmp_path / "chat_template.jinja").read_text() == (src / "chat_template.jinja").read_text()
    assert json.loads((tmp_path / "generation_config.json").read_text()) == \
        json.loads((src / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                               add_generation_prompt=True)


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3_text"])
def test_vl_wrapper_exports_a_text_model(kind: str, tmp_path) -> None:
    vl_folder = H.fixture(kind, vl=True)
    export(H.converted(kind, vl=True), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == {"qwen3_5": "qwen3_5_text", "gemma3_text": "gemma3_text"}[kind]
    assert not any("visual" in k or "vision" in k for k in load_st(tmp_path))
    vl = transformers.AutoModelForImageTextToText.from_pretrained(vl_folder).eval()
    with torch.no_grad():
        want = vl(input_ids=IDS).logits.float()
    np.testing.assert_allclose(logits(tmp_path).numpy(), want.numpy(), atol=1e-5)


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_next"])
def test_mtp_heads_export_in_hub_layout(kind: str, tmp_path) -> None:
    src = H.fixture(kind, mtp=True)
    export(H.converted(kind, mtp=True), tmp_path)
    a, b = load_st(src), load_st(tmp_path)
    assert sorted(a) == sorted(b)  # deepseek: shared_head.head / embed_tokens copies restored
    for name in a:
        assert torch.equal(a[name], b[name]), name
    again = convert(tmp_path, tmp_path / "again.cmf", quant="f32").paths[0]
    with cmf.open(again) as f, cmf.open(H.converted(kind, mtp=True)) as g:
        assert [(t.name, t.hash) for t in f.tensors()] == [(t.name, t.hash) for t in g.tensors()]


def test_half_dtypes_and_sharded_output(tmp_path) -> None:
    src = H.fixture("qwen3_moe")
    res = export(H.converted("qwen3_moe"), tmp_path / "bf", dtype="bf16", max_shard_bytes=60_000)
    assert len(res.files) > 1 and (tmp_path / "bf" / "model.safetensors.index.json").is_file()
    a, b = load_st(src), load_st(tmp_path / "bf")
    for name in a:
        assert b[name].dtype == torch.bfloat16 and torch.equal(a[name].to(torch.bfloat16), b[name]), name
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["dtype"] == "bfloat16"
    want = logits(src, dtype=torch.bfloat16)
    np.testing.assert_allclose(logits(tmp_path / "bf").numpy(), want.numpy(), atol=1e-6)
    export(H.converted("qwen3_moe"), tmp_path / "h", dtype="f16")
    assert all(t.dtype == torch.float16 for t in load_st(tmp_path / "h").values())
    with pytest.raises(ConvertError, match="choose f32, f16 or bf16"):
        export(H.converted("qwen3_moe"), tmp_path / "x", dtype="f64")


def test_bf16_source_exports_as_bf16_by_default(tmp_path) -> None:
    src = H.fixture("llama", dtype="bfloat16")
    res = export(H.converted("llama", dtype="bfloat16"), tmp_path)
    assert res.dtype == "bf16"
    a, b = load_st(src), load_st(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_quantized_file_exports_close_logits(tmp_path) -> None:
    export(H.converted("llama", "q8"), tmp_path)
    want = logits(H.fixture("llama"))
    got = logits(tmp_path)
    assert float((got - want).abs().max()) < 0.05 * float(want.std())


@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma3_text", "mistral"])
def test_config_rebuilt_without_provenance(kind: str, tmp_path) -> None:
    """A file from another tool (no provenance.hf_config) still exports a loadable model."""
    bare = tmp_path / "bare.cmf"
    with cmf.open(H.converted(kind)) as f:
        head = f.header.to_dict()
        head["provenance"] = {"tool": "someone-else"}
        with CmfWriter(bare, head) as w:
            for t in f.tensors():
                w.add(t.name, t.dtype, t.shape, t.data)
            w.set_vocab(f.tokenizer_json)
    export(bare, tmp_path / "out")
    np.testing.assert_allclose(logits(tmp_path / "out").numpy(), logits(H.fixture(kind)).numpy(), atol=1e-6)


def test_cli_export(tmp_path, capsys) -> None:
    assert main(["export", str(H.converted("phi3")), "-o", str(tmp_path / "o"), "--dtype", "f16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["files"] == ["model.safetensors"] and data["dtype"] == "f16"
    assert main(["export", str(tmp_path / "missing.cmf"), "-o", str(tmp_path / "p")]) == 2
    assert "missing.cmf" in capsys.readouterr().err
