"""cmf requant (rewrite and in place) and cmf quant-report."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

import cmf.quant as q
from cmf import cli
from cmf.format.errors import HashMismatch, ShardError, WriterError
from cmf.format.reader import open as cmf_open
from cmf.format.writer import CmfWriter
from cmf.tools.quant_report import quant_report
from cmf.tools.requant import requant

from _builders import header, sample_masks

VOCAB = b'{"version":"1.0","model":{"type":"BPE","vocab":{},"merges":[]}}'
SKILLS = [{"id": "coding", "name": "coding", "tensors": ["model.layers.0.mlp.up_proj.weight"]}]


def _w(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * np.exp2(rng.normal(0, 1, (rows, 1))) * 0.02).astype(np.float32)


def build(path, quant: str = "q4_tiled", cols: int = 256, **hdr) -> None:
    """A small model: matrices in ``quant``, f16 norms and router, f32 odd-width matrix, masks, vocab."""
    h = header(quant_type="Q4_BLOCK", **hdr)
    with CmfWriter(path, h) as w:
        w.add_array("model.embed_tokens.weight", _w(128, cols, 0), quant)
        w.add_array("model.norm.weight", 1 + _w(1, cols, 1)[0], "f16")
        for i in range(2):
            w.add_array(f"model.layers.{i}.mlp.gate_proj.weight", _w(96, cols, 10 + i), quant)
            w.add_array(f"model.layers.{i}.mlp.up_proj.weight", _w(96, cols, 20 + i), quant)
            w.add_array(f"model.layers.{i}.mlp.down_proj.weight", _w(cols, 96, 30 + i), quant)
            w.add_array(f"model.layers.{i}.mlp.gate.weight", _w(8, cols, 40 + i), "f16")  # a router
        w.add_array("model.layers.0.self_attn.o_proj.weight", _w(64, 50, 5), "f32")  # in % 32 != 0
        w.set_masks(sample_masks())
        w.set_vocab(VOCAB)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dtypes(path) -> dict[str, str]:
    with cmf_open(path) as f:
        return {t.name: t.dtype.label for t in f.tensors()}


def test_rewrite_q4t_to_q4tp_keeps_everything_else(tmp_path) -> None:
    src, dst = tmp_path / "in.cmf", tmp_path / "out.cmf"
    build(src, skills=SKILLS)
    report = requant(src, dst, quant="q4tp")
    with cmf_open(src) as a, cmf_open(dst) as b:
        assert b.verify() == []
        assert bytes(a.section_bytes("masks")) == bytes(b.section_bytes("masks"))
        assert b.tokenizer_json == VOCAB
        ha, hb = a.header.to_dict(), b.header.to_dict()
        assert hb["skills"] == SKILLS and hb["arch"] == ha["arch"] and hb["provenance"] == ha["provenance"]
        assert hb["quant_type"] == "Q4_BLOCK"
        assert a.keys() == b.keys()
        for ta in a.tensors():
            tb = b.tensor(ta.name)
            if ta.name == "model.embed_tokens.weight":  # the token table stays 8-bit under 4-bit quants
                assert tb.dtype.label == "q8_row"
                assert bytes(tb.numpy()) == q.encode(q.decode(ta.numpy(), ta.dtype, ta.shape), "q8_row")
            elif ta.dtype.label == "q4_tiled":
                assert tb.dtype.label == "q4tp"
                want = q.encode(q.decode(ta.numpy(), ta.dtype, ta.shape), "q4tp")
                assert bytes(tb.numpy()) == want  # dequantize -> encode, deterministic
            elif ta.name.endswith("o_proj.weight"):
                assert tb.dtype.label == "q8_2f"  # in % 32 != 0: the converter's fallback
            else:
                assert tb.dtype == ta.dtype and tb.hash == ta.hash  # norms, routers: byte for byte
    assert report["changed"] == 8 and report["tensors"] == 11


@pytest.mark.parametrize("target,expect,tol", [("q8", "q8_row", 0.02), ("q8_2f", "q8_2f", 0.02),
                                               ("q4", "q4_block", 0.15), ("vbit", "vbit", 0.15),
                                               ("q2tp", None, 0.6), ("f16", "f16", 1e-3)])
def test_round_trips_to_other_quants(tmp_path, target: str, expect: str | None, tol: float) -> None:
    src, dst = tmp_path / "in.cmf", tmp_path / "out.cmf"
    build(src, quant="q8_row")
    requant(src, dst, quant=target)
    got = _dtypes(dst)
    if expect is None:  # the q2tp profile: FFN gate/up at 2 bits, every other matrix q4tp
        assert got["model.layers.0.mlp.gate_proj.weight"] == "q2tp"
        assert got["model.layers.1.mlp.down_proj.weight"] == "q4tp"
    else:
        assert got["model.layers.1.mlp.down_proj.weight"] == expect
    assert got["model.layers.0.mlp.gate.weight"] == "f16" and got["model.norm.weight"] == "f16"
    with cmf_open(src) as a, cmf_open(dst) as b:
        assert b.verify() == []
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
            x, y = a.array(name), b.array(name)
            assert np.linalg.norm(y - x) / np.linalg.norm(x) < tol


def test_include_and_exclude_select_tensors(tmp_path) -> None:
    src, dst = tmp_path / "in.cmf", tmp_path / "out.cmf"
    build(src, quant="q8_row")
    requant(src, dst, quant="q4tp", include=["model.layers.*"], exclude=["*down_proj*"])
    got = _dtypes(dst)
    assert got["model.embed_tokens.weight"] == "q8_row"
    assert got["model.layers.1.mlp.down_proj.weight"] == "q8_row"
    assert got["model.layers.1.mlp.up_proj.weight"] == "q4tp"
    with cmf_open(dst) as f:
        assert f.header.quant_type == "Q4_BLOCK"  # --include: the header label is left alone


def test_in_place_when_every_payload_fits(tmp_path) -> None:
    src, ref = tmp_path / "in.cmf", tmp_path / "ref.cmf"
    build(src, quant="q8_row")
    requant(src, ref, quant="q4tp")
    size = src.stat().st_size
    report = requant(src, quant="q4tp", in_place=True)
    assert report["mode"] == "in-place" and report["changed"] == 7  # the token table stays q8_row
    assert src.stat().st_size == size
    assert [p.name for p in tmp_path.iterdir()] and not list(tmp_path.glob(".*requant"))
    with cmf_open(src) as a, cmf_open(ref) as b:
        assert a.verify() == []
        assert a.header.quant_type == "Q4_BLOCK"  # in place: the header is not rewritten
        for t in a.tensors():
            assert t.dtype == b.tensor(t.name).dtype and t.hash == b.tensor(t.name).hash
        assert bytes(a.section_bytes("masks")) == bytes(b.section_bytes("masks"))
        assert a.tokenizer_json == VOCAB
        assert a.features & 4  # q8_2f present: QUANT_2F set in the rewritten envelope


def test_in_place_refuses_when_a_payload_grows(tmp_path) -> None:
    src = tmp_path / "in.cmf"
    build(src, quant="q4_tiled", cols=64)  # q4tp costs more than q4t at 2 groups per row
    before = _sha(src)
    with pytest.raises(WriterError, match="do not fit their old slot.*nothing was modified|nothing was modified"):
        requant(src, quant="q4tp", in_place=True)
    assert _sha(src) == before
    assert not list(tmp_path.glob(".*requant"))


def _with_f32_smalls(path, big: float = 1.0) -> dict[str, np.ndarray]:
    """A model whose norms, a bias and a router are stored at f32 (as ``convert --quant f32``
    writes them), one 1-D tensor at bf16 and one f32 norm scaled by ``big``."""
    rng = np.random.default_rng(3)
    smalls = {"model.norm.weight": (1 + 0.1 * rng.standard_normal(256)).astype(np.float32),
              "model.layers.0.input_layernorm.weight": (big * (1 + 0.1 * rng.standard_normal(256))).astype(np.float32),
              "model.layers.0.self_attn.q_proj.bias": (0.1 * rng.standard_normal(96)).astype(np.float32),
              "model.layers.0.mlp.gate.weight": _w(8, 256, 40)}  # a router: precision-critical
    with CmfWriter(path, header(quant_type="F32")) as w:
        w.add_array("model.embed_tokens.weight", _w(128, 256, 0), "f32")
        w.add_array("model.layers.0.self_attn.q_proj.weight", _w(96, 256, 1), "f32")
        w.add_array("model.layers.0.mlp.down_proj.weight", _w(256, 96, 2), "f32")
        for name, v in smalls.items():
            w.add_array(name, v, "f32")
        w.add_array("model.layers.0.post_attention_layernorm.weight", 1 + _w(1, 256, 7)[0], "bf16")
    return smalls


@pytest.mark.parametrize("in_place", [False, True])
def test_small_f32_tensors_become_f16_as_convert_writes_them(tmp_path, in_place: bool) -> None:
    """Norms, biases and the precision-critical matrices are kept out of the quantizers; stored at
    f32 (an f32 source) a requant to a quantized profile writes them at f16, what ``convert``
    writes and FORMATS.md states, with f16's exact values; f16/bf16 ones are kept byte for byte."""
    src, dst = tmp_path / "in.cmf", tmp_path / "out.cmf"
    smalls = _with_f32_smalls(src)
    with cmf_open(src) as f:
        bf16_hash = f.tensor("model.layers.0.post_attention_layernorm.weight").hash
    report = requant(src, None if in_place else dst, quant="q4tp", in_place=in_place)
    out = src if in_place else dst
    why = {e["name"]: e["reason"] for e in report["entries"]}
    with cmf_open(out) as f:
        assert f.verify() == []
        for name, v in smalls.items():
            t = f.tensor(name)
            assert t.dtype.label == "f16", name
            assert np.array_equal(f.array(name), v.astype(np.float16).astype(np.float32)), name
            assert why[name].endswith("f32 -> f16")
        t = f.tensor("model.layers.0.post_attention_layernorm.weight")
        assert t.dtype.label == "bf16" and t.hash == bf16_hash
        assert f.tensor("model.layers.0.self_attn.q_proj.weight").dtype.label == "q4tp"
    assert why["model.layers.0.post_attention_layernorm.weight"] == "not 2-D"
    # a float target leaves them as they are stored (here f16): nothing widened or narrowed
    requant(out, tmp_path / "f32.cmf", quant="f32")
    requant(out, tmp_path / "bf16.cmf", quant="bf16")
    for name in ("f32", "bf16"):
        with cmf_open(tmp_path / f"{name}.cmf") as f, cmf_open(out) as g:
            for t in ("model.norm.weight", "model.layers.0.post_attention_layernorm.weight"):
                assert f.tensor(t).hash == g.tensor(t).hash and f.tensor(t).dtype == g.tensor(t).dtype


def test_a_small_f32_tensor_outside_f16_range_stays_f32(tmp_path) -> None:
    src, dst = tmp_path / "in.cmf", tmp_path / "out.cmf"
    smalls = _with_f32_smalls(src, big=1e5)  # f16 would store ±inf
    report = requant(src, dst, quant="q4tp")
    with cmf_open(dst) as f:
        t = f.tensor("model.layers.0.input_layernorm.weight")
        assert t.dtype.label == "f32"
        assert np.array_equal(f.array(t.name), smalls[t.name])
        assert f.tensor("model.norm.weight").dtype.label == "f16"
    assert {e["name"]: e["reason"] for e in report["entries"]}["model.layers.0.input_layernorm.weight"] == "not 2-D"


def test_a_budget_counts_the_small_tensors_at_f16(tmp_path) -> None:
    """--target-mb plans with the f16 sizes requant writes for an f32 file's norms: the file
    fits and the budget's room is spent on the matrices."""
    src, dst = tmp_path / "in.cmf", tmp_path / "out.cmf"
    _with_f32_smalls(src)
    from cmf.convert.budget import file_budget
    from cmf.convert.policy import Policy

    with cmf_open(src) as f:
        plan, moved = file_budget(f, Policy.make("q4tp"), lambda n: True, 10**9)
    requant(src, dst, quant="q4tp", target_mb=0.09)
    assert dst.stat().st_size <= 90_000
    with cmf_open(dst) as f:
        assert f.tensor("model.norm.weight").dtype.label == "f16"
        # the bytes the plan fixed before choosing are the bytes written for those tensors
        assert plan.summary()["fixed_bytes"] == sum(t.nbytes for t in f.tensors() if t.name not in moved)


def test_refusals(tmp_path) -> None:
    src = tmp_path / "in.cmf"
    build(src, quant="q8_row")
    with pytest.raises(WriterError):
        requant(src, src, quant="q4tp")
    with pytest.raises(WriterError):
        requant(src, quant="q4tp")  # neither -o nor --in-place
    data = bytearray(src.read_bytes())
    with cmf_open(src) as f:
        off = f.tensor("model.layers.0.mlp.up_proj.weight").offset
    data[off + 5] ^= 0x40
    bad = tmp_path / "bad.cmf"
    bad.write_bytes(bytes(data))
    with pytest.raises(HashMismatch):
        requant(bad, tmp_path / "x.cmf", quant="q4tp")
    with pytest.raises(HashMismatch):
        requant(bad, quant="q4tp", in_place=True)
    shard = tmp_path / "sh.cmf"
    with CmfWriter(shard, header(), max_shard_bytes=40000) as w:
        for i in range(3):
            w.add_array(f"m{i}.weight", _w(64, 256, i), "q8_row")
    first = sorted(tmp_path.glob("sh-*.cmf"))[0]
    with pytest.raises(ShardError):
        requant(first, quant="q4tp", in_place=True)
    requant(first, tmp_path / "joined.cmf", quant="q4tp")  # -o joins the set
    assert set(_dtypes(tmp_path / "joined.cmf").values()) == {"q4tp"}


def test_cli_requant_and_quant_report(tmp_path, capsys) -> None:
    src, dst = tmp_path / "in.cmf", tmp_path / "out.cmf"
    build(src, quant="f32")
    assert cli.main(["requant", str(src), "-o", str(dst), "--quant", "q4t", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quant_type"] == "Q4_BLOCK"
    assert cli.main(["requant", str(src), "--quant", "q4t"]) == 2  # no -o, no --in-place
    capsys.readouterr()
    assert cli.main(["quant-report", str(src), "--quant", "q8,q4t,q4tp,q2tp", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    by = {r["dtype"]: r for r in d["dtypes"]}
    assert d["matrices"] == 8  # the router and the norm are not quantized
    assert by["q8_row"]["fallbacks"] == 0 and by["q4_tiled"]["fallbacks"] == 1  # the 50-wide matrix
    assert 8.0 < by["q8_row"]["bits_per_weight"] < 8.2 and by["q8_row"]["rel_rms"] < 0.01
    assert 0.05 < by["q4_tiled"]["rel_rms"] < 0.15
    assert by["q4tp"]["bits_per_weight"] < by["q4_tiled"]["bits_per_weight"]
    # the mse encoders: q4t may map a group's largest weight onto -8 with a negative scale, which
    # q4tp's positive rungs cannot, so q4tp's margin over q4t is wider than the reference's 1.06
    assert by["q4tp"]["rel_rms"] < 1.1 * by["q4_tiled"]["rel_rms"]
    assert 0 < by["q4tp"]["q4t_perturbation"] < 0.05
    assert 0.05 < by["q2tp"]["rel_rms"] < 0.55 and by["q2tp"]["bits_per_weight"] < 2.6
    assert cli.main(["quant-report", str(src), "--quant", "q4tp"]) == 0
    assert "requantizing the q4t values" in capsys.readouterr().out


def _safetensors(path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file written by hand (numpy has no bfloat16)."""
    meta, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = arr.tobytes()
        meta[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(meta).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_quant_report_on_a_hf_folder(tmp_path) -> None:
    w = _w(64, 128, 3)
    bf = (w.view(np.uint32) >> 16).astype("<u2")  # truncated to bf16
    _safetensors(tmp_path / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": ("BF16", bf),
        "model.layers.0.mlp.down_proj.weight": ("F32", _w(128, 64, 4)),
        "model.norm.weight": ("F32", np.ones(128, np.float32)),
    })
    d = quant_report(tmp_path, ["q8_row", "bf16"])
    assert d["kind"] == "hf" and d["matrices"] == 2 and d["elements"] == 2 * 64 * 128
    by = {r["dtype"]: r for r in d["dtypes"]}
    assert by["bf16"]["bits_per_weight"] == 16.0
    assert by["bf16"]["rel_rms"] < 3e-3  # exact on the bf16 matrix, rounding on the f32 one
    assert by["q8_row"]["rel_rms"] < 0.01
