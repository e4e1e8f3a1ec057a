"""Every dtype: round trip within its lattice bound, zeros stay zero, tails, decode_rows."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import cmf.quant as q
from cmf.format.constants import GROUP
from cmf.quant.ladder import Q2tpCodec, Q4tpCodec

QUANT = ["q8_row", "q4_block", "q8_2f", "vbit", "vbit_ro", "q4_tiled", "q4tp", "q2tp", "q1", "q1s", "q1t"]
ALL = ["f32", "f16", "bf16"] + QUANT
CAN_ZERO = [d for d in ALL if d not in ("q1", "q1s")]  # binary levels cannot spell zero


def matrix(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Gaussian rows with a spread of row amplitudes (a realistic weight matrix)."""
    rng = np.random.default_rng(seed)
    amp = np.exp2(rng.normal(0, 1.0, size=(rows, 1))) * 0.02
    return (rng.standard_normal((rows, cols)) * amp).astype(np.float32)


def _groups(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1, GROUP)


def _err_bound(name: str, w: np.ndarray, data: bytes) -> np.ndarray:
    """Largest |decode - w| the dtype's lattice allows, per element."""
    eps = np.float32(1e-6) * np.abs(w) + np.float32(1e-12)
    if name == "q8_row":
        amax = np.abs(w).max(axis=1, keepdims=True)
        return 0.5 * np.maximum(amax / 127 * (1 + 2.0 ** -10), 2.0 ** -14) + eps
    if name == "q8_2f":
        qq, s, col = q.get_codec(name)._parts(data, w.shape)
        return 0.5 * s[:, None] * col[None, :] * (1 + 1e-5) + 2.0 ** -11 * np.abs(w) + eps
    if name in ("q4_block", "q4_tiled"):
        # from the stored (possibly negative) scale: half a step, or the distance past the end
        # level a clamped weight lies (the mse encoder may put the largest weight on -8)
        groups = w.size // GROUP
        raw = np.frombuffer(data, np.uint8)
        sb = raw[16 * groups:] if name == "q4_block" else raw.reshape(groups, 18)[:, :2].reshape(-1)
        s = sb.copy().view("<f2").astype(np.float32).reshape(w.shape[0], -1, 1)
        lo, hi = np.minimum(-8 * s, 7 * s), np.maximum(-8 * s, 7 * s)
        g = _groups(w)
        past = np.maximum(np.maximum(lo - g, g - hi), 0)
        return (np.maximum(0.5 * np.abs(s), past) * (1 + 1e-5)).reshape(w.shape) + eps
    if name in ("vbit", "vbit_ro"):
        codec = q.get_codec(name)
        data_a, widths, starts, off, cols = codec._layout(data, w.shape)
        s = data_a[off:off + 2 * w.size // GROUP].view("<f2").astype(np.float32).reshape(w.shape[0], -1, 1)
        # half a step, or how far past the end levels -L·s .. (L+1)·s a clipped weight lies (mse
        # scales may clip the largest weight)
        lvl = ((1 << (widths.astype(np.int64) - 1)) - 1).astype(np.float32)[:, None, None]
        g = _groups(w)
        past = np.maximum(np.maximum(-lvl * s - g, g - (lvl + 1) * s), 0)
        return (np.maximum(0.5 * s, past) * (1 + 1e-6)).reshape(w.shape) + eps
    if name in ("q4tp", "q2tp"):
        codec = q.get_codec(name)
        _, params, codes = codec.split(data, w.shape)
        s = codec.scales(params, codes, w.shape[1] // GROUP)[..., None]
        amax = np.abs(_groups(w)).max(axis=2, keepdims=True)
        top = 7 if name == "q4tp" else 1.5
        b = np.maximum(0.5 * s, amax - top * s) * (1 + 1e-5)
        return np.broadcast_to(b, _groups(w).shape).reshape(w.shape) + eps
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["q8_row", "q8_2f", "q4_block", "q4_tiled", "vbit", "vbit_ro", "q4tp", "q2tp"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("encoder", [None, "reference"])
def test_round_trip_within_lattice_bound(name: str, seed: int, encoder: str | None) -> None:
    w = matrix(24, 160, seed)
    opts = {"encoder": encoder} if encoder and name in ("q4_block", "q4_tiled", "q4tp", "q2tp", "vbit", "vbit_ro") else {}
    data = q.encode(w, name, **opts)
    got = q.decode(data, name, w.shape)
    assert got.dtype == np.float32 and got.shape == w.shape
    assert np.all(np.abs(got - w) <= _err_bound(name, w, data))
    expected = q.get_codec(name).expected_nbytes(w.shape)
    assert expected is None or expected == len(data)
    q.get_codec(name).validate(data, w.shape)


def test_q1_family_levels_and_signs() -> None:
    w = matrix(8, 96)
    got = q.decode(q.encode(w, "q1"), "q1", w.shape)
    g = _groups(got)
    assert np.all(np.abs(g) == np.abs(g[..., :1]))  # one level per group
    assert np.array_equal(got >= 0, w >= 0)
    mean = np.abs(_groups(w)).mean(axis=2)
    assert np.allclose(np.abs(g[..., 0]), mean, rtol=2e-3)


def test_q1_is_lossless_on_one_bit_weights() -> None:
    rng = np.random.default_rng(3)
    s = np.float16(rng.uniform(0.01, 0.1, size=(6, 4, 1))).astype(np.float32)
    w = (np.where(rng.random((6, 4, 32)) < 0.5, -1, 1) * s).reshape(6, 128).astype(np.float32)
    for name in ("q1", "q1p"):
        assert np.array_equal(q.decode(q.encode(w, name), "q1", w.shape), w)


def test_q1t_is_lossless_on_ternary_weights() -> None:
    rng = np.random.default_rng(4)
    s = np.float16(rng.uniform(0.01, 0.1, size=(6, 4, 1))).astype(np.float32)
    w = (rng.integers(-1, 2, size=(6, 4, 32)) * s).reshape(6, 128).astype(np.float32)
    got = q.decode(q.encode(w, "q1t"), "q1t", w.shape)
    assert np.array_equal(got, w)


def test_q1s_overlay_restores_outliers_exactly() -> None:
    w = matrix(16, 128)
    data = q.encode(w, "q1s", keep=0.05)
    got = q.decode(data, "q1s", w.shape)
    n_out = round(w.size * 0.05)
    thr = np.sort(np.abs(w).ravel())[w.size - n_out]
    big = np.abs(w) >= thr
    assert big.sum() >= n_out
    assert np.array_equal(got[big], w[big].astype(np.float16).astype(np.float32))
    assert len(data) == 6 * w.size // 32 + 4 + 6 * int(big.sum())


def test_q1t_overlay_keeps_top_weights() -> None:
    w = matrix(16, 128)
    rms = np.linspace(0.5, 2.0, 128).astype(np.float32)
    data = q.encode(w, "q1t", keep=0.02, act_rms=rms)
    got = q.decode(data, "q1t", w.shape)
    score = (np.abs(w) * rms).ravel()
    top = np.argsort(score)[-round(w.size * 0.02):]
    assert np.array_equal(got.ravel()[top], w.ravel()[top].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("name", CAN_ZERO)
def test_zero_rows_and_dead_groups_decode_to_exact_zero(name: str) -> None:
    w = matrix(6, 128)
    w[2] = 0
    w[4, 32:64] = 0  # a dead group inside a live row
    got = q.decode(q.encode(w, name), name, w.shape)
    assert np.all(got[2] == 0)
    assert np.all(got[4, 32:64] == 0)  # q2tp: rung 0 is the exact zero


def test_all_zero_matrix_round_trips() -> None:
    w = np.zeros((4, 64), np.float32)
    for name in CAN_ZERO:
        assert np.array_equal(q.decode(q.encode(w, name), name, w.shape), w), name


@pytest.mark.parametrize("shape", [(37,), (3, 37), (2, 3, 7), (1,), (33, 1)])
def test_q4_block_pads_flattened_tail(shape: tuple[int, ...]) -> None:
    w = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    data = q.encode(w, "q4_block")
    n = w.size
    assert len(data) == 18 * -(-n // 32)
    got = q.decode(data, "q4_block", shape)
    assert got.shape == shape
    amax = np.abs(np.concatenate([w.ravel(), np.zeros(-n % 32)])).reshape(-1, 32).max(axis=1)
    bound = np.repeat(0.5 * np.maximum(amax / 7 * (1 + 2.0 ** -10), 2.0 ** -14), 32)[:n] + 1e-6
    assert np.all(np.abs(got.ravel() - w.ravel()) <= bound)
    if len(shape) >= 2:
        assert np.array_equal(q.decode_rows(data, "q4_block", shape, [shape[0] - 1, 0]),
                              got[[shape[0] - 1, 0]])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("cols", [32, 96, 224])
def test_decode_rows_equals_decode(name: str, cols: int) -> None:
    w = matrix(11, cols, seed=cols)
    opts = {"q1s": {"keep": 0.03}, "q1t": {"keep": 0.03}}.get(name, {})
    data = q.encode(w, name, **opts)
    full = q.decode(data, name, w.shape)
    for rows in ([0], [10, 3, 3, 7], list(range(11)), []):
        part = q.decode_rows(data, name, w.shape, np.array(rows, np.int64))
        assert part.shape == (len(rows), cols)
        assert np.array_equal(part, full[rows]), (name, rows)


@pytest.mark.parametrize("gpr", [1, 2, 3, 5, 7, 8, 9, 13])
def test_ladder_code_tails(gpr: int) -> None:
    w = matrix(5, 32 * gpr, seed=gpr)
    for codec in (Q4tpCodec(), Q2tpCodec()):
        data = codec.encode(w)
        assert len(data) == codec.expected_nbytes(w.shape)
        assert np.array_equal(codec.decode_rows(data, w.shape, [4]), codec.decode(data, w.shape)[4:5])


def test_empty_shapes() -> None:
    for name in ALL:
        w = np.zeros((0, 64), np.float32)
        data = q.encode(w, name)
        assert q.decode(data, name, w.shape).shape == (0, 64), name


@pytest.mark.parametrize("name", ["f16", "bf16", "q8_row", "q8_2f", "q4_block", "q4_tiled", "q4tp", "q2tp", "q1",
                                  "vbit", "vbit_ro", "q1t"])
def test_fast_decoders_match_numpy_rows_on_random_payloads(name: str) -> None:
    # ``decode`` runs the numba kernels, ``decode_rows`` the numpy path: arbitrary bytes
    # (NaN and infinite scales included) must decode identically both ways.
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    shape = (9, 96)
    codec = q.get_codec(name)
    if name in ("vbit", "vbit_ro"):
        widths = rng.choice([3, 4, 5, 6, 8], size=9).astype(np.uint8)
        row_bytes = widths.astype(np.int64) * 96 // 8
        parts = [widths.tobytes(), rng.integers(0, 256, 2 * 9 * 3, dtype=np.uint8).tobytes()]
        if name == "vbit_ro":
            parts.append(np.concatenate([[0], np.cumsum(row_bytes)]).astype("<u4").tobytes())
        parts.append(rng.integers(0, 256, int(row_bytes.sum()), dtype=np.uint8).tobytes())
        data = b"".join(parts)
    elif name == "q1t":
        data = rng.integers(0, 256, 9 * 27, dtype=np.uint8).tobytes() + np.zeros(10, "<u4").tobytes()
    else:
        data = rng.integers(0, 256, codec.expected_nbytes(shape), dtype=np.uint8).tobytes()
    with np.errstate(all="ignore"):
        full = codec.decode(data, shape)
        rows = codec.decode_rows(data, shape, np.arange(9))
    assert np.array_equal(full, rows, equal_nan=True)
