"""Property test: whatever the bytes, only a CmfError escapes open()+verify(), and quickly.

Hypothesis mutates valid files (bit flips, byte writes, truncation, splices, insertions and
deletions, and targeted rewrites of envelope offsets/lengths, the directory prefix, directory
record fields and integers inside tensor payloads, using boundary values such as 0, 2**63 and
2**64 - 1, and header JSON keys set to odd values). Each mutated file is written to tmp_path, opened, verified and walked.
"""

from __future__ import annotations

import itertools
import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cmf
from cmf.format.directory import RECORD_DTYPE, decode_directory
from cmf.format.errors import CmfError
from cmf.format.writer import CmfWriter

from _builders import header, sample_masks, vbit_payload, write_sample

TIME_LIMIT_S = 1.0
U64 = 2**64 - 1

# Envelope: (offset, width) of the u32 fields at 0x04..0x0C and the 14 u64 fields at 0x10..0x80.
ENV_FIELDS = [(0x04, 4), (0x08, 4), (0x0C, 4)] + [(0x10 + 8 * i, 8) for i in range(14)]
# Directory record fields: (offset within the 56-byte record, width); shape expands to 6 u32.
REC_FIELDS = [(off, dt.base.itemsize) for name, (dt, off) in RECORD_DTYPE.fields.items() if name != "shape"]
REC_FIELDS += [(8 + 4 * k, 4) for k in range(6)]


def variable_tensors() -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """Small tensors of the dtypes whose payloads the reader validates internally."""
    q1s = bytes(6 * 4) + struct.pack("<I", 2) + struct.pack("<I", 3) + b"\x00\x3c" + struct.pack("<I", 100) + b"\x00\xbc"
    q1t = bytes(9 * 4) + np.array([0, 1, 1, 3, 3], "<u4").tobytes() + b"\x01\x00\x00\x3c\x1f\x00\x00\xbc\x02\x00\x00\x40"
    return [
        ("v.vbit", "vbit", (2, 64), vbit_payload(2, 64, [3, 6], seed=1)),
        ("v.vbit_ro", "vbit_ro", (3, 32), vbit_payload(3, 32, [8, 4, 5], seed=2, ro=True)),
        ("v.q1s", "q1s", (4, 32), q1s),
        ("v.q1t", "q1t", (4, 32), q1t),
        ("v.q4tp", "q4tp", (2, 64), bytes(2 * 2 * 16 + 2 * 4 + 2 * 2)),
        ("v.u8", "u8", (5,), b"abcde"),
        ("v.norm", "f16", (8,), np.ones(8, "<f2").tobytes()),
    ]


@dataclass(frozen=True)
class Base:
    """A valid file and the layout facts the targeted mutations need."""

    data: bytes
    dir_off: int
    count: int
    payloads: tuple[tuple[int, int], ...]  # absolute (off, len) of each tensor


def describe(data: bytes) -> Base:
    secs = struct.unpack_from("<12Q", data, 0x10)
    dir_off, dir_len, data_off = secs[2], secs[3], secs[4]
    rec, _ = decode_directory(data[dir_off:dir_off + dir_len])
    spans = tuple((data_off + int(r["off"]), int(r["nbytes"])) for r in rec)
    return Base(data=data, dir_off=dir_off, count=len(rec), payloads=spans)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> list[Base]:
    """Three valid files: the shared sample with all sections, variable dtypes, a bare minimum."""
    d = tmp_path_factory.mktemp("fuzz-bases")
    a = write_sample(d / "sample.cmf", sparse_index=True)[0]
    b = d / "variable.cmf"
    with CmfWriter(b, header(quant_type="VBIT")) as w:
        for t in variable_tensors():
            w.add(*t)
        w.set_masks(sample_masks())
    c = d / "minimal.cmf"
    with CmfWriter(c, {"version": 2, "arch": header()["arch"], "quant_type": "F32"}) as w:
        w.add("x", "f32", (2,), np.ones(2, "<f4").tobytes())
    out = []
    for p in (a, b, c):
        with cmf.open(p) as f:
            assert f.verify() == []
        out.append(describe(p.read_bytes()))
    return out


# ----------------------------------------------------------------------------- mutations

BOUNDARY = [0, 1, 2, 7, 8, 63, 64, 65, 4095, 4096, 2**16 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1,
            2**63, U64 - 63, U64 - 1, U64]
values = st.one_of(st.sampled_from(BOUNDARY), st.sampled_from(["size-1", "size", "size+1"]),
                   st.integers(0, U64))
positions = st.integers(0, 2**20)
HEADER_KEYS = ["version", "quant_type", "arch", "shard", "section_hashes", "skills", "tokenizer_config",
               "arch.hidden_size", "arch.intermediate_size", "arch.num_layers", "arch.num_attention_heads",
               "arch.layer_types", "arch.num_loops", "arch.moe", "arch.rms_norm_eps"]
HEADER_VALUES: list[Any] = [None, 0, 1, -1, 3, 2**32, 2**64, 1e308, "x", [], {}, True, ["FullAttention"],
                            {"no": 1, "count": 2}, {"masks": "zz", "vocab": "0"},
                            {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32}]

mutation = st.one_of(
    st.tuples(st.just("flip"), positions, st.integers(0, 7)),
    st.tuples(st.just("byte"), positions, st.integers(0, 255)),
    st.tuples(st.just("truncate"), positions),
    st.tuples(st.just("splice"), positions, positions, st.integers(1, 600)),
    st.tuples(st.just("insert"), positions, st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("delete"), positions, st.integers(1, 600)),
    st.tuples(st.just("env"), st.integers(0, len(ENV_FIELDS) - 1), values),
    st.tuples(st.just("dirprefix"), st.integers(0, 1), values),
    st.tuples(st.just("record"), st.integers(0, 31), st.integers(0, len(REC_FIELDS) - 1), values),
    st.tuples(st.just("payload"), st.integers(0, 31), positions, st.sampled_from([1, 2, 4, 8]), values),
    st.tuples(st.just("header"), st.sampled_from(HEADER_KEYS), st.sampled_from(HEADER_VALUES)),
)


def rewrite_header(buf: bytearray, key: str, value: Any) -> None:
    """Set a header key (``arch.<k>`` for arch keys; None may delete) and re-lay the head in place.

    The directory moves right after the new JSON; a no-op when the envelope no longer points at
    a parsable header or the new head would not fit before data_off.
    """
    if len(buf) < 128:
        return
    h_off, h_len, d_off, d_len, data_off = struct.unpack_from("<5Q", buf, 0x10)
    try:
        hdr = json.loads(bytes(buf[h_off:h_off + h_len]))
    except (ValueError, RecursionError):
        return
    target = hdr.get("arch") if key.startswith("arch.") and isinstance(hdr, dict) else hdr
    key = key.removeprefix("arch.")
    if not isinstance(target, dict):
        return
    if value is None and key in target:
        del target[key]
    else:
        target[key] = value
    raw = json.dumps(hdr).encode()
    directory = bytes(buf[d_off:d_off + d_len])
    end = h_off + len(raw) + len(directory)
    if len(directory) != d_len or end > data_off or data_off > len(buf):
        return
    buf[h_off:end] = raw + directory
    buf[end:data_off] = bytes(data_off - end)
    struct.pack_into("<QQ", buf, 0x18, len(raw), h_off + len(raw))


def put_int(buf: bytearray, pos: int, width: int, value: Any) -> None:
    """Write ``value`` (an int or a size-relative token) as a little-endian int of ``width`` bytes."""
    if isinstance(value, str):
        value = {"size-1": len(buf) - 1, "size": len(buf), "size+1": len(buf) + 1}[value]
    value &= (1 << (8 * width)) - 1
    if 0 <= pos and pos + width <= len(buf):
        buf[pos:pos + width] = value.to_bytes(width, "little")


def apply(base: Base, muts: list[tuple]) -> bytes:
    """Apply mutations in order; targeted ones use the base file's layout."""
    buf = bytearray(base.data)
    for m in muts:
        kind, n = m[0], max(len(buf), 1)
        if kind == "flip":
            if buf:
                buf[m[1] % n] ^= 1 << m[2]
        elif kind == "byte":
            if buf:
                buf[m[1] % n] = m[2]
        elif kind == "truncate":
            del buf[m[1] % (len(buf) + 1):]
        elif kind == "splice":
            src, dst, length = m[1] % n, m[2] % n, m[3]
            chunk = buf[src:src + length]
            buf[dst:dst + len(chunk)] = chunk
        elif kind == "insert":
            pos = m[1] % (len(buf) + 1)
            buf[pos:pos] = m[2]
        elif kind == "delete":
            pos = m[1] % n
            del buf[pos:pos + m[2]]
        elif kind == "env":
            off, width = ENV_FIELDS[m[1]]
            put_int(buf, off, width, m[2])
        elif kind == "dirprefix":
            put_int(buf, base.dir_off + 8 * m[1], 8, m[2])
        elif kind == "record":
            off, width = REC_FIELDS[m[2]]
            put_int(buf, base.dir_off + 16 + 56 * (m[1] % max(base.count, 1)) + off, width, m[3])
        elif kind == "payload" and base.payloads:
            p_off, p_len = base.payloads[m[1] % len(base.payloads)]
            put_int(buf, p_off + (m[2] % max(p_len, 1)), m[3], m[4])
        elif kind == "header":
            rewrite_header(buf, m[1], m[2])
    return bytes(buf)


_counter = itertools.count()


def open_verify_walk(path: Path) -> None:
    """open() + verify() + read every tensor's metadata and the masks; CmfError may escape."""
    with cmf.open(path) as f:
        f.verify()
        for t in f.tensors():
            assert len(t.data) == t.nbytes
        _ = (f.masks, f.sparse_index, f.tokenizer_json, f.runnable, f.arch, f.skills)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(which=st.integers(0, 2), muts=st.lists(mutation, min_size=1, max_size=4))
def test_only_cmf_errors_escape(bases: list[Base], tmp_path: Path, which: int, muts: list[tuple]) -> None:
    data = apply(bases[which], muts)
    path = tmp_path / f"m{next(_counter)}.cmf"
    path.write_bytes(data)
    start = time.perf_counter()
    try:
        open_verify_walk(path)
    except CmfError:
        pass
    finally:
        elapsed = time.perf_counter() - start
        path.unlink()
    assert elapsed < TIME_LIMIT_S, f"open+verify took {elapsed:.2f} s"


def test_mutations_reach_deep_checks(bases: list[Base], tmp_path: Path) -> None:
    """The targeted mutations are not all stopped by the envelope: some reach the payload checks."""
    rng = np.random.default_rng(0)
    seen: set[str] = set()
    base = bases[1]
    for i in range(300):
        rec = int(rng.integers(0, 32))
        muts = [("payload", rec, int(rng.integers(0, 2**20)), 4, int(rng.integers(0, 300)))]
        path = tmp_path / f"d{i}.cmf"
        path.write_bytes(apply(base, muts))
        try:
            open_verify_walk(path)
            seen.add("ok")
        except CmfError as exc:
            seen.add(type(exc).__name__)
    assert "BoundsError" in seen and "ok" in seen, seen
