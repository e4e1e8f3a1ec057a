"""GGUF import and export: round trips through llama.cpp's format, and crafted headers refused fast."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

import hf_fixtures as H  # noqa: E402

import cmf  # noqa: E402
from cmf.cli import main  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.convert.gguf import import_gguf, permute_qk, unpermute_qk  # noqa: E402
from cmf.convert.gguf_export import export_gguf  # noqa: E402
from cmf.convert.gguf_scan import GgufError, scan  # noqa: E402

KINDS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
TEXTS = ["hello world", "数据 tensor 👨‍👩‍👧", "def f(x):\r\n\treturn x", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def f32_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for kind in KINDS:
        p = d / f"{kind}.cmf"
        convert(H.fixture(kind), p, quant="f32")
        out[kind] = p
    return out


def test_qk_permutation_inverts():
    w = np.arange(4 * 6 * 5, dtype=np.float32).reshape(24, 5)
    assert not np.array_equal(permute_qk(w, 4), w)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 4), 4), w)


@pytest.mark.parametrize("kind", KINDS)
def test_f32_round_trip_is_exact(kind, f32_files, tmp_path):
    src = f32_files[kind]
    g = tmp_path / "m.gguf"
    export_gguf(src, g, "F32")
    reader = gguf.GGUFReader(str(g))
    assert reader.fields["general.architecture"].contents() == {"qwen3_moe": "qwen3moe"}.get(kind, kind)
    back = tmp_path / "back.cmf"
    import_gguf(g, back, "f32")
    with cmf.open(src) as a, cmf.open(back) as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            np.testing.assert_array_equal(a.array(name), b.array(name), err_msg=name)
        assert b.verify() == []
        assert b.header.provenance["source_format"] == "gguf"
    with cmf.load(src) as ma, cmf.load(back) as mb:
        ids = list(range(5, 35))
        np.testing.assert_allclose(ma.logits(ids), mb.logits(ids), atol=1e-5, rtol=0)
        for t in TEXTS:
            assert ma.tokenizer.encode(t) == mb.tokenizer.encode(t)
        assert ma.tokenizer.eos_ids <= mb.tokenizer.eos_ids | ma.tokenizer.eos_ids


@pytest.mark.parametrize("gtype,bound", [("Q8_0", 0.01), ("Q4_0", 0.15), ("F16", 1e-3)])
def test_quantized_export_import_within_bound(gtype, bound, f32_files, tmp_path):
    src = f32_files["qwen3"]
    g = tmp_path / "m.gguf"
    assert main(["export", str(src), "-o", str(g), "--format", "gguf", "--gguf-type", gtype]) == 0
    back = tmp_path / "back.cmf"
    assert main(["import-gguf", str(g), "-o", str(back), "--quant", "f32"]) == 0
    with cmf.open(src) as a, cmf.open(back) as b:
        for name in a.keys():
            x, y = a.array(name), b.array(name)
            assert np.abs(x - y).max() <= bound * max(np.abs(x).max(), 1e-6), name


def test_import_is_deterministic(f32_files, tmp_path):
    g = tmp_path / "m.gguf"
    export_gguf(f32_files["llama"], g, "Q8_0")
    a, b = tmp_path / "a.cmf", tmp_path / "b.cmf"
    import_gguf(g, a, "q8")
    import_gguf(g, b, "q8")
    assert a.read_bytes() == b.read_bytes()


def _header(*parts: bytes) -> bytes:
    return b"GGUF" + struct.pack("<I", 3) + b"".join(parts)


CRAFTED = {
    "array of 2**63 elements (43 bytes)": (_header(struct.pack("<QQ", 0, 1), struct.pack("<Q", 1), b"k",
                                                   struct.pack("<IIQ", 9, 4, 2**63)) + b"\0" * 4)[:43],
    "2**62 metadata entries": _header(struct.pack("<QQ", 0, 2**62)),
    "2**60 tensors": _header(struct.pack("<QQ", 2**60, 0)),
    "key string past EOF": _header(struct.pack("<QQ", 0, 1), struct.pack("<Q", 10**12), b"abc"),
    "array of 2**40 strings": _header(struct.pack("<QQ", 0, 1), struct.pack("<Q", 1), b"k",
                                      struct.pack("<IIQ", 9, 8, 2**40)),
    "unknown value type": _header(struct.pack("<QQ", 0, 1), struct.pack("<Q", 1), b"k", struct.pack("<I", 77)),
    "bad magic": b"GGUX" + b"\0" * 40,
    "version 9": b"GGUF" + struct.pack("<IQQ", 9, 0, 0),
    "tensor with 7 dims": _header(struct.pack("<QQ", 1, 0), struct.pack("<Q", 1), b"t", struct.pack("<I", 7)),
    "tensor data past EOF": _header(struct.pack("<QQ", 1, 0), struct.pack("<Q", 1), b"t",
                                    struct.pack("<IQIQ", 1, 1024, 0, 0)),
    "empty": b"",
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_headers_rejected_quickly(case, tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(CRAFTED[case])
    t0 = time.perf_counter()
    with pytest.raises(GgufError):
        scan(p)
    with pytest.raises(GgufError):
        import_gguf(p, tmp_path / "out.cmf")
    assert time.perf_counter() - t0 < 1.0
    assert not (tmp_path / "out.cmf").exists()
    assert main(["import-gguf", str(p), "-o", str(tmp_path / "o.cmf")]) == 2
