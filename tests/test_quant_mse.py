"""The ``mse`` encoder of q4_block / q4_tiled / q4tp / q2tp and vbit: valid bytes, less error, importance."""

from __future__ import annotations

import numpy as np
import pytest

import cmf.quant as q
from cmf.format.constants import GROUP
from cmf.format.reader import open as cmf_open
from cmf.format.writer import CmfWriter
from cmf.quant import mse
from cmf.quant.float import f16_scale

from _builders import header

DTYPES = ["q4_block", "q4_tiled", "q4tp", "q2tp"]


def outliers(rows: int, cols: int, seed: int) -> np.ndarray:
    """Gaussian rows of varied amplitude, a few loud input channels, a dead group and a zero row."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp2(rng.normal(0, 1, (rows, 1))) * 0.02
    w[:, rng.choice(cols, 4, replace=False)] *= 8  # outlier channels
    w[:, 3] += 0.05 * rng.standard_t(2, rows)  # one heavy-tailed channel
    w[1] = 0
    w[2, 32:64] = 0
    return w.astype(np.float32)


def _sse(name: str, w: np.ndarray, imp: np.ndarray | None = None, **opts) -> float:
    got = q.decode(q.encode(w, name, **opts), name, w.shape)
    e = np.square(got.astype(np.float64) - w)
    return float((e * imp).sum() if imp is not None else e.sum())


def _stored_scales(name: str, data: bytes, shape: tuple[int, int]) -> np.ndarray:
    """Per-group scales as a reader sees them: (rows·gpr,) f32."""
    codec = q.get_codec(name)
    groups = shape[0] * shape[1] // GROUP
    if name == "q4_block":
        return np.frombuffer(data, np.uint8)[16 * groups:].view("<f2").astype(np.float32)
    if name == "q4_tiled":
        return np.frombuffer(data, np.uint8).reshape(groups, 18)[:, :2].copy().view("<f2").astype(np.float32)[:, 0]
    _, params, codes = codec.split(data, shape)
    return codec.scales(params, codes, shape[1] // GROUP).reshape(-1)


@pytest.mark.parametrize("name", DTYPES)
def test_mse_bytes_are_nearest_levels_of_their_stored_scales(name: str) -> None:
    # what every reader decodes: each weight is its group's nearest level of the stored scale
    # (clamped to the layout's range), so the encoder and any reader agree exactly
    w = outliers(24, 256, 0)
    data = q.encode(w, name)
    assert data != q.encode(w, name, encoder="reference")
    q.get_codec(name).validate(data, w.shape)
    assert len(data) == q.get_codec(name).expected_nbytes(w.shape)
    s = _stored_scales(name, data, w.shape)[:, None]
    g = w.reshape(-1, GROUP)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(s != 0, np.float32(1) / s, np.float32(0)).astype(np.float32)
    if name == "q2tp":
        want = (np.clip(np.rint(g * r + np.float32(1.5)), 0, 3) - np.float32(1.5)) * s
    else:
        want = np.clip(np.rint(g * r), -8, 7) * s
    got = q.decode(data, name, w.shape).reshape(-1, GROUP)
    if name == "q2tp":  # a zero rung decodes to 0 whatever its plane says
        want = np.where(s == 0, np.float32(0), want)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert np.all(got[np.abs(g).max(axis=1) == 0] == 0)  # dead groups stay exact zeros


def test_scale_rounding_is_the_writers_f16_scale() -> None:
    rng = np.random.default_rng(9)
    x = np.concatenate([np.exp2(rng.uniform(-20, 15.9, 4000)), [2.0 ** -14, 2.0 ** -15, 0.0, 1.0 + 2.0 ** -11,
                                                              1.0 + 3 * 2.0 ** -11, 65504.0, 2048.0 + 1.0]])
    x = x.astype(np.float32)
    got = np.array([mse._f16s(v) for v in x], np.float32)
    np.testing.assert_array_equal(got, f16_scale(x))
    np.testing.assert_array_equal(np.array([mse._f16s(-v) for v in x[x > 0]], np.float32), -f16_scale(x[x > 0]))


def test_mse_q4_scales_are_f16_scales_and_use_the_minus_eight_level() -> None:
    w = outliers(16, 128, 1)
    data = q.encode(w, "q4_block")
    s = _stored_scales("q4_block", data, w.shape)
    assert np.array_equal(f16_scale(np.abs(s)), np.abs(s))  # exact f16 values, floored at 2^-14
    assert (s < 0).any()  # the largest-magnitude weight maps onto -8 where that is closer
    nib = np.frombuffer(data, np.uint8)[:16 * s.size]
    assert (nib & 15).min() == 0  # level -8 is in use


def _magnitude_weights(w: np.ndarray) -> np.ndarray:
    """The 4-bit objective's per-weight error weight: 0.5·rms(group) + |w|."""
    g = w.reshape(-1, GROUP).astype(np.float64)
    return (0.5 * np.sqrt(np.square(g).mean(axis=1, keepdims=True)) + np.abs(g)).reshape(w.shape)


@pytest.mark.parametrize("name,plain,weighted", [("q4_block", 0.8, 0.8), ("q4_tiled", 0.8, 0.8),
                                                 ("q4tp", 1.0, 0.95), ("q2tp", 0.75, None)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mse_reduces_squared_error_against_the_reference(name: str, plain: float, weighted: float | None,
                                                         seed: int) -> None:
    # q4tp's scales are positive rungs (no -8 trick), so its gain is in the magnitude-weighted
    # objective it minimises; plain squared error must still not grow
    w = outliers(48, 512, seed)
    assert _sse(name, w) < plain * _sse(name, w, encoder="reference")
    if weighted is not None:
        m = _magnitude_weights(w)
        assert _sse(name, w, m) < weighted * _sse(name, w, m, encoder="reference")
    assert _sse(name, w, encoder="mse") == _sse(name, w)  # mse is the default


@pytest.mark.parametrize("mean_bits", [4.25, 5.0, 6.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vbit_mse_scales_cut_error_at_the_same_widths(mean_bits: float, seed: int) -> None:
    w = outliers(48, 512, seed)
    mse_bytes, ref_bytes = q.encode(w, "vbit", mean_bits=mean_bits), q.encode(w, "vbit", mean_bits=mean_bits,
                                                                              encoder="reference")
    assert mse_bytes[:48] == ref_bytes[:48] and len(mse_bytes) == len(ref_bytes)  # same widths, same size
    m = _magnitude_weights(w)
    assert _sse("vbit", w, mean_bits=mean_bits) < 0.95 * _sse("vbit", w, mean_bits=mean_bits, encoder="reference")
    assert _sse("vbit", w, m, mean_bits=mean_bits) < 0.95 * _sse("vbit", w, m, mean_bits=mean_bits,
                                                                 encoder="reference")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vbit_narrow_rows_give_the_extra_level_to_the_dominant_sign(monkeypatch, seed: int) -> None:
    # levels -L .. L+1: rows of at most SIGNED_WIDTH bits may store a negative scale, so a group
    # whose largest-magnitude weight is negative gets the extra level on its side; wider rows
    # and every other group keep the positive-only search's scales
    from cmf.quant import vbit

    w = outliers(48, 512, seed)
    signed, widest = q.encode(w, "vbit", mean_bits=3.5), vbit.SIGNED_WIDTH
    monkeypatch.setattr(vbit, "SIGNED_WIDTH", 0)
    positive = q.encode(w, "vbit", mean_bits=3.5)
    assert signed[:48] == positive[:48] and len(signed) == len(positive)  # same widths, same size
    widths = np.frombuffer(signed[:48], np.uint8)
    assert set(widths.tolist()) >= {3, 4, 5}
    s_signed, s_positive = (np.frombuffer(d[48:48 + 2 * 48 * 16], "<f2").astype(np.float32).reshape(48, 16)
                            for d in (signed, positive))
    g = w.reshape(48, 16, GROUP)
    dominant_negative = g.min(axis=2) < -g.max(axis=2)
    narrow = (widths <= widest)[:, None]
    assert (s_positive >= 0).all()
    assert (s_signed < 0).any() and not (s_signed < 0)[~(dominant_negative & narrow)].any()
    assert (s_signed == s_positive)[~narrow[:, 0]].all()
    # the decoded values are (u - L)·s with the sign, and never worse in the objective it minimises
    m = _magnitude_weights(w)
    err = [(np.square(q.decode(d, "vbit", w.shape).astype(np.float64) - w) * m).reshape(48, 16, GROUP).sum(axis=2)
           for d in (signed, positive)]
    assert (err[0] <= err[1] * (1 + 1e-6)).all()
    assert err[0][narrow[:, 0]].sum() < 0.9 * err[1][narrow[:, 0]].sum()


def test_mse_q4tp_beats_reference_q4t_at_a_smaller_size() -> None:
    w = outliers(64, 512, 3)
    assert _sse("q4tp", w) < _sse("q4_tiled", w, encoder="reference")


@pytest.mark.parametrize("name", DTYPES)
def test_importance_moves_error_off_the_important_channels(name: str) -> None:
    w = outliers(32, 256, 4)
    rng = np.random.default_rng(5)
    imp = np.ones(256, np.float32)
    loud = rng.choice(256, 24, replace=False)
    imp[loud] = 50.0
    plain = q.decode(q.encode(w, name), name, w.shape)
    weighted = q.decode(q.encode(w, name, importance=imp), name, w.shape)
    e_plain = np.square(plain.astype(np.float64) - w)
    e_weighted = np.square(weighted.astype(np.float64) - w)
    assert (e_weighted * imp).sum() < 0.95 * (e_plain * imp).sum()
    assert e_weighted[:, loud].sum() < 0.9 * e_plain[:, loud].sum()


def test_importance_follows_columns_when_groups_straddle_rows() -> None:
    # q4_block groups run over the flattened tensor: with 50 columns a group spans two rows,
    # and the weights must follow each element's column, chunk by chunk
    table = mse.group_weights(np.arange(50, dtype=np.float32), 50)
    assert table.shape == (25, 32)
    for g in (0, 1, 24, 25, 1000):
        assert np.array_equal(table[g % 25], (32 * g + np.arange(32)) % 50)
    w = outliers(40, 50 * 32, 6)[:, :50].copy()
    imp = np.ones(50, np.float32)
    imp[7] = 100.0
    a = q.decode(q.encode(w, "q4_block", importance=imp), "q4_block", w.shape)
    b = q.decode(q.encode(w, "q4_block"), "q4_block", w.shape)
    assert np.square(a[:, 7] - w[:, 7]).sum() < np.square(b[:, 7] - w[:, 7]).sum()


def test_mse_files_open_in_the_strict_reader(tmp_path) -> None:
    path = tmp_path / "mse.cmf"
    mats = {name: outliers(32, 128, i) for i, name in enumerate(DTYPES)}
    with CmfWriter(path, header()) as wr:
        for name, w in mats.items():
            wr.add_array(f"{name}.weight", w, name)
    with cmf_open(path) as f:
        assert f.verify() == []
        for name, w in mats.items():
            t = f.tensor(f"{name}.weight")
            assert t.dtype.label == name
            assert bytes(t.numpy()) == q.encode(w, name)
            np.testing.assert_array_equal(f.array(t.name), q.decode(q.encode(w, name), name, w.shape))


def test_encoder_options_are_checked(monkeypatch) -> None:
    w = outliers(8, 64, 7)
    with pytest.raises(ValueError, match="unknown encoder"):
        q.encode(w, "q4tp", encoder="lloyd")
    with pytest.raises(ValueError, match="needs encoder='mse'"):
        q.encode(w, "q4_tiled", encoder="reference", importance=np.ones(64))
    with pytest.raises(ValueError, match="64 input features"):
        q.encode(w, "q4tp", importance=np.ones(32))
    with pytest.raises(ValueError, match="non-negative"):
        q.encode(w, "q2tp", importance=-np.ones(64))
    with pytest.raises(ValueError, match="search= is an option"):
        q.encode(w, "q4tp", search=False)
    monkeypatch.setenv("CMF_QUANT_ENCODER", "reference")  # the CLI's way to the reference bytes
    assert q.encode(w, "q4tp") == q.encode(w, "q4tp", encoder="reference")
    assert q.encode(w, "q4tp", encoder="mse") != q.encode(w, "q4tp")


def test_mse_edge_shapes() -> None:
    assert q.encode(np.zeros((0, 64), np.float32), "q4tp") == b""
    z = np.zeros((3, 64), np.float32)
    for name in DTYPES:
        assert np.all(q.decode(q.encode(z, name), name, z.shape) == 0)
    odd = outliers(5, 64, 8)[:, :37].copy()  # q4_block: any shape, zero-padded tail
    got = q.decode(q.encode(odd, "q4_block"), "q4_block", odd.shape)
    assert np.abs(got - odd).max() <= np.abs(odd).max() / 4
    one = np.full((2, 32), 0.25, np.float32)  # one live group per row: a zero-span ladder
    for name in ("q4tp", "q2tp"):
        assert np.allclose(q.decode(q.encode(one, name), name, one.shape), one, rtol=0.2)
