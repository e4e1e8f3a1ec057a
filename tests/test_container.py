"""Round trips, exact layout, determinism, shards, append-only growth and compaction."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

import cmf
from cmf.format import errors
from cmf.format.constants import DATA_ALIGN, Dtype, Feature
from cmf.format.growth import append, compact
from cmf.format.hash64 import hash64
from cmf.format.writer import CmfWriter

from _builders import header, sample_masks, sample_tensors, write_sample

HASH_VECTORS = {
    b"": 0x0000000000000000,
    b"a": 0x247F1EAECB8BE39A,
    b"abcdefgh": 0x47DA24881D1E74A9,
    bytes(range(100)): 0x9679571211124E08,
    b"CMF": 0xB59AA39A074033EC,
    b"0123456789abcdef": 0x30D401310062EA9F,
    bytes(range(256)): 0x9955BB876C0706BF,
}

# sha256 of write_sample(masks, vocab): any change to the layout or header bytes is deliberate.
GOLDEN_SHA256 = "d0f66b51d07b2542a80282b036c61d9a6a1b74d19fd93d29ca283af0e3740205"


@pytest.mark.parametrize("data,expected", list(HASH_VECTORS.items()))
def test_hash64_published_vectors(data, expected):
    assert cmf.hash64(data) == expected
    assert cmf.hash64(memoryview(data)) == expected
    assert cmf.hash64(np.frombuffer(data, dtype=np.uint8)) == expected


def test_hash64_large_paths_agree(monkeypatch):
    """The numba chunked fold, the numpy fold and unaligned input give the same value."""
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, (1 << 20) + 13, dtype=np.uint8)
    fast = hash64(buf)
    unaligned = np.empty(buf.size + 1, dtype=np.uint8)[1:]
    unaligned[:] = buf
    assert hash64(unaligned) == fast
    monkeypatch.setenv("CMF_HASH_NUMPY", "1")
    assert hash64(buf) == fast
    # arrays hash their raw bytes
    arr = rng.standard_normal((33, 7)).astype(np.float32)
    assert hash64(arr) == hash64(arr.tobytes())


def test_round_trip_every_section(tmp_path):
    path = tmp_path / "m.cmf"
    write_sample(path, sparse_index=True)
    with cmf.open(path) as f:
        assert f.keys() == [t[0] for t in sample_tensors()]
        for name, dtype, shape, payload in sample_tensors():
            t = f.tensor(name)
            assert t.dtype == Dtype[dtype.upper()]
            assert t.shape == shape
            assert bytes(t.data) == payload
            assert t.hash == hash64(payload)
        assert f.header.to_dict()["provenance"]["unknown_key"] == [1, 2, {"x": None}]
        assert f.masks.names() == ["general", "coding"]
        assert f.masks.get("coding") == sample_masks().get("coding")
        assert f.sparse_index is not None and len(f.sparse_index) > 0
        assert f.tokenizer_json.startswith(b'{"version"')
        assert f.verify() == []
        assert f.features == Feature.TENSOR_DIR | Feature.BINARY_MASKS
        np.testing.assert_array_equal(f.array("model.embed_tokens.weight"),
                                      np.frombuffer(sample_tensors()[0][3], "<f4").reshape(128, 64))


def test_layout_matches_reference_rules(tmp_path):
    path = tmp_path / "m.cmf"
    write_sample(path, sparse_index=True)
    raw = path.read_bytes()
    assert raw[:4] == b"CMF\x01"
    version, flags, feats = struct.unpack_from("<III", raw, 4)
    assert (version, flags) == (2, 0)
    offs = struct.unpack_from("<12Q", raw, 0x10)
    header_off, header_len, dir_off, dir_len, data_off, data_len = offs[:6]
    masks_off, masks_len, vocab_off, vocab_len, index_off, index_len = offs[6:]
    assert header_off == 128 and dir_off == 128 + header_len
    assert data_off == -(-(dir_off + dir_len) // DATA_ALIGN) * DATA_ALIGN
    assert masks_off == data_off + data_len and vocab_off == masks_off + masks_len
    assert index_off == vocab_off + vocab_len and len(raw) == index_off + index_len
    hh, dh = struct.unpack_from("<QQ", raw, 0x70)
    assert hh == hash64(raw[header_off:header_off + header_len])
    assert dh == hash64(raw[dir_off:dir_off + dir_len])
    hdr = json.loads(raw[header_off:header_off + header_len])
    assert hdr["section_hashes"] == {
        "masks": f"{hash64(raw[masks_off:masks_off + masks_len]):016x}",
        "vocab": f"{hash64(raw[vocab_off:vocab_off + vocab_len]):016x}",
        "index": f"{hash64(raw[index_off:index_off + index_len]):016x}",
    }
    with cmf.open(path) as f:
        for t in f.tensors():
            rel = t.offset - data_off
            assert rel % 64 == 0
            if t.nbytes >= 16384:
                assert rel % 4096 == 0


def test_golden_bytes_and_determinism(tmp_path):
    a, b = tmp_path / "a.cmf", tmp_path / "b.cmf"
    write_sample(a)
    write_sample(b)
    assert a.read_bytes() == b.read_bytes()
    assert hashlib.sha256(a.read_bytes()).hexdigest() == GOLDEN_SHA256


def test_feature_bits(tmp_path):
    path = tmp_path / "q.cmf"
    q82f = np.zeros(8 * 32 + 2 * 8 + 2 * 32, np.uint8).tobytes()
    loop_arch = dict(header()["arch"], num_loops=2)
    with CmfWriter(path, header(arch=loop_arch, skills=[{"id": "s", "base_dir_hash": "00" * 8}])) as w:
        w.add("w", "q8_2f", (8, 32), q82f)
        w.set_masks(sample_masks())
    with cmf.open(path) as f:
        assert f.features == (Feature.TENSOR_DIR | Feature.BINARY_MASKS | Feature.LOOP_MASKS
                              | Feature.QUANT_2F | Feature.SKILL_FILE)
        assert not f.runnable
    # vbit_ro does NOT raise QUANT_2F (REFERENCE_NOTES §1.1)
    with CmfWriter(path, header()) as w:
        w.add(*sample_tensors()[5])
    with cmf.open(path) as f:
        assert f.features == Feature.TENSOR_DIR


def test_empty_model_and_no_sections(tmp_path):
    path = tmp_path / "e.cmf"
    CmfWriter(path, header()).finish()
    with cmf.open(path) as f:
        assert f.keys() == [] and f.masks is None and f.tokenizer_json is None
        assert "section_hashes" not in f.header.to_dict()
        assert f.verify() == []
        assert f.envelope.section("masks").off == 0


def test_writer_refuses_bad_input(tmp_path):
    path = tmp_path / "w.cmf"
    with CmfWriter(path, header()) as w:
        w.add("a", "f32", (2,), b"\0" * 8)
        with pytest.raises(errors.WriterError, match="duplicate"):
            w.add("a", "f32", (2,), b"\0" * 8)
        with pytest.raises(errors.WriterError, match="needs 12"):
            w.add("b", "f32", (3,), b"\0" * 8)
        with pytest.raises(errors.WriterError, match="hash"):
            w.add("c", "f32", (2,), b"\0" * 8, hash=1)
        with pytest.raises(errors.WriterError):
            w.add("d", "nope", (2,), b"\0" * 8)
        with pytest.raises(errors.WriterError, match="dimensions"):
            w.add("e", "f32", (1,) * 7, b"\0" * 4)
    with pytest.raises(errors.WriterError, match="finished"):
        w.add("late", "f32", (2,), b"\0" * 8)
    bad = header()
    del bad["arch"]
    with pytest.raises(errors.WriterError, match="arch"):
        CmfWriter(tmp_path / "x.cmf", bad).finish()
    assert not (tmp_path / "x.cmf").exists()


def test_writer_failure_keeps_existing_file(tmp_path, monkeypatch):
    path = tmp_path / "keep.cmf"
    path.write_bytes(b"precious")
    with pytest.raises(RuntimeError):
        with CmfWriter(path, header()) as w:
            w.add("a", "f32", (2,), b"\0" * 8)
            raise RuntimeError("boom")
    assert path.read_bytes() == b"precious"
    import cmf.format.writer as writer_mod

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(writer_mod.os, "replace", failing_replace)
    with pytest.raises(OSError):
        with CmfWriter(path, header()) as w:
            w.add("a", "f32", (2,), b"\0" * 8)
    assert path.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.cmf"]


def test_writer_killed_midway_leaves_target_untouched(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    target = tmp_path / "big.cmf"
    target.write_bytes(b"old")
    code = (
        "import numpy as np, time\n"
        "from cmf.format.writer import CmfWriter\n"
        "import sys; sys.path.insert(0, %r)\n"
        "from _builders import header\n"
        "w = CmfWriter(%r, header())\n"
        "block = np.zeros(1 << 20, np.uint8)\n"
        "i = 0\n"
        "while True:\n"
        "    w.add(f't{i}', 'f32', (1 << 18,), block); i += 1\n"
        "    if i == 4: print('ready', flush=True)\n"
        "    time.sleep(0.001)\n"
    ) % (str(__import__("pathlib").Path(__file__).parent), str(target))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert target.read_bytes() == b"old"


def test_shards_round_trip(tmp_path):
    outs = write_sample(tmp_path / "s.cmf", max_shard_bytes=30000, sparse_index=True)
    assert [p.name for p in outs] == [f"s-0000{i}-of-00003.cmf" for i in (1, 2, 3)]
    whole = tmp_path / "whole.cmf"
    write_sample(whole, sparse_index=True)
    for opened in outs:  # any shard name opens the set
        with cmf.open(opened) as f, cmf.open(whole) as g:
            assert f.keys() == g.keys()
            assert [bytes(f.tensor(n).data) for n in f.keys()] == [bytes(g.tensor(n).data) for n in g.keys()]
            assert f.masks.names() == g.masks.names()
            assert f.tokenizer_json == g.tokenizer_json
            assert f.verify() == []
            assert len(f.paths) == 3
    for i, p in enumerate(outs, start=1):  # every shard is a valid file on its own
        with cmf.open(p, shards=False) as f:
            assert f.verify() == []
            assert f.header.shard.no == i and f.header.shard.count == 3
            if i > 1:
                assert f.masks is None and f.tokenizer_json is None
                assert f.header.to_dict()["tokenizer_config"] is None
    # compact a shard set back to one file: identical tensors
    out = compact(outs[1], tmp_path / "c.cmf")
    with cmf.open(out) as f, cmf.open(whole) as g:
        assert f.header.shard is None
        assert [(t.name, t.hash) for t in f.tensors()] == [(t.name, t.hash) for t in g.tensors()]


def test_shard_errors(tmp_path):
    outs = write_sample(tmp_path / "s.cmf", max_shard_bytes=30000)
    outs[2].unlink()
    with pytest.raises(errors.ShardError, match="missing"):
        cmf.open(outs[0])
    renamed = tmp_path / "plain.cmf"
    outs[1].rename(renamed)
    with cmf.open(renamed) as f:  # a name without the shard pattern is not a set: the file alone
        assert f.header.shard.no == 2 and f.paths == [renamed] and f.verify() == []


def _state(path):
    with cmf.open(path) as f:
        return ([(t.name, t.hash, t.dtype, t.shape) for t in f.tensors()], f.header.to_dict(),
                f.masks.names() if f.masks else None, f.verify())


def test_append_adds_without_moving_bytes(tmp_path):
    path = tmp_path / "g.cmf"
    write_sample(path, sparse_index=True)
    before = path.read_bytes()
    payload = np.arange(64, dtype="<f2").tobytes()
    big = np.ones((64, 128), "<f4")
    append(path, [("skill.py.model.norm.weight", "f16", (64,), payload), ("extra", "f32", (64, 128), big)],
           {"skills": [{"id": "py", "layers": [0]}]})
    after = path.read_bytes()
    assert after[128:len(before)] == before[128:]  # nothing but the envelope changed in place
    tensors, hdr, masks, problems = _state(path)
    assert problems == []
    assert tensors[-2][0] == "skill.py.model.norm.weight"
    assert hdr["skills"] == [{"id": "py", "layers": [0]}]
    assert masks == ["general", "coding"]
    with cmf.open(path) as f:
        assert bytes(f.tensor("extra").data) == big.tobytes()
        assert (f.tensor("extra").offset - f.envelope.section("data").off) % 4096 == 0
        assert f.envelope.section("index").present  # unchanged sections keep their old bytes
    # replace an existing tensor and the masks
    new_masks = sample_masks()
    new_masks.masks = new_masks.masks[:1]
    append(path, [("model.norm.weight", "f16", (64,), payload)], masks=new_masks, replace=True)
    tensors, hdr, masks, problems = _state(path)
    assert problems == [] and masks == ["general"]
    with cmf.open(path) as f:
        assert bytes(f.tensor("model.norm.weight").data) == payload
        assert not f.envelope.section("index").present
    with pytest.raises(errors.WriterError, match="already exists"):
        append(path, [("extra", "f32", (1,), b"\0" * 4)])
    # compact drops dead bytes, keeps tensors byte-identical
    out = compact(path, tmp_path / "compact.cmf")
    assert out.stat().st_size < path.stat().st_size
    t1, h1, m1, p1 = _state(out)
    assert p1 == [] and t1 == tensors and m1 == masks


class _Crash(Exception):
    pass


def _crashing_ops(budget: int, log: list):
    """FileOps that write at most ``budget`` bytes in total, then 'crash' (partial last write)."""
    from cmf.format.growth import FileOps

    class Ops(FileOps):
        def pwrite(self, data, offset):
            data = bytes(data)
            log.append((offset, len(data)))
            left = budget - sum(n for _, n in log[:-1])
            if left < len(data):
                if left > 0:
                    super().pwrite(data[:left], offset)
                raise _Crash()
            super().pwrite(data, offset)

    return Ops


def _do_append(path, ops):
    append(path, [("skill.a.model.norm.weight", "f16", (64,), np.full(64, 2, "<f2").tobytes()),
                  ("big", "f32", (40, 128), np.ones((40, 128), "<f4"))],
           {"skills": [{"id": "a"}]}, masks=sample_masks(), ops_factory=ops)


def test_append_crash_consistency(tmp_path):
    """A crash after any number of written bytes leaves exactly the old or the new file."""
    orig = tmp_path / "orig.cmf"
    write_sample(orig)
    old_state = _state(orig)
    full = tmp_path / "full.cmf"
    full.write_bytes(orig.read_bytes())
    log: list = []
    _do_append(full, _crashing_ops(1 << 62, log))
    new_state = _state(full)
    assert new_state[3] == [] and new_state != old_state
    total = sum(n for _, n in log)
    env_start = total - 128  # the envelope is the last write
    assert log[-1] == (0, 128)
    rng = np.random.default_rng(7)
    boundaries = np.cumsum([0] + [n for _, n in log]).tolist()
    budgets = set(boundaries) | set(rng.integers(0, env_start, 60).tolist())
    budgets |= set(range(max(0, env_start - 40), env_start + 1))
    target = tmp_path / "t.cmf"
    for budget in sorted(budgets):
        target.write_bytes(orig.read_bytes())
        log2: list = []
        try:
            _do_append(target, _crashing_ops(budget, log2))
            crashed = False
        except _Crash:
            crashed = True
        state = _state(target)
        expect = new_state if (not crashed or budget >= total) else old_state
        assert state == expect, f"crash after {budget} of {total} bytes"


def test_torn_envelope_is_never_silently_wrong(tmp_path):
    """Even a (physically implausible) torn envelope write is either old, new, or detected."""
    orig = tmp_path / "orig.cmf"
    write_sample(orig)
    old_state = _state(orig)
    full = tmp_path / "full.cmf"
    full.write_bytes(orig.read_bytes())
    log: list = []
    _do_append(full, _crashing_ops(1 << 62, log))
    new_state = _state(full)
    total = sum(n for _, n in log)
    target = tmp_path / "t.cmf"
    for k in range(1, 128):
        target.write_bytes(orig.read_bytes())
        try:
            _do_append(target, _crashing_ops(total - 128 + k, []))
        except _Crash:
            pass
        try:
            state = _state(target)
        except errors.CmfError:
            continue  # detected at open
        assert state in (old_state, new_state) or state[3], f"torn at byte {k} went unnoticed"


def test_closed_file_raises_cmf_error(tmp_path):
    path = tmp_path / "c.cmf"
    write_sample(path)
    f = cmf.open(path)
    f.close()
    for call in (lambda: f.verify(), lambda: f.array("model.norm.weight"), lambda: f.tensor("model.norm.weight"),
                 lambda: f.tokenizer_json):
        with pytest.raises(errors.IoError, match="closed"):
            call()


def _write_direct(path, names, *, extra_header=None):
    with CmfWriter(path, header(), expected_names=names) as w:
        for name, dtype, shape, payload in sample_tensors():
            w.add(name, dtype, shape, payload)
        if extra_header:
            w.update_header(**extra_header)
        else:
            w.set_masks(sample_masks())
            w.set_vocab(b'{"version":"1.0","model":{"type":"BPE","vocab":{},"merges":[]}}')


def test_direct_mode_with_expected_names(tmp_path):
    """Names known up front: data is written in place (no copy); same content, data_off on 4096."""
    plain, direct, again = tmp_path / "plain.cmf", tmp_path / "direct.cmf", tmp_path / "again.cmf"
    write_sample(plain)
    names = [t[0] for t in sample_tensors()]
    _write_direct(direct, names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["direct.cmf", "plain.cmf"]
    assert _state(direct) == _state(plain)
    with cmf.open(direct) as f:
        assert f.envelope.section("data").off % DATA_ALIGN == 0
    _write_direct(again, names)  # deterministic too
    assert again.read_bytes() == direct.read_bytes()
    # a header that outgrows the reserve falls back to one copy, still correct
    big = tmp_path / "big.cmf"
    _write_direct(big, names[:1], extra_header={"provenance": {"blob": "x" * 20000}})
    with cmf.open(big) as f:
        assert f.verify() == [] and f.keys() == names


def test_add_array_accepts_converter_aliases(tmp_path):
    from cmf import quant

    a = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    with CmfWriter(tmp_path / "a.cmf", header()) as w:
        w.add_array("x", a, "q8")
        w.add_array("y", a, "q1p")
        w.add_array("z", a, "q4t")
    with cmf.open(tmp_path / "a.cmf") as f:
        assert [f.tensor(n).dtype for n in "xyz"] == [Dtype.Q8_ROW, Dtype.Q1, Dtype.Q4_TILED]
        assert bytes(f.tensor("y").data) == quant.encode(a, "q1p") != quant.encode(a, "q1")
