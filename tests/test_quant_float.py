"""f32/f16/bf16 codecs and the reference f16 rounding (REFERENCE_NOTES §1.6)."""

from __future__ import annotations

import numpy as np
import pytest

import cmf.quant as q
from cmf.quant.float import F16_TINY, f16_bits_to_f32, f32_to_bf16_bits


@pytest.mark.parametrize(("bits", "value"), [
    (0x0001, 5.9604645e-8),
    (0x03FF, 6.097555e-5),
    (0x812B, -1.7821789e-5),
    (0x0400, 6.1035156e-5),
])
def test_f16_decode_subnormal_vectors(bits: int, value: float) -> None:
    got = q.decode(np.array([bits], "<u2").tobytes(), "f16", (1,))
    assert got.dtype == np.float32
    assert got[0] == np.float32(value)


def test_f32_to_f16_rounds_subnormal_ties_up() -> None:
    ulp = 2.0 ** -24
    x = np.array([2.0 ** -25, -(2.0 ** -25), 2.5 * ulp, 0.75 * ulp, 0.25 * ulp, 1023.5 * ulp, 2.0 ** -26 * 0.99],
                 np.float32)
    got = q.f32_to_f16_bits(x)
    assert got.tolist() == [0x0001, 0x8001, 0x0003, 0x0001, 0x0000, 0x0400, 0x0000]
    # numpy rounds those ties to even: the two conversions differ exactly there
    assert x[:3].astype(np.float16).view(np.uint16).tolist() == [0x0000, 0x8000, 0x0002]


def test_f32_to_f16_normals_overflow_nan_match_numpy_rne() -> None:
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 100,
                        np.array([65504, 65519.99, 65520, -1e6, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11], np.float32)])
    with np.errstate(over="ignore"):
        assert np.array_equal(q.f32_to_f16_bits(x), x.astype(np.float16).view(np.uint16))
    nan = q.f32_to_f16_bits(np.array([np.nan, -np.nan], np.float32))
    assert nan.tolist() == [0x7E00, 0xFE00]


def test_f16_scale_floors_at_smallest_normal() -> None:
    s = q.f16_scale(np.array([0.0, 1e-9, 3e-5, 1.0, 0.1], np.float32))
    assert s[0] == s[1] == s[2] == F16_TINY == np.float32(2.0 ** -14)
    assert s[3] == 1.0 and s[4] == np.float32(np.float16(0.1))


def test_float_round_trips_and_rows() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 3, 4)).astype(np.float32)
    assert np.array_equal(q.decode(q.encode(w, "f32"), "f32", w.shape), w)
    f16 = q.decode(q.encode(w, "f16"), "f16", w.shape)
    assert np.array_equal(f16, w.astype(np.float16).astype(np.float32))
    bf = q.decode(q.encode(w, "bf16"), 2, w.shape)
    assert np.all(np.abs(bf - w) <= np.abs(w) * 2.0 ** -8)
    for name in ("f32", "f16", "bf16"):
        data = q.encode(w, name)
        assert np.array_equal(q.decode_rows(data, name, w.shape, [4, 0, 4]), q.decode(data, name, w.shape)[[4, 0, 4]])


def test_bf16_encode_is_round_to_nearest_even() -> None:
    x = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -8 + 2.0 ** -20, -2.5], np.float32)
    assert f32_to_bf16_bits(x).tolist() == [0x3F80, 0x3F82, 0x3F81, 0xC020]
    assert f16_bits_to_f32(np.array([0x3C00], np.uint16))[0] == 1.0
    assert q.decode(np.array([0x3F80, 0xC020], "<u2").tobytes(), "bf16", (2,)).tolist() == [1.0, -2.5]
