"""Sparse index (spec §7, REFERENCE_NOTES §1.10): exact bytes, round trip, every ParseError case."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from cmf.format.errors import ParseError, WriterError
from cmf.format.masks import MaskSet, TaskMask, decode_masks, encode_masks
from cmf.format.sparse_index import (
    SparseIndexEntry, build_sparse_index, decode_sparse_index, encode_sparse_index, index_entries,
)


def _arch(**kw) -> dict:
    a = {"arch_name": "t", "hidden_size": 8, "intermediate_size": 40, "num_layers": 2,
         "num_attention_heads": 3, "num_kv_heads": 1, "head_dim": 4, "vocab_size": 16,
         "layer_types": ["FullAttention"] * 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 64}
    a.update(kw)
    return a


def _bits(n: int, on: list[int]) -> np.ndarray:
    b = np.zeros(n, bool)
    b[on] = True
    return b


def _maskset() -> MaskSet:
    # intermediate 40 = groups [0..31] and [32..39]; 3 heads.
    a = TaskMask(task_id=0, name="a", ffn=np.stack([_bits(40, [33]), _bits(40, [0])]),
                 heads=np.array([[1, 0, 1], [1, 1, 1]], bool), gates=np.array([1, 0], bool))
    b = TaskMask(task_id=5, name="b", ffn=np.stack([_bits(40, []), _bits(40, [0, 39])]),
                 heads=np.array([[0, 0, 0], [0, 1, 0]], bool), gates=np.array([1, 1], bool))
    return MaskSet(masks=[a, b])


def test_exact_bytes():
    want = struct.pack("<II", 3, 0)
    # mask a, layer 0 (layer 1 is gated off): group 1 (bit 33), heads 0 and 2. 16 + 2 + 2 = 20, no pad.
    want += struct.pack("<4I", 0, 0, 1, 2) + struct.pack("<H", 1) + bytes([0, 2])
    # mask b, layer 0: nothing active.
    want += struct.pack("<4I", 5, 0, 0, 0)
    # mask b, layer 1: groups 0 and 1, head 1. 16 + 4 + 1 = 21, padded to 24.
    want += struct.pack("<4I", 5, 1, 2, 1) + struct.pack("<2H", 0, 1) + bytes([1]) + bytes(3)
    got = build_sparse_index(_maskset(), _arch())
    assert got == want and len(got) % 4 == 0


def test_round_trip_and_entries():
    entries = index_entries(_maskset(), _arch())
    assert [(e.task_id, e.layer) for e in entries] == [(0, 0), (5, 0), (5, 1)]
    assert entries[2].groups.dtype == np.uint16 and entries[2].heads.dtype == np.uint8
    sec = build_sparse_index(_maskset(), _arch())
    assert decode_sparse_index(sec) == entries
    assert decode_sparse_index(memoryview(sec)) == entries
    assert encode_sparse_index(decode_sparse_index(sec)) == sec


def test_built_from_decoded_masks_of_a_looped_model():
    # Loop-mask files index the first pass's rows (physical layers), like the reference writer.
    a = _arch(num_loops=2, intermediate_size=64)
    rng = np.random.default_rng(0)
    m = TaskMask(task_id=1, name="x", ffn=rng.random((4, 64)) < 0.02, heads=np.ones((2, 3), bool),
                 gates=np.ones(2, bool))
    ms = decode_masks(encode_masks(MaskSet(masks=[m]), a), a, loop_masks=True)
    got = index_entries(ms, a)
    for layer, e in enumerate(got):
        want = np.flatnonzero(m.ffn[layer].reshape(2, 32).any(axis=1))
        assert np.array_equal(e.groups, want)


def test_empty():
    assert build_sparse_index(MaskSet(), _arch()) == struct.pack("<II", 0, 0)
    assert decode_sparse_index(struct.pack("<II", 0, 0)) == []


@pytest.mark.parametrize("buf, match", [
    (b"", "shorter than its 8-byte prefix"),
    (b"\x00" * 7, "shorter than its 8-byte prefix"),
    (struct.pack("<II", 0, 1), "reserved field is 1"),
    (struct.pack("<II", 0xFFFFFFFF, 0), "cannot fit"),
    (struct.pack("<II", 2, 0) + struct.pack("<4I", 0, 0, 8, 0) + bytes(16), "entry 1 header .* truncated"),
    (struct.pack("<II", 1, 0) + struct.pack("<4I", 0, 0, 0xFFFFFFFF, 0), "runs past the section"),
    (struct.pack("<II", 1, 0) + struct.pack("<4I", 0, 0, 0, 0xFFFFFFFF), "runs past the section"),
    (struct.pack("<II", 1, 0) + struct.pack("<4I", 0, 0, 1, 0), "runs past the section"),
    # the last entry's padding is missing: 16 + 2 + 1 = 19 bytes, 20 required
    (struct.pack("<II", 1, 0) + struct.pack("<4I", 0, 0, 1, 1) + b"\x00\x00\x00", "runs past"),
])
def test_malformed(buf, match):
    with pytest.raises(ParseError, match=match):
        decode_sparse_index(buf)


def test_every_truncation_of_a_valid_section_is_refused():
    sec = build_sparse_index(_maskset(), _arch())
    for cut in range(len(sec)):
        with pytest.raises(ParseError):
            decode_sparse_index(sec[:cut])


def test_trailing_bytes_are_ignored():
    sec = build_sparse_index(_maskset(), _arch())
    assert decode_sparse_index(sec + bytes(4)) == decode_sparse_index(sec)


def test_writer_refuses_values_that_do_not_fit():
    with pytest.raises(WriterError, match="u16"):
        encode_sparse_index([SparseIndexEntry(0, 0, np.array([70000]), np.array([], np.uint8))])
    with pytest.raises(WriterError, match="u8"):
        encode_sparse_index([SparseIndexEntry(0, 0, np.array([], np.uint16), np.array([300]))])
    with pytest.raises(WriterError, match="exceed"):
        build_sparse_index(MaskSet(), _arch(num_attention_heads=300))
