"""Bit-level layouts: 5-bit codes, base-3 packing, MSB-first vbit, nibble and sign orders,
q4tp nibbles against q4_tiled, and the shared vbit conformance vector."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

import cmf.quant as q
from cmf.format.constants import VBIT_WIDTHS
from cmf.quant.float import exp2_f16, log2_f16
from cmf.quant.ladder import pack_codes, q2tp_ladder, q4tp_ladder, unpack_codes

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
GOLDEN = SHARED / "conformance" / "vbit_golden.json"


@pytest.mark.parametrize("gpr", range(1, 18))
def test_five_bit_codes_round_trip_at_every_offset(gpr: int) -> None:
    rng = np.random.default_rng(gpr)
    codes = rng.integers(0, 32, size=(3, gpr))
    packed = pack_codes(codes)
    assert packed.shape == (3, (5 * gpr + 7) // 8)
    assert np.array_equal(unpack_codes(packed, gpr), codes)
    for g in range(gpr):  # a lone 31 lands on bits [5g, 5g+5), LSB-first across bytes
        one = np.zeros((1, gpr), np.int64)
        one[0, g] = 31
        bits = np.unpackbits(pack_codes(one)[0], bitorder="little")
        assert np.flatnonzero(bits).tolist() == list(range(5 * g, 5 * g + 5))


def _q4tp_payload(nibbles: np.ndarray, lo: float, step: float, codes: np.ndarray) -> bytes:
    params = np.array([[np.float16(lo).view(np.uint16), np.float16(step).view(np.uint16)]], "<u2")
    return nibbles.tobytes() + params.tobytes() + pack_codes(codes[None, :]).tobytes()


def test_q4tp_decoder_reads_rung_per_group() -> None:
    gpr = 7
    codes = np.array([0, 31, 5, 17, 1, 30, 8])
    nib = np.full((gpr, 16), 0x9A, np.uint8)  # low nibble 0xA -> +2, high 0x9 -> +1
    data = _q4tp_payload(nib, -3.0, 0.25, codes)
    got = q.decode(data, "q4tp", (1, 32 * gpr)).reshape(gpr, 32)
    lo_h, st_h = np.float16(-3.0).view(np.uint16), np.float16(0.25).view(np.uint16)
    t = q4tp_ladder(lo_h, st_h)[0]
    assert np.array_equal(got[:, 0], 2 * t[codes]) and np.array_equal(got[:, 1], t[codes])
    t2 = q2tp_ladder(lo_h, st_h)[0]
    assert t2[0] == 0 and np.array_equal(t2[1:], t[:31])


def test_ladder_is_iterated_f32_multiplication() -> None:
    lo_h, st_h = np.float16(-5.0).view(np.uint16), np.float16(0.1875).view(np.uint16)
    t = q4tp_ladder(lo_h, st_h)[0]
    ratio = exp2_f16(st_h)
    assert t[0] == np.float32(2.0 ** -5) and abs(float(ratio) - 2 ** 0.1875) < 2e-7
    acc = t[0]
    for c in range(32):
        assert t[c] == acc
        acc = np.float32(acc * ratio)


def test_f16_transcendental_tables_are_exact_to_the_last_bit() -> None:
    # Correctly rounded or the C library's value: never more than one f32 ulp off, exact on
    # powers of two (numpy's own float32 log2/exp2 are not used for ladder arithmetic).
    bits = np.arange(0x0400, 0x7C00, dtype=np.uint16)
    x = bits.view(np.float16).astype(np.float64)
    lg = log2_f16(bits)
    assert np.all(np.abs(lg - np.log2(x)) <= np.spacing(np.abs(lg).astype(np.float32)) + 1e-30)
    assert np.array_equal(log2_f16(np.float16([0.25, 1, 1024]).view(np.uint16)), [-2, 0, 10])
    ex = exp2_f16(bits[:12000])
    assert np.all(np.abs(ex - np.exp2(x[:12000])) <= np.spacing(ex))


def test_q2tp_plane_order_and_zero_rung() -> None:
    # weight 4k+j sits in bits 2j..2j+1 of byte k; value (c2 - 1.5)·s
    plane = np.zeros((1, 8), np.uint8)
    plane[0, 0] = 0b11_10_01_00  # weights 0..3 -> c2 = 0, 1, 2, 3
    data = _q4tp_payload(plane, 0.0, 1.0, np.array([1]))
    got = q.decode(data, "q2tp", (1, 32))
    assert got[0, :4].tolist() == [-1.5, -0.5, 0.5, 1.5]  # rung 1 = 2^0
    dead = _q4tp_payload(np.full((1, 8), 0xAA, np.uint8), 0.0, 1.0, np.array([0]))
    assert np.all(q.decode(dead, "q2tp", (1, 32)) == 0)


def test_q4_nibble_order_low_first() -> None:
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = 7.0, -7.0  # scale 1: q = 15 (low nibble of byte 0) and 1 (high nibble)
    block = q.encode(w, "q4_block")
    assert block[0] == 0x1F and block[16:18] == np.float16(1.0).tobytes()
    tiled = q.encode(w, "q4_tiled")
    assert tiled[:2] == np.float16(1.0).tobytes() and tiled[2] == 0x1F
    assert tiled[2:] == block[:16]


def test_q1_sign_bits_lsb_first() -> None:
    w = -np.ones((1, 32), np.float32)
    w[0, [0, 9, 31]] = 1.0
    data = q.encode(w, "q1")
    assert data[:2] == np.float16(1.0).tobytes()
    assert list(data[2:6]) == [0x01, 0x02, 0x00, 0x80]


def test_q1t_base3_packing() -> None:
    rng = np.random.default_rng(11)
    codes = rng.integers(0, 3, size=32)
    vals = np.choose(codes, [0.0, 1.0, -1.0]).astype(np.float32)
    data = q.encode(vals[None, :], "q1t")
    assert data[:2] == np.float16(1.0).tobytes()
    expect = [sum(int(codes[k]) * 3 ** (k % 5) for k in range(j * 5, min(j * 5 + 5, 32))) for j in range(7)]
    assert list(data[2:9]) == expect
    assert data[9:] == np.array([0, 0], "<u4").tobytes()  # empty overlay
    # and the decoder reads hand-packed bytes the same way
    hand = np.float16(0.5).tobytes() + bytes(expect) + np.array([0, 0], "<u4").tobytes()
    assert np.array_equal(q.decode(hand, "q1t", (1, 32))[0], vals * np.float32(0.5))


@pytest.mark.parametrize("width", VBIT_WIDTHS)
def test_vbit_rows_are_msb_first(width: int) -> None:
    rng = np.random.default_rng(width)
    rows, cols = 2, 64
    u = rng.integers(0, 2 ** width, size=(rows, cols))
    stream = b""
    for r in range(rows):
        bits = "".join(format(int(v), f"0{width}b") for v in u[r])
        stream += int(bits, 2).to_bytes(len(bits) // 8, "big")
    scales = np.full(rows * cols // 32, np.float16(0.5)).tobytes()
    data = bytes([width] * rows) + scales + stream
    level = 2 ** (width - 1) - 1
    expect = ((u - level) * 0.5).astype(np.float32)
    assert np.array_equal(q.decode(data, "vbit", (rows, cols)), expect)
    offsets = np.arange(rows + 1, dtype="<u4") * (cols * width // 8)
    ro = bytes([width] * rows) + scales + offsets.tobytes() + stream
    assert np.array_equal(q.decode(ro, "vbit_ro", (rows, cols)), expect)
    assert np.array_equal(q.decode_rows(ro, "vbit_ro", (rows, cols), [1]), expect[1:])
    # the encoder packs the same way: equal row amplitudes put every row at ``width``
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[:, 0] = 4.0
    enc = q.encode(w, "vbit", mean_bits=width)
    assert list(enc[:rows]) == [width] * rows
    packed = enc[rows + 2 * rows * cols // 32:]
    bits = "".join(format(b, "08b") for b in packed)
    codes = np.array([int(bits[i:i + width], 2) for i in range(0, len(bits), width)]).reshape(rows, cols)
    s = np.frombuffer(enc[rows:rows + 2 * rows * cols // 32], "<f2").astype(np.float32).reshape(rows, -1)
    expect = ((codes - level).reshape(rows, -1, 32) * s[..., None]).reshape(rows, cols)
    assert np.array_equal(q.decode(enc, "vbit", (rows, cols)), expect.astype(np.float32))


def test_q4tp_nibbles_match_q4_tiled_when_ladder_reproduces_scale() -> None:
    # Each row's groups share one power-of-two scale: the ladder's rung 0 is that scale
    # exactly, so q4tp must choose it and produce q4_tiled's nibbles byte for byte.
    rng = np.random.default_rng(21)
    rows, gpr = 12, 6
    qv = rng.integers(-7, 8, size=(rows, gpr, 32))
    qv[..., 0] = np.where(rng.random((rows, gpr)) < 0.5, 7, -7)
    scale = np.exp2(rng.integers(-12, 3, size=(rows, 1, 1))).astype(np.float32)
    w = (qv * scale).reshape(rows, gpr * 32).astype(np.float32)
    for opts in ({"encoder": "reference", "search": True}, {"encoder": "reference", "search": False}, {}):
        tp = q.encode(w, "q4tp", **opts)  # {} = the mse encoder: exact scales have zero error
        tiled = np.frombuffer(q.encode(w, "q4_tiled", encoder=opts.get("encoder")), np.uint8).reshape(-1, 18)[:, 2:]
        assert tp[:rows * gpr * 16] == tiled.tobytes()
        assert np.array_equal(q.decode(tp, "q4tp", w.shape), w)


@pytest.mark.skipif(not GOLDEN.exists(), reason="../shared conformance data not present")
def test_vbit_golden_vector() -> None:
    g = json.loads(GOLDEN.read_text())
    rows, cols = g["rows"], g["cols"]
    data = base64.b64decode(g["bytes"])
    expect = np.array(g["expect"], np.float32).reshape(rows, cols)
    assert list(data[:rows]) == [4, 5, 8, 4, 4, 5, 4, 3, 4, 5, 5, 4, 5, 4, 4, 4]
    assert np.array_equal(q.decode(data, "vbit", (rows, cols)), expect)
    # vbit_ro vector derived by inserting the offset table
    head = rows + 2 * rows * cols // 32
    row_bytes = np.frombuffer(data[:rows], np.uint8).astype(np.int64) * cols // 8
    offsets = np.concatenate([[0], np.cumsum(row_bytes)]).astype("<u4")
    ro = data[:head] + offsets.tobytes() + data[head:]
    assert np.array_equal(q.decode(ro, "vbit_ro", (rows, cols)), expect)
    assert np.array_equal(q.decode_rows(ro, "vbit_ro", (rows, cols), [7, 2]), expect[[7, 2]])
    # our encoder, fed the decoded values, writes the reference encoder's bytes again
    assert q.encode(expect, "vbit", encoder="reference") == data
    assert q.encode(expect, "vbit_ro", encoder="reference") == ro
