"""Masks section (spec §5, REFERENCE_NOTES §1.9): exact bytes, layouts, round trips, every error."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from cmf.format.errors import ParseError, WriterError
from cmf.format.header import Arch
from cmf.format.masks import MaskSet, TaskMask, decode_masks, encode_masks, mask_layout


def _arch(**kw) -> dict:
    a = {"arch_name": "t", "hidden_size": 8, "intermediate_size": 10, "num_layers": 2,
         "num_attention_heads": 3, "num_kv_heads": 1, "head_dim": 4, "vocab_size": 16,
         "layer_types": ["FullAttention"] * 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 64}
    a.update(kw)
    return a


MOE = {"num_experts": 10, "top_k": 2, "moe_intermediate_size": 8}


def _random_mask(rng, task_id, name, a: dict, *, rows=None, experts=False, **kw) -> TaskMask:
    L, I, H = a["num_layers"], a["intermediate_size"], a["num_attention_heads"]
    rows = rows or L * a.get("num_loops", 1)
    e = rng.random((L, a["moe"]["num_experts"])) < 0.5 if experts else None
    if e is not None:
        e[0, 0] = True  # never an all-empty expert area (that would mean "no restriction")
    return TaskMask(task_id=task_id, name=name, ffn=rng.random((rows, I)) < 0.5,
                    heads=rng.random((L, H)) < 0.5, gates=rng.random(L) < 0.7, experts=e,
                    sparsity=0.5, **kw)


def _meta(section: bytes) -> dict:
    meta_len = struct.unpack_from("<I", section, 4)[0]
    return json.loads(section[8:8 + meta_len])


def _section(meta: dict, blobs: dict[int, bytes], *, n_masks: int | None = None, size: int = 1024) -> bytes:
    """A hand-made section: prefix, meta, and blobs placed at absolute offsets."""
    m = json.dumps(meta, separators=(",", ":")).encode()
    buf = bytearray(size)
    buf[:8] = struct.pack("<II", len(meta["masks"]) if n_masks is None else n_masks, len(m))
    buf[8:8 + len(m)] = m
    for off, b in blobs.items():
        buf[off:off + len(b)] = b
    return bytes(buf)


def _entry(**kw) -> dict:
    e = {"task_id": 0, "name": "g", "sparsity": 0.5, "priority": "Fallback", "blob_off": 512, "blob_len": 7}
    e.update(kw)
    return e


def _ok_meta(**kw) -> dict:
    return {"default_task": "g", "masks": [_entry(**kw)]}


# ----------------------------------------------------------------------------- exact bytes


def test_exact_bytes_of_a_small_section():
    # arch: 2 layers, intermediate 10 (2 bytes/row), 3 heads (1 byte/row), gates 1 byte: blob = 7 bytes.
    g = TaskMask(task_id=0, name="g", sparsity=0.5,
                 ffn=np.array([[1, 0, 0, 0, 0, 0, 0, 0, 0, 1], [1] * 10], bool),
                 heads=np.array([[1, 0, 1], [0, 1, 0]], bool), gates=np.array([1, 0], bool))
    h = TaskMask(task_id=1, name="h", sparsity=0.25, description="d", parent="g",
                 ffn=np.array([[0] * 10, [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]], bool),
                 heads=np.array([[1, 1, 1], [0, 0, 0]], bool), gates=np.array([0, 1], bool))
    got = encode_masks(MaskSet(masks=[g, h]), _arch())
    meta = (b'{"default_task":"g","masks":['
            b'{"task_id":0,"name":"g","description":null,"sparsity":0.5,"quality":null,"parent":null,'
            b'"priority":"Fallback","has_hot_pack":false,"blob_off":360,"blob_len":7},'
            b'{"task_id":1,"name":"h","description":"d","sparsity":0.25,"quality":null,"parent":"g",'
            b'"priority":"Normal","has_hot_pack":false,"blob_off":368,"blob_len":7}]}')
    assert len(meta) == 345  # so blobs start at align8(8 + 345) = 360
    blob_g = bytes([0x01, 0x02, 0xFF, 0x03, 0x05, 0x02, 0x01])  # tail bits of 10-bit rows are zero
    blob_h = bytes([0x00, 0x00, 0x08, 0x00, 0x07, 0x00, 0x02])
    want = struct.pack("<II", 2, 345) + meta + bytes(7) + blob_g + bytes(1) + blob_h
    assert got == want
    assert decode_masks(got, _arch(), loop_masks=False) == MaskSet(default_task="g", masks=[
        TaskMask(**{**g.__dict__, "priority": "Fallback"}), TaskMask(**{**h.__dict__, "priority": "Normal"})])


def test_layout_sizes():
    lay = mask_layout(_arch(num_loops=3, moe=MOE))
    assert lay == {"ffn_bytes": 2, "head_bytes": 1, "gates_bytes": 1, "expert_bytes": 2,
                   "legacy": 7, "per_visit": 15, "experts_area": 4}


def test_empty_maskset():
    sec = encode_masks(MaskSet(), _arch())
    assert _meta(sec) == {"default_task": "general", "masks": []}
    assert decode_masks(sec, _arch(), loop_masks=False) == MaskSet(default_task="general")


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("arch_kw", [{}, {"intermediate_size": 64, "num_attention_heads": 16},
                                     {"num_layers": 9, "layer_types": ["FullAttention"] * 9},
                                     {"intermediate_size": 1, "num_attention_heads": 1}])
def test_round_trip(arch_kw):
    a = _arch(**arch_kw)
    rng = np.random.default_rng(0)
    ms = MaskSet(default_task="b", masks=[
        _random_mask(rng, 0, "a", a, priority="Primary", quality={"metric": "ppl", "value": 1.5}),
        _random_mask(rng, 7, "b", a, priority="Normal", description="x", parent="a", has_hot_pack=True)])
    sec = encode_masks(ms, a)
    assert encode_masks(ms, a) == sec  # deterministic
    assert decode_masks(sec, a, loop_masks=False) == ms
    assert decode_masks(memoryview(sec), Arch.from_dict(a), loop_masks=True) == ms


def test_blob_offsets_are_exact_across_meta_length_digit_boundaries():
    # Names from 0 to 120 chars move the meta length across 2/3-digit offsets: the fixed-point
    # iteration must always land every blob exactly where its meta says, 8-aligned.
    a = _arch()
    rng = np.random.default_rng(1)
    for n in range(0, 121, 3):
        ms = MaskSet(masks=[_random_mask(rng, 0, "x" * n, a), _random_mask(rng, 1, "y", a)])
        sec = encode_masks(ms, a)
        meta_len = struct.unpack_from("<I", sec, 4)[0]
        offs = [m["blob_off"] for m in _meta(sec)["masks"]]
        assert offs[0] == -(-(8 + meta_len) // 8) * 8 and all(o % 8 == 0 for o in offs)
        assert len(sec) == offs[-1] + 7
        assert decode_masks(sec, a, loop_masks=False).masks == [
            TaskMask(**{**m.__dict__, "priority": ("Fallback", "Normal")[i]}) for i, m in enumerate(ms.masks)]


def test_defaults_priority_sparsity_default_task():
    a = _arch()
    m0 = TaskMask(task_id=0, name="first", ffn=np.zeros((2, 10), bool), heads=np.ones((2, 3), bool),
                  gates=np.ones(2, bool))
    m3 = TaskMask(task_id=3, name="other", ffn=np.ones((2, 10), bool), heads=np.ones((2, 3), bool),
                  gates=np.ones(2, bool))
    meta = _meta(encode_masks(MaskSet(masks=[m0, m3]), a))
    assert meta["default_task"] == "first"
    assert [m["priority"] for m in meta["masks"]] == ["Fallback", "Normal"]
    assert [m["sparsity"] for m in meta["masks"]] == [1.0, 0.0]
    assert all("has_expert_fields" not in m for m in meta["masks"])


def test_extra_meta_keys_round_trip():
    a = _arch()
    rng = np.random.default_rng(2)
    m = _random_mask(rng, 0, "a", a, extra={"future": {"k": [1, 2]}, "blob_off": 999})
    ms = MaskSet(default_task="a", masks=[m], extra={"version": 3})
    sec = encode_masks(ms, a)
    meta = _meta(sec)
    assert meta["version"] == 3 and meta["masks"][0]["future"] == {"k": [1, 2]}
    assert meta["masks"][0]["blob_off"] != 999  # codec-owned keys are never taken from extra
    out = decode_masks(sec, a, loop_masks=False)
    assert out.extra == {"version": 3} and out.masks[0].extra == {"future": {"k": [1, 2]}}


def test_maskset_accessors():
    a = _arch()
    rng = np.random.default_rng(3)
    ms = decode_masks(encode_masks(MaskSet(masks=[_random_mask(rng, 0, "a", a),
                                                  _random_mask(rng, 1, "b", a)]), a), a, loop_masks=False)
    assert ms.names() == ["a", "b"] and len(ms) == 2 and [m.name for m in ms] == ["a", "b"]
    assert ms.get("b").task_id == 1 and ms.get("zz") is None
    m = ms.get("a")
    assert m.ffn.dtype == bool and m.ffn.shape == (2, 10) and m.heads.shape == (2, 3) and m.gates.shape == (2,)
    assert m.layer_alive(0) == bool(m.gates[0]) and m.layer_alive(99) is True


# ----------------------------------------------------------------------------- LOOP_MASKS


def test_loop_masks_per_visit_rows():
    a = _arch(num_loops=2)
    rng = np.random.default_rng(4)
    ms = MaskSet(default_task="a", masks=[_random_mask(rng, 0, "a", a, priority="Fallback")])
    assert ms.masks[0].ffn.shape == (4, 10)
    sec = encode_masks(ms, a)
    assert _meta(sec)["masks"][0]["blob_len"] == 4 * 2 + 2 * 1 + 1
    assert decode_masks(sec, a, loop_masks=True) == ms
    with pytest.raises(ParseError, match="LOOP_MASKS"):
        decode_masks(sec, a, loop_masks=False)


def test_legacy_mask_on_looped_arch_is_replicated_pass_major():
    a1, a2 = _arch(), _arch(num_loops=3)
    rng = np.random.default_rng(5)
    m = _random_mask(rng, 0, "a", a1, priority="Fallback")
    legacy = encode_masks(MaskSet(masks=[m]), a1)  # 2 FFN rows: the legacy blob size
    got = decode_masks(legacy, a2, loop_masks=False).masks[0]
    assert got.ffn.shape == (6, 10)
    assert np.array_equal(got.ffn, np.concatenate([m.ffn] * 3))
    assert np.array_equal(got.heads, m.heads) and np.array_equal(got.gates, m.gates)
    # The writer replicates a per-layer FFN array the same way, emitting per-visit rows.
    sec = encode_masks(MaskSet(masks=[m]), a2)
    assert _meta(sec)["masks"][0]["blob_len"] == 6 * 2 + 3
    assert decode_masks(sec, a2, loop_masks=True).masks[0] == got


def test_legacy_replication_is_bounded():
    a = _arch()
    legacy = encode_masks(MaskSet(masks=[_random_mask(np.random.default_rng(6), 0, "a", a)]), a)
    with pytest.raises(ParseError, match="replicate"):
        decode_masks(legacy, _arch(num_loops=10**9), loop_masks=True)


# ----------------------------------------------------------------------------- experts


def test_expert_fields_round_trip_and_empty_row_means_all():
    a = _arch(moe=MOE)
    rng = np.random.default_rng(7)
    with_e = _random_mask(rng, 0, "e", a, experts=True, priority="Fallback")
    with_e.experts[1] = False  # an empty row in a mask that has rows elsewhere
    without = _random_mask(rng, 1, "n", a, priority="Normal")
    sec = encode_masks(MaskSet(masks=[with_e, without]), a)
    meta = _meta(sec)["masks"]
    assert meta[0]["has_expert_fields"] is True and meta[0]["blob_len"] == 7 + 2 * 2
    assert "has_expert_fields" not in meta[1] and meta[1]["blob_len"] == 7
    e_row1 = sec[meta[0]["blob_off"] + 7 + 2: meta[0]["blob_off"] + 11]
    assert e_row1 == bytes([0xFF, 0x03])  # all-ones, tail bits beyond 10 experts zero
    out = decode_masks(sec, a, loop_masks=False)
    assert np.array_equal(out.masks[0].experts[0], with_e.experts[0])
    assert out.masks[0].experts[1].all() and out.masks[1].experts is None


def test_all_empty_experts_writes_no_area():
    a = _arch(moe=MOE)
    m = _random_mask(np.random.default_rng(8), 0, "e", a)
    m.experts = np.zeros((2, 10), bool)
    sec = encode_masks(MaskSet(masks=[m]), a)
    assert "has_expert_fields" not in _meta(sec)["masks"][0]
    assert decode_masks(sec, a, loop_masks=False).masks[0].experts is None


def test_experts_with_loop_masks():
    a = _arch(moe=MOE, num_loops=2)
    ms = MaskSet(default_task="e",
                 masks=[_random_mask(np.random.default_rng(9), 0, "e", a, experts=True, priority="Normal")])
    sec = encode_masks(ms, a)
    assert _meta(sec)["masks"][0]["blob_len"] == 4 * 2 + 2 + 1 + 2 * 2
    assert decode_masks(sec, a, loop_masks=True) == ms


def test_expert_fields_on_non_moe_arch():
    sec = _section(_ok_meta(has_expert_fields=True, blob_len=11), {})
    with pytest.raises(ParseError, match="without a MoE block"):
        decode_masks(sec, _arch(), loop_masks=False)
    m = _random_mask(np.random.default_rng(10), 0, "e", _arch(moe=MOE), experts=True)
    with pytest.raises(WriterError, match="no MoE block"):
        encode_masks(MaskSet(masks=[m]), _arch())


# ----------------------------------------------------------------------------- ParseError cases


def test_valid_hand_made_section_decodes():
    got = decode_masks(_section(_ok_meta(), {512: bytes([1, 0, 0, 0, 7, 7, 3])}), _arch(), loop_masks=False)
    m = got.masks[0]
    assert m.ffn[0, 0] and m.ffn.sum() == 1 and m.heads.all() and m.gates.all()


@pytest.mark.parametrize("buf, match", [
    (b"", "shorter than its 8-byte prefix"),
    (b"\x00" * 7, "shorter than its 8-byte prefix"),
    (struct.pack("<II", 0, 1), "meta_len 1 runs past"),
    (struct.pack("<II", 0, 0xFFFFFFFF) + b"{}", "runs past"),
    (struct.pack("<II", 0, 4) + b"{no}", "not valid JSON"),
    (struct.pack("<II", 0, 2) + b"\xff\xfe", "UTF-8"),
    (struct.pack("<II", 0, 2) + b"[]", "must be an object"),
    (struct.pack("<II", 0, 12) + b'{"masks":[]}', "default_task"),
    (struct.pack("<II", 0, 20) + b'{"default_task":"g"}', "'masks' must be an array"),
    (struct.pack("<II", 0xFFFFFFFF, 31) + b'{"default_task":"g","masks":[]}', "n_masks 4294967295"),
])
def test_malformed_prefix_and_meta(buf, match):
    with pytest.raises(ParseError, match=match):
        decode_masks(buf, _arch(), loop_masks=False)


@pytest.mark.parametrize("key", ["task_id", "name", "sparsity", "priority", "blob_off", "blob_len"])
def test_missing_required_meta_key(key):
    meta = _ok_meta()
    del meta["masks"][0][key]
    with pytest.raises(ParseError, match=f"missing required key '{key}'"):
        decode_masks(_section(meta, {}), _arch(), loop_masks=False)


@pytest.mark.parametrize("patch, match", [
    ({"priority": "High"}, "priority 'High' is not one of Fallback, Normal, Primary"),
    ({"priority": ["Normal"]}, "priority"),
    ({"task_id": -1}, "task_id must be a u32"),
    ({"task_id": "0"}, "task_id must be a u32"),
    ({"name": 5}, r"masks\[0\].name must be a string"),
    ({"sparsity": None}, "sparsity must be a number"),
    ({"blob_off": -8}, "blob_off must be a u64"),
    ({"blob_len": 1.5}, "blob_len must be a u64"),
    ({"has_hot_pack": None}, "has_hot_pack must be a boolean"),
    ({"description": 3}, "description must be a string or null"),
    ({"quality": {"value": 1.0}}, "quality.metric"),
    ({"quality": {"metric": "ppl"}}, "quality.value"),
    ({"quality": {"metric": "ppl", "value": 1, "n_samples": -1}}, "quality.n_samples"),
    ({"quality": 0.97}, "quality must be an object or null"),
    ({"blob_len": 8}, "blob_len 8 matches no layout"),
    ({"blob_len": 0}, "blob_len 0 matches no layout"),
    ({"blob_off": 1020}, "outside the blob area"),
    ({"blob_off": 2**64 - 1}, "outside the blob area"),
    ({"blob_off": 8}, "outside the blob area"),  # inside the meta itself
])
def test_bad_meta_entry(patch, match):
    with pytest.raises(ParseError, match=match):
        decode_masks(_section(_ok_meta(**patch), {}), _arch(), loop_masks=False)


def test_count_mismatch_and_non_object_entry():
    with pytest.raises(ParseError, match="n_masks 2 but the meta lists 1"):
        decode_masks(_section(_ok_meta(), {}, n_masks=2), _arch(), loop_masks=False)
    with pytest.raises(ParseError, match=r"masks\[0\] must be an object"):
        decode_masks(_section({"default_task": "g", "masks": [3]}, {}), _arch(), loop_masks=False)


def test_overlapping_blobs_are_refused():
    meta = {"default_task": "g", "masks": [_entry(), _entry(task_id=1, name="h", blob_off=516)]}
    with pytest.raises(ParseError, match="overlaps"):
        decode_masks(_section(meta, {}), _arch(), loop_masks=False)
    meta["masks"][1]["blob_off"] = 519  # adjacent, unaligned: allowed (the reference reader is lenient)
    assert decode_masks(_section(meta, {}), _arch(), loop_masks=False).names() == ["g", "h"]


def test_truncated_real_section():
    a = _arch()
    sec = encode_masks(MaskSet(masks=[_random_mask(np.random.default_rng(11), 0, "a", a)]), a)
    for cut in (len(sec) - 1, 9, 4):
        with pytest.raises(ParseError):
            decode_masks(sec[:cut], a, loop_masks=False)


def test_arch_dict_is_validated():
    with pytest.raises(ParseError):
        decode_masks(encode_masks(MaskSet(), _arch()), {"num_layers": 2}, loop_masks=False)


# ----------------------------------------------------------------------------- WriterError cases


@pytest.mark.parametrize("patch, match", [
    ({"ffn": np.zeros((3, 10), bool)}, "ffn has shape"),
    ({"ffn": np.zeros((2, 9), bool)}, "ffn: shape"),
    ({"heads": np.zeros((2, 4), bool)}, "heads: shape"),
    ({"gates": np.zeros(3, bool)}, "gates: shape"),
    ({"priority": "High"}, "priority"),
    ({"task_id": -1}, "task_id"),
    ({"quality": {"value": 1.0}}, "metric"),
    ({"sparsity": float("nan")}, "cannot be serialized"),
    ({"extra": {"x": object()}}, "cannot be serialized"),
])
def test_encode_refuses_bad_masks(patch, match):
    a = _arch()
    m = _random_mask(np.random.default_rng(12), 0, "a", a)
    for k, v in patch.items():
        setattr(m, k, v)
    with pytest.raises(WriterError, match=match):
        encode_masks(MaskSet(masks=[m]), a)
