"""One test per malformed input: the strict reader must raise exactly the right CmfError subclass.

Every case starts from a valid file written by ``CmfWriter`` and patches bytes (envelope fields,
directory records, payload bytes, header JSON), or writes deliberately broken masks / sparse
index sections through the writer's raw-bytes path. Error classes follow REFERENCE_NOTES §1.1.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cmf
from cmf.format import constants
from cmf.format.directory import RECORD_DTYPE, decode_directory
from cmf.format.errors import (
    BoundsError,
    CmfError,
    FileNotFound,
    InvalidMagic,
    MissingTensor,
    ParseError,
    ShardError,
    UnknownDtype,
    UnsupportedFeature,
    UnsupportedVersion,
)
from cmf.format.hash64 import hash64
from cmf.format.masks import encode_masks, mask_layout
from cmf.format.sparse_index import build_sparse_index
from cmf.format.writer import CmfWriter

from _builders import arch, header, sample_masks, sample_tensors, vbit_payload

U64_MAX = 2**64 - 1

# Envelope field name -> (offset, struct format), spec §1.
ENV_FIELDS: dict[str, tuple[int, str]] = {
    "magic": (0x00, "<4s"), "version": (0x04, "<I"), "flags": (0x08, "<I"), "features": (0x0C, "<I"),
    "header_hash": (0x70, "<Q"), "dir_hash": (0x78, "<Q"),
}
for _i, _name in enumerate(constants.SECTION_NAMES):
    ENV_FIELDS[f"{_name}_off"] = (0x10 + 16 * _i, "<Q")
    ENV_FIELDS[f"{_name}_len"] = (0x18 + 16 * _i, "<Q")

# Record field name -> (offset inside the 56-byte record, struct format), from RECORD_DTYPE.
REC_FIELDS: dict[str, tuple[int, str]] = {
    name: (off, {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[dt.base.itemsize])
    for name, (dt, off) in RECORD_DTYPE.fields.items()
}


# ----------------------------------------------------------------------------- sample payloads


def q1s_payload(rows: int, cols: int, outliers: list[tuple[int, float]]) -> bytes:
    """A q1s payload: q1 base tiles, then [u32 count] and (u32 index, f16 value) entries."""
    base = bytes(6 * (rows * cols // 32))
    over = b"".join(struct.pack("<I", i) + np.float16(v).tobytes() for i, v in outliers)
    return base + struct.pack("<I", len(outliers)) + over


def q1t_payload(rows: int, cols: int, per_row: list[list[tuple[int, float]]]) -> bytes:
    """A q1t payload: 9-byte tiles, u32 row_ptr[rows+1], then (u16 col, f16 value) entries."""
    base = bytes(9 * rows * (cols // 32))
    ptr = np.concatenate([[0], np.cumsum([len(r) for r in per_row])]).astype("<u4").tobytes()
    ent = b"".join(struct.pack("<H", c) + np.float16(v).tobytes() for r in per_row for c, v in r)
    return base + ptr + ent


def extra_tensors() -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """Tensors of the dtypes that ``sample_tensors`` lacks (contents arbitrary but well-formed)."""
    rng = np.random.default_rng(7)
    gpr = 64 // 32

    def rand(n: int) -> bytes:
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    return [
        ("extra.vbit", "vbit", (4, 64), vbit_payload(4, 64, [3, 5, 6, 8], seed=3)),
        ("extra.q4tp", "q4tp", (4, 64), rand(4 * gpr * 16 + 4 * 4 + 4 * ((5 * gpr + 7) // 8))),
        ("extra.q2tp", "q2tp", (4, 64), rand(4 * gpr * 8 + 4 * 4 + 4 * ((5 * gpr + 7) // 8))),
        ("extra.q1", "q1", (4, 64), rand(6 * 4 * gpr)),
        ("extra.q8_2f", "q8_2f", (4, 64), rand(4 * 64 + 2 * 4 + 2 * 64)),
        ("extra.q4_block", "q4_block", (3, 50), rand(18 * ((150 + 31) // 32))),
        ("extra.q1s", "q1s", (4, 64), q1s_payload(4, 64, [(5, 1.5), (200, -2.0)])),
        ("extra.q1t", "q1t", (4, 64), q1t_payload(4, 64, [[(1, 0.5)], [], [(63, -1.0), (2, 2.0)], []])),
    ]


def write_rich(path: Path, *, masks: Any = "sample", index: bytes | None | str = "sample",
               vocab: bytes | None = b'{"model":{"type":"BPE"}}', hdr: dict | None = None,
               tensors: list | None = None) -> Path:
    """Write a valid file with every dtype, masks, vocab and sparse index (each overridable).

    ``masks``/``index`` may be raw section bytes (written verbatim) or None (absent).
    """
    hdr = hdr or header()
    if masks == "sample":
        masks = encode_masks(sample_masks(), hdr["arch"])
    if index == "sample":
        index = build_sparse_index(sample_masks(), hdr["arch"]) if masks is not None else None
    with CmfWriter(path, hdr) as w:
        for name, dtype, shape, payload in tensors if tensors is not None else sample_tensors() + extra_tensors():
            w.add(name, dtype, shape, payload)
        if masks is not None:
            w.set_masks(masks, sparse_index=index)
        if vocab is not None:
            w.set_vocab(vocab)
    return path


# ----------------------------------------------------------------------------- byte patching


class Patch:
    """A mutable copy of a CMF file's bytes with field-level patch helpers."""

    def __init__(self, data: bytes) -> None:
        self.buf = bytearray(data)
        dir_off, dir_len = self.env("dir_off"), self.env("dir_len")
        _, self.names = decode_directory(bytes(self.buf[dir_off:dir_off + dir_len]))

    # envelope
    def env(self, field: str) -> Any:
        """Read one envelope field."""
        off, fmt = ENV_FIELDS[field]
        return struct.unpack_from(fmt, self.buf, off)[0]

    def patch_envelope(self, field: str, value: Any) -> "Patch":
        """Overwrite one envelope field."""
        off, fmt = ENV_FIELDS[field]
        struct.pack_into(fmt, self.buf, off, value)
        return self

    # directory
    def index(self, name: str) -> int:
        """Record index of tensor ``name``."""
        return self.names.index(name)

    def record_pos(self, i: int) -> int:
        """Absolute file offset of record ``i``."""
        return self.env("dir_off") + constants.DIR_PREFIX + constants.DIR_RECORD_SIZE * i

    def record(self, i: int | str, field: str, dim: int | None = None) -> int:
        """Read a record field (``dim`` selects one entry of ``shape``)."""
        i = self.index(i) if isinstance(i, str) else i
        off, fmt = REC_FIELDS[field]
        return struct.unpack_from(fmt, self.buf, self.record_pos(i) + off + 4 * (dim or 0))[0]

    def patch_record(self, i: int | str, field: str, value: Any) -> "Patch":
        """Overwrite a record field; for ``shape`` pass a sequence of up to 6 dims."""
        i = self.index(i) if isinstance(i, str) else i
        off, fmt = REC_FIELDS[field]
        pos = self.record_pos(i) + off
        if field == "shape":
            dims = list(value) + [0] * (6 - len(value))
            struct.pack_into("<6I", self.buf, pos, *dims)
        else:
            struct.pack_into(fmt, self.buf, pos, value)
        return self

    def patch_dir_prefix(self, count: int | None = None, pool_off: int | None = None) -> "Patch":
        """Overwrite the directory's u64 count and/or pool_off."""
        base = self.env("dir_off")
        if count is not None:
            struct.pack_into("<Q", self.buf, base, count)
        if pool_off is not None:
            struct.pack_into("<Q", self.buf, base + 8, pool_off)
        return self

    def pool_pos(self) -> int:
        """Absolute file offset of the name pool."""
        return self.env("dir_off") + struct.unpack_from("<Q", self.buf, self.env("dir_off") + 8)[0]

    # payloads and sections
    def payload_pos(self, name: str) -> int:
        """Absolute file offset of tensor ``name``'s payload."""
        return self.env("data_off") + self.record(name, "off")

    def section_pos(self, section: str) -> int:
        return self.env(f"{section}_off")

    def poke(self, pos: int, data: bytes) -> "Patch":
        """Overwrite raw bytes at an absolute offset."""
        self.buf[pos:pos + len(data)] = data
        return self

    def rewrite_header(self, new: bytes | dict) -> "Patch":
        """Replace the header JSON in place: the directory moves right after it, envelope fixed."""
        raw = new if isinstance(new, bytes) else json.dumps(new).encode()
        h_off, d_off, d_len = self.env("header_off"), self.env("dir_off"), self.env("dir_len")
        directory = bytes(self.buf[d_off:d_off + d_len])
        assert h_off + len(raw) + d_len <= self.env("data_off"), "header too big for the head gap"
        end = h_off + len(raw) + d_len
        self.buf[h_off:h_off + len(raw)] = raw
        self.buf[h_off + len(raw):end] = directory
        self.buf[end:self.env("data_off")] = bytes(self.env("data_off") - end)
        self.patch_envelope("header_len", len(raw)).patch_envelope("dir_off", h_off + len(raw))
        return self.patch_envelope("header_hash", hash64(raw))

    def header_json(self) -> dict:
        off, n = self.env("header_off"), self.env("header_len")
        return json.loads(bytes(self.buf[off:off + n]))

    def write(self, path: Path) -> Path:
        path.write_bytes(bytes(self.buf))
        return path


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Bytes of the valid file every case patches."""
    path = write_rich(tmp_path_factory.mktemp("rich") / "rich.cmf")
    with cmf.open(path) as f:
        assert f.verify() == []
    return path.read_bytes()


@pytest.fixture
def patched(rich: bytes) -> Patch:
    return Patch(rich)


def expect(tmp_path: Path, p: Patch, exc: type[CmfError], *needles: str) -> CmfError:
    """Write ``p``, open it, and assert it raises exactly ``exc`` with every needle in the message."""
    path = p.write(tmp_path / "bad.cmf")
    with pytest.raises(CmfError) as info:
        with cmf.open(path) as f:
            f.verify()
    assert type(info.value) is exc, f"expected {exc.__name__}, got {type(info.value).__name__}: {info.value}"
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"
    return info.value


def opens(tmp_path: Path, p: Patch) -> cmf.CmfFile:
    return cmf.open(p.write(tmp_path / "ok.cmf"))


# ----------------------------------------------------------------------------- sanity


def test_rich_file_is_valid(tmp_path: Path, patched: Patch) -> None:
    with opens(tmp_path, patched) as f:
        assert f.verify() == []
        assert f.masks is not None and f.sparse_index and f.tokenizer_json
        assert {int(f.tensor(n).dtype) for n in f.keys()} >= {0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16}


# ----------------------------------------------------------------------------- envelope


@pytest.mark.parametrize("size", [0, 1, 64, 127])
def test_shorter_than_envelope(tmp_path: Path, rich: bytes, size: int) -> None:
    path = tmp_path / "short.cmf"
    path.write_bytes(rich[:size])
    with pytest.raises(BoundsError, match="128"):
        cmf.open(path)


def test_envelope_only(tmp_path: Path, rich: bytes) -> None:
    path = tmp_path / "env.cmf"
    path.write_bytes(rich[:128])
    with pytest.raises(BoundsError, match="past the end"):
        cmf.open(path)


@pytest.mark.parametrize("magic", [b"CMF\x02", b"GGUF", b"\x00\x00\x00\x00", b"cmf\x01"])
def test_bad_magic(tmp_path: Path, patched: Patch, magic: bytes) -> None:
    expect(tmp_path, patched.patch_envelope("magic", magic), InvalidMagic, "magic")


@pytest.mark.parametrize("version", [0, 1, 3, 2**32 - 1])
def test_unsupported_version(tmp_path: Path, patched: Patch, version: int) -> None:
    err = expect(tmp_path, patched.patch_envelope("version", version), UnsupportedVersion, str(version))
    assert err.version == version


@pytest.mark.parametrize("bit", [3, 4, 7, 8, 16, 31])
def test_refused_feature_bit(tmp_path: Path, patched: Patch, bit: int) -> None:
    patched.patch_envelope("features", patched.env("features") | (1 << bit))
    err = expect(tmp_path, patched, UnsupportedFeature, str(bit))
    assert err.bits == 1 << bit


@pytest.mark.parametrize("bit", [0, 1, 2, 5, 6])
def test_accepted_feature_bit(tmp_path: Path, patched: Patch, bit: int) -> None:
    patched.patch_envelope("features", patched.env("features") | (1 << bit))
    with opens(tmp_path, patched) as f:
        assert f.verify() == []
        assert f.runnable is (bit != 6)
        assert f.is_skill_file is (bit == 6)


def test_flags_are_not_read(tmp_path: Path, patched: Patch) -> None:
    with opens(tmp_path, patched.patch_envelope("flags", 0xFFFFFFFF)) as f:
        assert f.verify() == []


@pytest.mark.parametrize("section", ["header", "dir"])
def test_required_section_empty(tmp_path: Path, patched: Patch, section: str) -> None:
    expect(tmp_path, patched.patch_envelope(f"{section}_len", 0), BoundsError, section, "required")


@pytest.mark.parametrize("section", constants.SECTION_NAMES)
def test_section_past_eof(tmp_path: Path, patched: Patch, section: str) -> None:
    size = len(patched.buf)
    patched.patch_envelope(f"{section}_len", size - patched.env(f"{section}_off") + 1)
    expect(tmp_path, patched, BoundsError, section, "past the end")


@pytest.mark.parametrize("section", constants.SECTION_NAMES)
def test_section_offset_past_eof(tmp_path: Path, patched: Patch, section: str) -> None:
    expect(tmp_path, patched.patch_envelope(f"{section}_off", len(patched.buf)), BoundsError, section)


@pytest.mark.parametrize("section", constants.SECTION_NAMES)
@pytest.mark.parametrize("off,length", [(U64_MAX, 1), (2**64 - 8, 16), (8, U64_MAX), (2**63, 2**63)])
def test_section_overflows_u64(tmp_path: Path, patched: Patch, section: str, off: int, length: int) -> None:
    patched.patch_envelope(f"{section}_off", off).patch_envelope(f"{section}_len", length)
    expect(tmp_path, patched, BoundsError, section)


@pytest.mark.parametrize("delta", [1, 64, 2048])
def test_data_off_not_page_aligned(tmp_path: Path, patched: Patch, delta: int) -> None:
    patched.patch_envelope("data_off", patched.env("data_off") + delta)
    patched.patch_envelope("data_len", patched.env("data_len") - delta)  # stay inside the file
    expect(tmp_path, patched, BoundsError, "data_off", "4096")


def test_absent_section_offset_ignored(tmp_path: Path, rich: bytes) -> None:
    """A length-0 section is absent whatever its offset says."""
    p = Patch(rich).patch_envelope("index_off", U64_MAX).patch_envelope("index_len", 0)
    p.patch_envelope("vocab_off", 2**63).patch_envelope("vocab_len", 0)
    p.rewrite_header({k: v for k, v in p.header_json().items() if k != "section_hashes"})
    with opens(tmp_path, p) as f:
        assert f.tokenizer_json is None and f.sparse_index is None
        assert f.verify() == []


# ----------------------------------------------------------------------------- header JSON


def test_header_not_utf8(tmp_path: Path, patched: Patch) -> None:
    raw = json.dumps(patched.header_json()).encode().replace(b'"qwen3"', b'"qwen\xff"')
    assert b"\xff" in raw
    expect(tmp_path, patched.rewrite_header(raw), ParseError, "header", "UTF-8")


@pytest.mark.parametrize("raw", [b'{"version": 2,', b"not json", b"{}}", b"[]", b"null", b"\x00" * 8,
                                 b'{"version": NaN}', b'{"a": 1, "a": 2}'])
def test_header_not_json(tmp_path: Path, patched: Patch, raw: bytes) -> None:
    expect(tmp_path, patched.rewrite_header(raw), ParseError, "header")


@pytest.mark.parametrize("key", ["version", "arch", "quant_type"])
def test_header_missing_required_key(tmp_path: Path, patched: Patch, key: str) -> None:
    h = patched.header_json()
    del h[key]
    expect(tmp_path, patched.rewrite_header(h), ParseError, "header", key)


@pytest.mark.parametrize("key", ["arch_name", "hidden_size", "num_layers", "layer_types", "rms_norm_eps"])
def test_header_missing_arch_key(tmp_path: Path, patched: Patch, key: str) -> None:
    h = patched.header_json()
    del h["arch"][key]
    expect(tmp_path, patched.rewrite_header(h), ParseError, "header", key)


@pytest.mark.parametrize("quant_type", ["Q3_K", "q8_row", "", 7, None])
def test_header_bad_quant_type(tmp_path: Path, patched: Patch, quant_type: Any) -> None:
    h = patched.header_json()
    h["quant_type"] = quant_type
    expect(tmp_path, patched.rewrite_header(h), ParseError, "quant_type")


def test_header_bad_layer_type(tmp_path: Path, patched: Patch) -> None:
    h = patched.header_json()
    h["arch"]["layer_types"] = ["FullAttention", "Bogus"]
    expect(tmp_path, patched.rewrite_header(h), ParseError, "layer_types")


def test_header_over_size_cap(tmp_path: Path, patched: Patch, monkeypatch: pytest.MonkeyPatch) -> None:
    cap = patched.env("header_len") - 1
    monkeypatch.setattr(constants, "MAX_HEADER_BYTES", cap)
    monkeypatch.setattr("cmf.format.reader.MAX_HEADER_BYTES", cap, raising=False)
    expect(tmp_path, patched, ParseError, "header", "cap")


def test_header_at_size_cap_opens(tmp_path: Path, patched: Patch, monkeypatch: pytest.MonkeyPatch) -> None:
    cap = patched.env("header_len")
    monkeypatch.setattr(constants, "MAX_HEADER_BYTES", cap)
    monkeypatch.setattr("cmf.format.reader.MAX_HEADER_BYTES", cap, raising=False)
    with opens(tmp_path, patched) as f:
        assert f.verify() == []


# ----------------------------------------------------------------------------- directory structure


@pytest.mark.parametrize("dir_len", [1, 8, 15])
def test_directory_shorter_than_prefix(tmp_path: Path, patched: Patch, dir_len: int) -> None:
    expect(tmp_path, patched.patch_envelope("dir_len", dir_len), ParseError, "directory", "16")


@pytest.mark.parametrize("count", [2**60, U64_MAX, 2**64 // 56 + 1, 1000])
def test_directory_count_too_big(tmp_path: Path, patched: Patch, count: int) -> None:
    expect(tmp_path, patched.patch_dir_prefix(count=count), ParseError, "count")


def test_directory_count_records_overlap_pool(tmp_path: Path, patched: Patch) -> None:
    # One more record than written: the records now run into the name pool.
    expect(tmp_path, patched.patch_dir_prefix(count=len(patched.names) + 1), ParseError, "pool_off")


@pytest.mark.parametrize("delta", [-1, -56, -(10**6)])
def test_pool_off_inside_records(tmp_path: Path, patched: Patch, delta: int) -> None:
    records_end = 16 + 56 * len(patched.names)
    expect(tmp_path, patched.patch_dir_prefix(pool_off=max(0, records_end + delta)), ParseError, "pool_off")


@pytest.mark.parametrize("pool_off", ["dir_len+1", 2**63, U64_MAX])
def test_pool_off_past_directory(tmp_path: Path, patched: Patch, pool_off: Any) -> None:
    value = patched.env("dir_len") + 1 if pool_off == "dir_len+1" else pool_off
    expect(tmp_path, patched.patch_dir_prefix(pool_off=value), ParseError, "pool_off")


def test_pool_off_at_directory_end_is_empty_pool(tmp_path: Path, patched: Patch) -> None:
    # Empty pool with non-empty names: every name lies outside it.
    expect(tmp_path, patched.patch_dir_prefix(pool_off=patched.env("dir_len")), ParseError, "name pool")


@pytest.mark.parametrize("field,value", [("name_off", 60000), ("name_off", 2**32 - 1), ("name_len", 0xFFFF)])
def test_name_outside_pool(tmp_path: Path, patched: Patch, field: str, value: int) -> None:
    expect(tmp_path, patched.patch_record(3, field, value), ParseError, "record 3", "name pool")


def test_name_just_past_pool(tmp_path: Path, patched: Patch) -> None:
    last = len(patched.names) - 1
    patched.patch_record(last, "name_len", patched.record(last, "name_len") + 1)
    expect(tmp_path, patched, ParseError, f"record {last}", "name pool")


@pytest.mark.parametrize("bad", [b"\xff", b"\xc3", b"\xed\xa0\x80"])  # invalid, truncated, surrogate
def test_name_not_utf8(tmp_path: Path, patched: Patch, bad: bytes) -> None:
    expect(tmp_path, patched.poke(patched.pool_pos(), bad), ParseError, "record 0", "UTF-8")


@pytest.mark.parametrize("ndim", [7, 8, 255])
def test_ndim_over_six(tmp_path: Path, patched: Patch, ndim: int) -> None:
    expect(tmp_path, patched.patch_record(1, "ndim", ndim), ParseError, "record 1", "ndim")


def test_ndim_six_opens(tmp_path: Path, patched: Patch) -> None:
    name = "model.embed_tokens.weight"  # f32 (128, 64) -> 6-D with the same numel
    patched.patch_record(name, "ndim", 6).patch_record(name, "shape", [2, 64, 2, 2, 4, 4])
    with opens(tmp_path, patched) as f:
        assert f.tensor(name).shape == (2, 64, 2, 2, 4, 4)


@pytest.mark.parametrize("dtype_id", [17, 18, 100, 255])
def test_unknown_dtype(tmp_path: Path, patched: Patch, dtype_id: int) -> None:
    name = "model.norm.weight"
    err = expect(tmp_path, patched.patch_record(name, "dtype", dtype_id), UnknownDtype, name, str(dtype_id))
    assert isinstance(err, ParseError) and err.dtype_id == dtype_id


def test_duplicate_names(tmp_path: Path, patched: Patch) -> None:
    dup = patched.names[0]
    patched.patch_record(4, "name_off", patched.record(0, "name_off"))
    patched.patch_record(4, "name_len", patched.record(0, "name_len"))
    expect(tmp_path, patched, ParseError, "duplicate", dup)


def test_empty_directory_opens(tmp_path: Path) -> None:
    path = write_rich(tmp_path / "empty.cmf", tensors=[])
    with cmf.open(path) as f:
        assert f.keys() == [] and f.verify() == []


# ----------------------------------------------------------------------------- tensor bounds


@pytest.mark.parametrize("delta", [1, 8, 32, 63])
def test_tensor_offset_unaligned(tmp_path: Path, patched: Patch, delta: int) -> None:
    name = "model.norm.weight"
    patched.patch_record(name, "off", patched.record(name, "off") + delta)
    expect(tmp_path, patched, BoundsError, name, "aligned")


def test_tensor_starts_past_data(tmp_path: Path, patched: Patch) -> None:
    name = "model.norm.weight"
    data_len = patched.env("data_len")
    patched.patch_record(name, "off", (data_len + 63) // 64 * 64)
    expect(tmp_path, patched, BoundsError, name, "data section")


def test_tensor_ends_past_data(tmp_path: Path, patched: Patch) -> None:
    name = "model.embed_tokens.weight"
    patched.patch_record(name, "off", patched.env("data_len") // 64 * 64 - 64)
    expect(tmp_path, patched, BoundsError, name, "data section")


def test_tensor_past_data_but_inside_file(tmp_path: Path, patched: Patch) -> None:
    """The bound is data_len, not the file: a tensor may not spill into the masks section."""
    patched.patch_envelope("data_len", patched.env("data_len") - 1)
    expect(tmp_path, patched, BoundsError, "data section")


@pytest.mark.parametrize("off,nbytes", [(2**64 - 64, 256), (64, U64_MAX), (2**63, 2**63), (U64_MAX - 63, 64)])
def test_tensor_offset_plus_nbytes_overflows(tmp_path: Path, patched: Patch, off: int, nbytes: int) -> None:
    name = "model.norm.weight"
    patched.patch_record(name, "off", off).patch_record(name, "nbytes", nbytes)
    expect(tmp_path, patched, BoundsError, name)


FIXED = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
         "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight", "extra.q4tp",
         "extra.q2tp", "extra.q1", "extra.q8_2f", "extra.q4_block"]


@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("delta", [-1, +64])
def test_nbytes_not_expected(tmp_path: Path, patched: Patch, name: str, delta: int) -> None:
    nb = patched.record(name, "nbytes")
    if delta > 0:  # keep the span inside the data: move the tensor to the start of the blob
        patched.patch_record(name, "off", 0)
    expect(tmp_path, patched.patch_record(name, "nbytes", nb + delta), BoundsError, name, "needs")


@pytest.mark.parametrize("name", FIXED)
def test_shape_not_matching_nbytes(tmp_path: Path, patched: Patch, name: str) -> None:
    patched.patch_record(name, "shape", [patched.record(name, "shape", 0) + 1, patched.record(name, "shape", 1)]
                         if patched.record(name, "ndim") == 2 else [patched.record(name, "shape", 0) + 1])
    expect(tmp_path, patched, BoundsError, name)


@pytest.mark.parametrize("shape", [[2**32 - 1, 2**32 - 1], [2**32 - 1] * 6, [2**31, 2**31]])
def test_shape_product_overflow(tmp_path: Path, patched: Patch, shape: list[int]) -> None:
    name = "model.embed_tokens.weight"
    patched.patch_record(name, "ndim", len(shape)).patch_record(name, "shape", shape)
    expect(tmp_path, patched, BoundsError, name)


@pytest.mark.parametrize("shape", [[2**31, 2**30], [3 * 2**30, 2**30], [2**28, 2**28]])
def test_f32_huge_shape_nbytes_check(tmp_path: Path, patched: Patch, shape: list[int]) -> None:
    """Regression: 4·numel used to wrap in int64 for 2**61 <= numel < 2**62, skipping the check."""
    name = "model.embed_tokens.weight"
    patched.patch_record(name, "shape", shape)
    expect(tmp_path, patched, BoundsError, name)


@pytest.mark.parametrize("name,nbytes", [("model.embed_tokens.weight", 48), ("model.norm.weight", 24)])
def test_shape_rounding_below_guard(tmp_path: Path, patched: Patch, name: str, nbytes: int) -> None:
    """numel = 2**62 + 12 whose float64 product rounds to 2**62 - 512: 4·numel wraps to 48 in int64
    (f32) and 2·numel goes negative (f16), so a size check done in int64 would pass or be skipped."""
    shape = [915225988, 48920869, 103]
    assert shape[0] * shape[1] * shape[2] == 2**62 + 12
    patched.patch_record(name, "ndim", 3).patch_record(name, "shape", shape).patch_record(name, "nbytes", nbytes)
    expect(tmp_path, patched, BoundsError, name)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.gate_proj.weight", "extra.q8_2f"])
def test_q8_row_three_d(tmp_path: Path, patched: Patch, name: str) -> None:
    rows, cols = patched.record(name, "shape", 0), patched.record(name, "shape", 1)
    patched.patch_record(name, "ndim", 3).patch_record(name, "shape", [rows, cols, 1])
    expect(tmp_path, patched, BoundsError, name, "2-D")


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "extra.q4tp", "extra.q2tp",
                                  "extra.q1", "extra.vbit", "model.layers.1.mlp.gate_proj.weight",
                                  "extra.q1s", "extra.q1t"])
def test_grouped_dtype_cols_not_multiple_of_32(tmp_path: Path, patched: Patch, name: str) -> None:
    rows, cols = patched.record(name, "shape", 0), patched.record(name, "shape", 1)
    patched.patch_record(name, "shape", [rows * 2, cols // 2 + 16 if cols // 2 % 32 == 0 else cols // 2])
    expect(tmp_path, patched, BoundsError, name, "% 32")


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "extra.vbit", "extra.q1s"])
def test_grouped_dtype_one_d(tmp_path: Path, patched: Patch, name: str) -> None:
    rows, cols = patched.record(name, "shape", 0), patched.record(name, "shape", 1)
    patched.patch_record(name, "ndim", 1).patch_record(name, "shape", [rows * cols])
    expect(tmp_path, patched, BoundsError, name, "2-D")


# ----------------------------------------------------------------------------- variable payloads

VBIT = "extra.vbit"
VBIT_RO = "model.layers.1.mlp.gate_proj.weight"  # (4, 64), widths [3, 4, 8, 6]


@pytest.mark.parametrize("name", [VBIT, VBIT_RO])
@pytest.mark.parametrize("width", [0, 1, 2, 7, 9, 255])
def test_vbit_bad_width(tmp_path: Path, patched: Patch, name: str, width: int) -> None:
    expect(tmp_path, patched.poke(patched.payload_pos(name) + 1, bytes([width])), BoundsError, name,
           f"width {width}")


def test_vbit_length_mismatch(tmp_path: Path, patched: Patch) -> None:
    # width 3 -> 4 on row 0 (valid width): the rows no longer add up to the payload length
    expect(tmp_path, patched.poke(patched.payload_pos(VBIT), b"\x04"), BoundsError, VBIT, "widths imply")


@pytest.mark.parametrize("name", [VBIT, VBIT_RO])
def test_vbit_nbytes_short(tmp_path: Path, patched: Patch, name: str) -> None:
    expect(tmp_path, patched.patch_record(name, "nbytes", patched.record(name, "nbytes") - 1), BoundsError, name)


@pytest.mark.parametrize("nbytes", [0, 3, 20])
def test_vbit_shorter_than_head(tmp_path: Path, patched: Patch, nbytes: int) -> None:
    expect(tmp_path, patched.patch_record(VBIT_RO, "nbytes", nbytes), BoundsError, VBIT_RO)


def _ro_offsets_pos(p: Patch) -> int:
    rows, cols = 4, 64
    return p.payload_pos(VBIT_RO) + rows + 2 * rows * (cols // 32)


def test_vbit_ro_first_offset_nonzero(tmp_path: Path, patched: Patch) -> None:
    expect(tmp_path, patched.poke(_ro_offsets_pos(patched), struct.pack("<I", 1)), BoundsError, VBIT_RO,
           "offsets[0]")


def test_vbit_ro_offsets_not_monotonic(tmp_path: Path, patched: Patch) -> None:
    pos = _ro_offsets_pos(patched)
    offs = list(struct.unpack_from("<5I", patched.buf, pos))
    offs[1], offs[2] = offs[2], offs[1]
    expect(tmp_path, patched.poke(pos, struct.pack("<5I", *offs)), BoundsError, VBIT_RO, "offsets")


def test_vbit_ro_offset_past_end(tmp_path: Path, patched: Patch) -> None:
    pos = _ro_offsets_pos(patched)
    expect(tmp_path, patched.poke(pos + 16, struct.pack("<I", 2**32 - 1)), BoundsError, VBIT_RO)


def test_vbit_ro_width_changed(tmp_path: Path, patched: Patch) -> None:
    expect(tmp_path, patched.poke(patched.payload_pos(VBIT_RO), b"\x04"), BoundsError, VBIT_RO)


def _q1s_count_pos(p: Patch) -> int:
    return p.payload_pos("extra.q1s") + 6 * (4 * 64 // 32)


@pytest.mark.parametrize("count", [3, 1000, 2**32 - 1])
def test_q1s_count_past_payload(tmp_path: Path, patched: Patch, count: int) -> None:
    expect(tmp_path, patched.poke(_q1s_count_pos(patched), struct.pack("<I", count)), BoundsError,
           "extra.q1s", "count")


def test_q1s_count_short(tmp_path: Path, patched: Patch) -> None:
    expect(tmp_path, patched.poke(_q1s_count_pos(patched), struct.pack("<I", 1)), BoundsError, "extra.q1s")


def test_q1s_outlier_index_past_tensor(tmp_path: Path, patched: Patch) -> None:
    expect(tmp_path, patched.poke(_q1s_count_pos(patched) + 4, struct.pack("<I", 256)), BoundsError,
           "extra.q1s", "index")


@pytest.mark.parametrize("nbytes", [0, 47, 51])
def test_q1s_shorter_than_base(tmp_path: Path, patched: Patch, nbytes: int) -> None:
    expect(tmp_path, patched.patch_record("extra.q1s", "nbytes", nbytes), BoundsError, "extra.q1s")


def _q1t_ptr_pos(p: Patch) -> int:
    return p.payload_pos("extra.q1t") + 9 * 4 * (64 // 32)


@pytest.mark.parametrize("last", [4, 100, 2**32 - 1])
def test_q1t_row_ptr_past_end(tmp_path: Path, patched: Patch, last: int) -> None:
    expect(tmp_path, patched.poke(_q1t_ptr_pos(patched) + 16, struct.pack("<I", last)), BoundsError, "extra.q1t")


def test_q1t_row_ptr_not_monotonic(tmp_path: Path, patched: Patch) -> None:
    # row_ptr = [0, 1, 1, 3, 3] -> [0, 2, 1, 3, 3]
    expect(tmp_path, patched.poke(_q1t_ptr_pos(patched) + 4, struct.pack("<I", 2)), BoundsError, "extra.q1t",
           "monotonic")


def test_q1t_row_ptr_first_nonzero(tmp_path: Path, patched: Patch) -> None:
    expect(tmp_path, patched.poke(_q1t_ptr_pos(patched), struct.pack("<I", 1)), BoundsError, "extra.q1t")


def test_q1t_column_past_row(tmp_path: Path, patched: Patch) -> None:
    expect(tmp_path, patched.poke(_q1t_ptr_pos(patched) + 20, struct.pack("<H", 64)), BoundsError,
           "extra.q1t", "column")


@pytest.mark.parametrize("nbytes", [0, 71, 91])
def test_q1t_shorter_than_row_ptr(tmp_path: Path, patched: Patch, nbytes: int) -> None:
    expect(tmp_path, patched.patch_record("extra.q1t", "nbytes", nbytes), BoundsError, "extra.q1t")


def test_q1t_columns_over_u16(tmp_path: Path, patched: Patch) -> None:
    # 65568 columns (a multiple of 32 past 65536): q1t cannot address them with u16
    patched.patch_record("extra.q1t", "shape", [1, 65568])
    expect(tmp_path, patched, BoundsError, "extra.q1t")


# ----------------------------------------------------------------------------- reserved dtypes


def test_reserved_dtypes_open(tmp_path: Path) -> None:
    raw = bytes(range(10))
    tensors = [("r.mix8_4", 5, (4, 8), bytes(17)), ("r.u8", 6, (10,), raw), ("r.q4_col", 7, (3,), bytes(64)),
               ("te.config_json", 6, (13,), b'{"dim": 1024}')]
    path = write_rich(tmp_path / "reserved.cmf", tensors=tensors)
    with cmf.open(path) as f:
        assert [int(f.tensor(n).dtype) for n in f.keys()] == [5, 6, 7, 6]
        assert f.array("r.u8").tobytes() == raw
        assert bytes(f.raw("te.config_json")) == b'{"dim": 1024}'
        assert f.verify() == []


# ----------------------------------------------------------------------------- masks section

ARCH = arch()
LEGACY = mask_layout(ARCH)["legacy"]


def masks_section(entries: list[dict], *, n_masks: int | None = None, default_task: Any = "general",
                  meta: bytes | None = None, meta_room: int = 1024, extra_tail: int = 0) -> bytes:
    """Hand-built masks section; entries without blob_off/blob_len get sequential 8-aligned blobs.

    The meta is padded with spaces to ``meta_room`` bytes, so blob offsets do not depend on it.
    Blobs are all-ones bitfields of the legacy size (their content never matters to the decoder).
    """
    start = 8 + meta_room
    pos = start
    placed = []
    for e in entries:
        e = dict(e)
        if "blob_off" not in e:
            pos = -(-pos // 8) * 8
            e["blob_off"] = pos
        e.setdefault("blob_len", LEGACY)
        pos = max(pos, e["blob_off"] + LEGACY) if isinstance(e["blob_off"], int) and e["blob_off"] < 1 << 20 \
            else pos
        placed.append(e)
    if meta is None:
        meta = json.dumps({"default_task": default_task, "masks": placed}).encode()
    assert len(meta) <= meta_room
    body = bytearray(struct.pack("<II", len(placed) if n_masks is None else n_masks, meta_room))
    body += meta + b" " * (meta_room - len(meta))
    body += b"\xff" * (pos - start + extra_tail)
    return bytes(body)


def mask_entry(task_id: int = 0, name: str = "general", **kw: Any) -> dict:
    e = {"task_id": task_id, "name": name, "description": None, "sparsity": 0.0, "quality": None,
         "parent": None, "priority": "Fallback", "has_hot_pack": False}
    e.update(kw)
    return e


def write_masks(tmp_path: Path, section: bytes, index: bytes | None = None) -> Path:
    return write_rich(tmp_path / "masks.cmf", masks=section, index=index, tensors=sample_tensors()[:2])


def test_hand_built_masks_section_is_valid(tmp_path: Path) -> None:
    path = write_masks(tmp_path, masks_section([mask_entry(), mask_entry(1, "coding", priority="Primary")]))
    with cmf.open(path) as f:
        assert f.masks is not None and f.masks.names() == ["general", "coding"]
        assert f.verify() == []


def expect_masks(tmp_path: Path, section: bytes, *needles: str) -> None:
    """Open a file carrying ``section`` as its masks section; assert ParseError naming the masks."""
    with pytest.raises(CmfError) as info:
        cmf.open(write_masks(tmp_path, section))
    assert type(info.value) is ParseError, f"{type(info.value).__name__}: {info.value}"
    for needle in ("masks",) + needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("meta", [b"{not json", b"", b"[]", b'"x"', b"\xff\xfe", b'{"masks": []}',
                                  b'{"default_task": "g", "masks": {}}', b'{"default_task": 5, "masks": []}'])
def test_masks_meta_not_json_or_wrong_shape(tmp_path: Path, meta: bytes) -> None:
    expect_masks(tmp_path, masks_section([], meta=meta, n_masks=0))


@pytest.mark.parametrize("key", ["task_id", "name", "sparsity", "priority", "blob_off", "blob_len"])
def test_masks_meta_missing_key(tmp_path: Path, key: str) -> None:
    section = masks_section([mask_entry()])
    meta = json.loads(section[8:8 + 1024])
    del meta["masks"][0][key]
    expect_masks(tmp_path, masks_section([], meta=json.dumps(meta).encode(), n_masks=1), key)


@pytest.mark.parametrize("priority", ["Bogus", "fallback", "", None, 1])
def test_masks_meta_bad_priority(tmp_path: Path, priority: Any) -> None:
    expect_masks(tmp_path, masks_section([mask_entry(priority=priority)]), "priority")


@pytest.mark.parametrize("field,value", [("task_id", -1), ("task_id", 2**32), ("task_id", "0"),
                                         ("sparsity", "high"), ("name", 3), ("has_hot_pack", 1),
                                         ("has_expert_fields", "yes"), ("quality", {"value": 1.0}),
                                         ("quality", 0.9), ("blob_off", -8), ("blob_len", 27.0)])
def test_masks_meta_bad_type(tmp_path: Path, field: str, value: Any) -> None:
    expect_masks(tmp_path, masks_section([mask_entry(**{field: value})]), field)


@pytest.mark.parametrize("blob_off", [2**20, 2**64 - 1, 0, 8])
def test_masks_blob_offset_out_of_bounds(tmp_path: Path, blob_off: int) -> None:
    expect_masks(tmp_path, masks_section([mask_entry(blob_off=blob_off)]), "blob")


@pytest.mark.parametrize("delta", [-1, 1, LEGACY])
def test_masks_wrong_blob_len(tmp_path: Path, delta: int) -> None:
    expect_masks(tmp_path, masks_section([mask_entry(blob_len=LEGACY + delta)], extra_tail=2 * LEGACY),
                 "blob_len")


def test_masks_blob_runs_past_section(tmp_path: Path) -> None:
    section = masks_section([mask_entry()])
    expect_masks(tmp_path, section[:-1], "blob")


def test_masks_blob_out_of_bounds_via_envelope(tmp_path: Path, patched: Patch) -> None:
    # Shrinking masks_len leaves the last mask's blob outside the section.
    patched.patch_envelope("masks_len", patched.env("masks_len") - 1)
    expect(tmp_path, patched, ParseError, "masks", "blob")


@pytest.mark.parametrize("n_masks", [0, 2, 2**32 - 1])
def test_masks_count_mismatch(tmp_path: Path, n_masks: int) -> None:
    expect_masks(tmp_path, masks_section([mask_entry()], n_masks=n_masks), "n_masks")


@pytest.mark.parametrize("section", [b"", b"\x00" * 7, struct.pack("<II", 0, 100), struct.pack("<II", 1, 2**32 - 1)])
def test_masks_prefix_truncated(tmp_path: Path, section: bytes) -> None:
    if not section:  # an empty masks section is "absent"; make it a 1-byte one instead
        section = b"\x00"
    expect_masks(tmp_path, section)


def test_masks_overlapping_blobs(tmp_path: Path) -> None:
    first = masks_section([mask_entry()])
    off = json.loads(first[8:8 + 1024])["masks"][0]["blob_off"]
    expect_masks(tmp_path, masks_section([mask_entry(), mask_entry(1, "coding", blob_off=off + 8)]), "overlap")


def test_masks_expert_fields_without_moe(tmp_path: Path) -> None:
    expect_masks(tmp_path, masks_section([mask_entry(has_expert_fields=True)]), "has_expert_fields")


# ----------------------------------------------------------------------------- sparse index


def valid_index() -> bytes:
    return build_sparse_index(sample_masks(), ARCH)


def test_sparse_index_valid_reference(tmp_path: Path) -> None:
    with cmf.open(write_masks(tmp_path, encode_masks(sample_masks(), ARCH), index=valid_index())) as f:
        assert f.sparse_index and f.verify() == []


def _bad_indexes() -> list[tuple[str, bytes]]:
    good = valid_index()
    n = struct.unpack_from("<I", good)[0]
    return [
        ("one_byte", b"\x00"),
        ("seven_bytes", good[:7]),
        ("reserved_nonzero", struct.pack("<II", n, 1) + good[8:]),
        ("count_too_big", struct.pack("<II", 2**32 - 1, 0) + good[8:]),
        ("count_plus_one", struct.pack("<II", n + 1, 0) + good[8:]),
        ("entry_truncated", good[:-1]),
        ("entry_header_truncated", good[:8 + 8]),
        ("n_groups_huge", good[:16] + struct.pack("<I", 2**32 - 1) + good[20:]),
        ("n_heads_huge", good[:20] + struct.pack("<I", 2**31) + good[24:]),
    ]


@pytest.mark.parametrize("index", [b for _, b in _bad_indexes()], ids=[k for k, _ in _bad_indexes()])
def test_bad_sparse_index(tmp_path: Path, index: bytes) -> None:
    with pytest.raises(CmfError) as info:
        cmf.open(write_masks(tmp_path, encode_masks(sample_masks(), ARCH), index=index))
    assert type(info.value) is ParseError and "sparse index" in str(info.value), repr(info.value)


# ----------------------------------------------------------------------------- lookups and paths


def test_missing_tensor(tmp_path: Path, patched: Patch) -> None:
    with opens(tmp_path, patched) as f:
        with pytest.raises(MissingTensor) as info:
            f.tensor("model.no_such.weight")
        assert isinstance(info.value, KeyError)
        assert "model.no_such.weight" in str(info.value)
        with pytest.raises(KeyError):
            f.array("model.no_such.weight")


def test_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFound) as info:
        cmf.open(tmp_path / "nope.cmf")
    assert isinstance(info.value, FileNotFoundError) and "nope.cmf" in str(info.value)


def test_directory_path_is_cmf_error(tmp_path: Path) -> None:
    with pytest.raises(CmfError):
        cmf.open(tmp_path)


# ----------------------------------------------------------------------------- shard sets


def write_shard(path: Path, no: int, count: int, names: list[str]) -> Path:
    """One shard file with ``names`` as small f32 tensors and the given shard block."""
    tensors = [(n, "f32", (4,), np.arange(4, dtype="<f4").tobytes()) for n in names]
    return write_rich(path, masks=None if no > 1 else "sample", index=None, vocab=None,
                      hdr=header(shard={"no": no, "count": count}), tensors=tensors)


def test_shard_set_opens(tmp_path: Path) -> None:
    a = write_shard(tmp_path / "m-00001-of-00002.cmf", 1, 2, ["a", "b"])
    b = write_shard(tmp_path / "m-00002-of-00002.cmf", 2, 2, ["c"])
    for p in (a, b):
        with cmf.open(p) as f:
            assert f.keys() == ["a", "b", "c"] and f.verify() == []


@pytest.mark.parametrize("which", [1, 2, 3])
def test_shard_missing_sibling(tmp_path: Path, which: int) -> None:
    paths = [write_shard(tmp_path / f"m-{no:05d}-of-00003.cmf", no, 3, [f"t{no}"]) for no in (1, 2, 3)]
    paths[which - 1].unlink()
    opener = paths[0] if which != 1 else paths[1]
    with pytest.raises(ShardError, match="missing"):
        cmf.open(opener)


def test_shard_count_mismatch(tmp_path: Path) -> None:
    a = write_shard(tmp_path / "m-00001-of-00002.cmf", 1, 2, ["a"])
    write_shard(tmp_path / "m-00002-of-00002.cmf", 2, 3, ["b"])  # header says 2 of 3
    with pytest.raises(ShardError, match="2 of 3"):
        cmf.open(a)


def test_shard_number_mismatch(tmp_path: Path) -> None:
    a = write_shard(tmp_path / "m-00001-of-00002.cmf", 1, 2, ["a"])
    write_shard(tmp_path / "m-00002-of-00002.cmf", 1, 2, ["b"])  # header says 1 of 2
    with pytest.raises(ShardError):
        cmf.open(a)


def test_shard_sibling_without_shard_block(tmp_path: Path) -> None:
    a = write_shard(tmp_path / "m-00001-of-00002.cmf", 1, 2, ["a"])
    write_rich(tmp_path / "m-00002-of-00002.cmf", masks=None, index=None, vocab=None,
               tensors=[("b", "f16", (2,), bytes(4))])
    with pytest.raises(ShardError, match="no shard block"):
        cmf.open(a)


def test_shard_block_without_shard_name_opens_alone(tmp_path: Path) -> None:
    """A `cortiq compact` of a set keeps the shard block in one file: no pattern, no siblings."""
    a = write_shard(tmp_path / "model.cmf", 1, 2, ["a"])
    with cmf.open(a) as f:
        assert f.keys() == ["a"] and f.paths == [a] and f.header.shard.count == 2


def test_shard_name_numbers_do_not_match_header(tmp_path: Path) -> None:
    a = write_shard(tmp_path / "m-00001-of-00003.cmf", 1, 2, ["a"])
    with pytest.raises(ShardError, match="1 of 3"):
        cmf.open(a)


def test_shard_duplicate_names_across_shards(tmp_path: Path) -> None:
    a = write_shard(tmp_path / "m-00001-of-00002.cmf", 1, 2, ["a", "shared.weight"])
    write_shard(tmp_path / "m-00002-of-00002.cmf", 2, 2, ["shared.weight", "c"])
    with pytest.raises(CmfError) as info:
        cmf.open(a)
    assert type(info.value) is ParseError and "shared.weight" in str(info.value)


def test_shard_sibling_malformed(tmp_path: Path) -> None:
    a = write_shard(tmp_path / "m-00001-of-00002.cmf", 1, 2, ["a"])
    b = write_shard(tmp_path / "m-00002-of-00002.cmf", 2, 2, ["b"])
    b.write_bytes(b"GGUF" + b.read_bytes()[4:])
    with pytest.raises(InvalidMagic):
        cmf.open(a)


def test_single_shard_opens_alone(tmp_path: Path) -> None:
    a = write_shard(tmp_path / "m-00001-of-00002.cmf", 1, 2, ["a"])
    with cmf.open(a, shards=False) as f:
        assert f.keys() == ["a"] and f.verify() == []


@pytest.mark.parametrize("types", [["FullAttention"], ["FullAttention"] * 3])
def test_header_layer_types_wrong_length(tmp_path: Path, patched: Patch, types: list[str]) -> None:
    h = patched.header_json()
    assert h["arch"]["num_layers"] == 2
    h["arch"]["layer_types"] = types
    expect(tmp_path, patched.rewrite_header(h), ParseError, "layer_types", f"lists {len(types)} entries",
           "num_layers is 2")


@pytest.mark.parametrize("depth", [constants.MAX_JSON_DEPTH, constants.MAX_JSON_DEPTH + 1, 1100])
def test_header_json_depth_bound(tmp_path: Path, patched: Patch, depth: int) -> None:
    # the header object itself is level 1; written by hand: json.dumps would recurse past its limit
    n = depth - 1
    raw = (json.dumps(patched.header_json())[:-1] + ',"x_nest":' + "[" * n + "0" + "]" * n + "}").encode()
    if depth <= constants.MAX_JSON_DEPTH:
        with opens(tmp_path, patched.rewrite_header(raw)) as f:
            assert "x_nest" in f.header.to_dict()
    else:
        expect(tmp_path, patched.rewrite_header(raw), ParseError, "header", "nested")
