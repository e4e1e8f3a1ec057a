"""Statistical properties the reference's own tests check (REFERENCE_NOTES §1.16)."""

from __future__ import annotations

import numpy as np
import pytest

import cmf.quant as q
from cmf.format.constants import VBIT_WIDTHS


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))


def source(rows: int, cols: int, seed: int, spread: float = 1.0, col_spread: float | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    row_amp = np.exp2(rng.normal(0, spread, size=(rows, 1)))
    col_spread = spread / 2 if col_spread is None else col_spread
    col_amp = np.exp2(rng.normal(0, col_spread, size=(1, cols)))  # within-row scale spread
    return (rng.standard_normal((rows, cols)) * row_amp * col_amp * 0.02).astype(np.float32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("search", [True, False])
def test_q4tp_error_at_most_1_06_of_q4t(seed: int, search: bool) -> None:
    # the reference encoders' property; the mse encoders keep it against reference q4t
    w = source(64, 512, seed, spread=0.5 + seed / 2)
    e_tp = _rms(q.decode(q.encode(w, "q4tp", encoder="reference", search=search), "q4tp", w.shape) - w)
    e_t = _rms(q.decode(q.encode(w, "q4_tiled", encoder="reference"), "q4_tiled", w.shape) - w)
    assert e_tp <= 1.06 * e_t
    assert _rms(q.decode(q.encode(w, "q4tp"), "q4tp", w.shape) - w) <= e_t


def test_q4tp_is_smaller_than_q4t() -> None:
    shape = (256, 4096)
    assert q.get_codec("q4tp").expected_nbytes(shape) * 8 / (shape[0] * shape[1]) == pytest.approx(4.164, abs=0.01)
    assert q.get_codec("q4_tiled").expected_nbytes(shape) * 8 / (shape[0] * shape[1]) == 4.5


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("opts", [{"encoder": "reference", "search": True}, {"encoder": "reference", "search": False},
                                  {"encoder": "mse"}], ids=["reference", "reference-nosearch", "mse"])
def test_q2tp_relative_rms_in_reference_window(seed: int, opts: dict) -> None:
    w = source(48, 256, seed, spread=0.5 + seed / 2, col_spread=0.0)  # random, not heavy-tailed
    got = q.decode(q.encode(w, "q2tp", **opts), "q2tp", w.shape)
    rel = _rms(got - w) / _rms(w)
    assert 0.05 < rel < 0.55


def test_q2tp_search_does_not_hurt() -> None:
    w = source(64, 512, 9, spread=1.5)
    on = _rms(q.decode(q.encode(w, "q2tp", encoder="reference"), "q2tp", w.shape) - w)
    off = _rms(q.decode(q.encode(w, "q2tp", encoder="reference", search=False), "q2tp", w.shape) - w)
    assert on <= off * 1.001


@pytest.mark.parametrize("mean_bits", [3.5, 4.25, 5.0])
def test_vbit_widths_and_budget(mean_bits: float) -> None:
    w = source(512, 64, 3, spread=1.0)
    for name in ("vbit", "vbit_ro"):
        data = q.encode(w, name, mean_bits=mean_bits)
        widths = q.get_codec(name).widths(data, w.shape)
        assert set(np.unique(widths).tolist()) <= set(VBIT_WIDTHS)
        assert abs(float(widths.mean()) - mean_bits) < 0.5
        # louder rows never get fewer bits
        amp = np.abs(w).max(axis=1)
        order = np.argsort(amp)
        assert np.all(np.diff(widths[order].astype(int)) >= 0)


def test_vbit_snap_ties_go_to_lower_level() -> None:
    from cmf.quant.vbit import snap_widths

    x = np.array([2.0, 3.5, 4.5, 5.5, 7.0, 7.01, 9.0, 6.49], np.float32)
    assert snap_widths(x).tolist() == [3, 3, 4, 5, 6, 8, 8, 6]


def test_vbit_moe_family_shares_one_budget() -> None:
    rng = np.random.default_rng(8)
    experts = [(rng.standard_normal((64, 64)) * amp).astype(np.float32) for amp in (0.005, 0.02, 0.08)]
    biases = q.vbit_family_biases(experts, mean_bits=4.25)
    assert biases[0] < biases[1] < biases[2]
    blobs = q.encode_vbit_family(experts, "vbit_ro", mean_bits=4.25)
    widths = [q.get_codec("vbit_ro").widths(b, e.shape) for b, e in zip(blobs, experts)]
    means = [float(x.mean()) for x in widths]
    assert means[0] < means[1] < means[2]  # a loud expert gets more bits, a quiet one fewer
    assert abs(float(np.concatenate(widths).mean()) - 4.25) < 0.1
    for b, e, bias in zip(blobs, experts, biases):
        assert b == q.encode(e, "vbit_ro", mean_bits=4.25, bias=bias)


def test_vbit_family_b_field_favours_busy_experts() -> None:
    rng = np.random.default_rng(12)
    experts = [(rng.standard_normal((64, 64)) * 0.02).astype(np.float32) for _ in range(3)]
    plain = q.vbit_family_biases(experts)
    routed = q.vbit_family_biases(experts, route_counts=[1, 100, 10000])
    assert routed[2] - routed[0] > plain[2] - plain[0] + 1.0
    with pytest.raises(ValueError):
        q.vbit_family_biases(experts, route_counts=[1, 2])


def test_q1t_beats_q1_on_normal_weights() -> None:
    w = source(32, 256, 4)
    e1 = _rms(q.decode(q.encode(w, "q1"), "q1", w.shape) - w)
    et = _rms(q.decode(q.encode(w, "q1t"), "q1t", w.shape) - w)
    assert et < e1


def test_q1p_preserves_row_sums_better_than_q1() -> None:
    w = source(32, 256, 6)
    d1 = q.decode(q.encode(w, "q1"), "q1", w.shape)
    dp = q.decode(q.encode(w, "q1p"), "q1", w.shape)
    x = np.ones(256, np.float32)  # slowly varying activation
    assert np.abs(dp @ x - w @ x).mean() < np.abs(d1 @ x - w @ x).mean()


def test_q1t_row_correction_is_one_factor_per_row() -> None:
    # Groups of 16 × 0.01, 14 × 0.005, 2 × 0.001: the legacy candidate (scale = mean |w|)
    # wins, and its scale is below the least-squares level of its support, so α ≈ 1.06.
    rng = np.random.default_rng(2)
    mags = np.array([0.01] * 16 + [0.005] * 14 + [0.001] * 2, np.float32)
    w = np.stack([rng.permutation(mags) for _ in range(64)]).reshape(16, 128)
    w = (w * np.where(rng.random(w.shape) < 0.5, -1, 1)).astype(np.float32)
    a = np.frombuffer(q.encode(w, "q1t"), np.uint8)[:9 * 64].reshape(16, 4, 9)
    b = np.frombuffer(q.encode(w, "q1t", correct=False), np.uint8)[:9 * 64].reshape(16, 4, 9)
    assert np.array_equal(a[..., 2:], b[..., 2:])  # same codes
    sa = a[..., :2].copy().view("<f2").astype(np.float64)[..., 0]
    sb = b[..., :2].copy().view("<f2").astype(np.float64)[..., 0]
    ratio = sa / sb
    assert np.all((ratio > 0.49) & (ratio < 2.01))
    assert np.allclose(ratio, ratio[:, :1], rtol=2e-3)
    assert not np.allclose(ratio, 1.0, atol=1e-4)
