"""Regression tests for what the file-surface fuzz harnesses found (benchmarks/fuzz/harnesses_files.py,
issue 28): GGUF import (metadata of the wrong type, head counts the tensors cannot split into,
ggml types without a decoder, vocabularies the tokenizers library refuses or panics on) and
``skill add`` (a donor holding NaN). Each was an untyped exception; each is now a CmfError.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "fuzz"), str(ROOT / "benchmarks")]

import harnesses as H  # noqa: E402
import harnesses_files as F  # noqa: E402

from cmf.convert.gguf import import_gguf  # noqa: E402
from cmf.convert.gguf_scan import GgufError, scan  # noqa: E402
from cmf.convert.gguf_tokenizer import tokenizer_json_from_gguf  # noqa: E402

U32, U64, F32, STR, ARR = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64, gguf.GGUFValueType.FLOAT32,
                           gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    F.gguf_import_seeds(d)
    return d / "tiny-Q8_0.gguf"


def _rewrite(src: Path, dst: Path, meta: dict | None = None) -> Path:
    """``src`` with some metadata values replaced or added (value, type)."""
    meta = dict(meta or {})
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val, vtype = meta.pop(key, (field.contents(), field.types[0]))
        w.add_key_value(key, val, vtype, field.types[1] if len(field.types) > 1 else None)
    for key, (val, vtype, *sub) in meta.items():
        w.add_key_value(key, val, vtype, *sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_the_seed_imports(q8_gguf: Path, tmp_path: Path) -> None:
    import_gguf(q8_gguf, tmp_path / "ok.cmf", "f32")


@pytest.mark.parametrize("meta, what", [
    ({"llama.attention.head_count": (3, U32)}, "rows do not split into 3 heads"),
    ({"llama.attention.head_count_kv": (3, U32)}, "rows do not split into 3 heads"),
    ({"llama.attention.head_count": (0, U32)}, "head_count = 0 is not an integer >= 1"),
    ({"llama.attention.head_count_kv": (0, U32)}, "head_count_kv = 0 is not an integer >= 1"),
    ({"llama.attention.head_count": ("x", STR)}, "head_count = 'x' is not an integer"),
    ({"llama.block_count": ("x", STR)}, "block_count = 'x' is not an integer"),
    ({"llama.attention.layer_norm_rms_epsilon": ("x", STR)}, "epsilon = 'x' is not a finite number"),
    ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), F32)}, "is not a finite number"),
    # the meta-data mutator's findings: lists and counts the converter built structures from
    ({"llama.block_count": (2**40, U64)}, "block_count = 1099511627776, but the tensors name 1 block"),
    ({"llama.attention.key_length": (2**63, U64)}, "key_length = 9223372036854775808 is not an integer >= 1 <= "),
    ({"llama.attention.head_count": (2**40, U64)}, "head_count = 1099511627776 is not an integer"),
    ({"llama.rope.scaling.type": (["linear"], ARR, STR)}, r"rope.scaling.type = \['linear'\] is not a string"),
])
def test_bad_metadata_is_a_gguf_error(meta: dict, what: str, q8_gguf: Path, tmp_path: Path) -> None:
    g = _rewrite(q8_gguf, tmp_path / "m.gguf", meta)
    with pytest.raises(GgufError, match=what):
        import_gguf(g, tmp_path / "out.cmf", "f32")
    assert not (tmp_path / "out.cmf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gguf-import-")]


def test_a_non_integer_eos_id_is_ignored(q8_gguf: Path, tmp_path: Path) -> None:
    g = _rewrite(q8_gguf, tmp_path / "m.gguf", {"tokenizer.ggml.eos_token_id": ("x", STR)})
    import_gguf(g, tmp_path / "out.cmf", "f32")  # was a TypeError comparing 'x' with the vocab size


@pytest.mark.parametrize("ggml_type", ["F64", "I8", "I32", "Q8_1"])
def test_a_type_without_a_decoder_is_refused_by_the_scan(ggml_type: str, q8_gguf: Path, tmp_path: Path) -> None:
    g = tmp_path / "t.gguf"
    name = "blk.0.attn_norm.weight" if ggml_type in ("F64", "I8", "I32") else "blk.0.attn_q.weight"
    F._retype(q8_gguf, g, {name: ggml_type})
    with pytest.raises(GgufError, match=f"type {ggml_type}, which cannot be dequantized"):
        scan(g)
    with pytest.raises(GgufError):
        import_gguf(g, tmp_path / "out.cmf", "f32")


@pytest.mark.parametrize("ggml_type", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "TQ1_0", "MXFP4"])
def test_quantized_types_of_arbitrary_bytes_import(ggml_type: str, q8_gguf: Path, tmp_path: Path) -> None:
    g = tmp_path / "t.gguf"
    F._retype(q8_gguf, g, {"blk.0.attn_q.weight": ggml_type})
    with np.errstate(all="ignore"):  # random scales: inf * 0 in the package's dequantizer
        F.gguf_import_one(g.read_bytes())  # imported (f32 keeps NaN) or refused as CmfError, nothing else


_VOCAB = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>"],
          "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1, 3], "tokenizer.ggml.pre": "gpt-2"}


@pytest.mark.parametrize("meta, what", [
    ({"tokenizer.ggml.tokens": [1, 2, 3, 4]}, "tokens is not a list of strs"),
    ({"tokenizer.ggml.tokens": "abcd"}, "tokens is not a list of strs"),  # a Rust panic in the library
    ({"tokenizer.ggml.merges": [5]}, "merges is not a list of strs"),
    ({"tokenizer.ggml.token_type": ["a"] * 4}, "token_type is not a list of ints"),
    ({"tokenizer.ggml.merges": ["x y"]}, "cannot be built into a tokenizer"),
    ({"tokenizer.ggml.tokens": ["a", "a", "ab", "<s>"]}, "cannot be built into a tokenizer"),
    ({"tokenizer.ggml.tokens": ["a", "b", "ab", "x y"], "tokenizer.ggml.bos_token_id": 3,
      "tokenizer.ggml.add_bos_token": True}, "cannot be built into a tokenizer"),
])
def test_bad_vocabularies_are_gguf_errors(meta: dict, what: str) -> None:
    with pytest.raises(GgufError, match=what):
        tokenizer_json_from_gguf(dict(_VOCAB, **meta))


@pytest.mark.parametrize("bos", ["x", 1.5, True])
def test_a_bos_id_that_is_not_an_id_is_ignored(bos) -> None:
    out = tokenizer_json_from_gguf(dict(_VOCAB, **{"tokenizer.ggml.bos_token_id": bos,
                                                   "tokenizer.ggml.add_bos_token": True}))
    assert '"TemplateProcessing"' not in out


@pytest.mark.parametrize("in_place", [False, True])
def test_skill_add_refuses_a_donor_holding_nan(in_place: bool, tmp_path: Path) -> None:
    import cmf
    from cmf.format.writer import CmfWriter
    from cmf.tools._skill_graft import SkillError, add_skill

    base = H._base(tmp_path)
    if in_place:
        copy = tmp_path / "copy.cmf"
        copy.write_bytes(base.read_bytes())
        base = copy
    before = base.read_bytes()
    donor = tmp_path / "donor.cmf"
    with cmf.open(base) as b, CmfWriter(donor, b.header.to_dict()) as w:
        for t in b.tensors():
            a = b.array(t.name).copy()
            a[0, 0] = np.nan
            w.add(t.name, "f32", a.shape, a.astype("<f4").tobytes())
    out = tmp_path / "out.cmf"
    with pytest.raises(SkillError, match="holds NaN or infinity"):
        add_skill(base, donor, "s", skill_quant="q8", in_place=in_place, output=None if in_place else out)
    assert base.read_bytes() == before and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
