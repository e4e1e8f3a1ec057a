"""One query's attention in vector IR (runtime/ops/attend_ir.py) against a float64 reference:
every tail length of a lane block, grouped and ungrouped heads, head dims with 1, 2 and 4
output chunks in registers, float32 and f16 caches, windows, cache offsets, soft-capping, the
split-across-threads form, and the scalar fallback for rows the vector bodies cannot read."""

from __future__ import annotations

import numpy as np
import pytest

from cmf.runtime.ops.attend_ir import LANES, SCRATCH_DIM, head_dots, weigh_rows1
from cmf.runtime.ops.decode import attend_one, attend_one_par, padded


def _reference(q, keys, vals, pos, k0, scale, window=0, softcap=0.0):  # noqa: ANN001, ANN202
    H, KV = q.shape[0], keys.shape[1]
    group = H // KV
    k = keys.view(np.float16).astype(np.float64) if keys.dtype == np.uint16 else keys.astype(np.float64)
    v = vals.view(np.float16).astype(np.float64) if vals.dtype == np.uint16 else vals.astype(np.float64)
    hi = min(keys.shape[0], pos - k0 + 1)
    lo = max(0, pos - window + 1 - k0) if window else 0
    out = np.zeros((H, vals.shape[2]))
    for j in range(H):
        s = k[lo:hi, j // group] @ q[j].astype(np.float64) * scale
        if softcap:
            s = np.tanh(s / softcap) * softcap
        w = np.exp(s - s.max())
        out[j] = (w / w.sum()) @ v[lo:hi, j // group]
    return out


def _case(rng, n, H, KV, D, dtype):  # noqa: ANN001, ANN202
    q = rng.standard_normal((H, D)).astype(np.float32)
    keys = rng.standard_normal((n, KV, D)).astype(np.float32)
    vals = rng.standard_normal((n, KV, D)).astype(np.float32)
    if dtype == "f16":
        keys, vals = (a.astype(np.float16).view(np.uint16) for a in (keys, vals))
    return q, keys, vals


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("H,KV,D", [(9, 3, 64), (4, 4, 2 * LANES), (6, 2, 3 * LANES), (8, 2, 128)])
def test_attend_one_matches_the_reference_for_every_tail(dtype: str, H: int, KV: int, D: int) -> None:
    rng = np.random.default_rng(D + H)
    for n in (1, 2, LANES - 1, LANES, LANES + 1, 31, 32, 33, 2 * LANES + 3, 97):
        q, keys, vals = _case(rng, n, H, KV, D, dtype)
        out = np.full((H, D), np.nan, np.float32)
        attend_one(q, keys, vals, n - 1, 0, D ** -0.5, 0, 0.0, out)
        np.testing.assert_allclose(out, _reference(q, keys, vals, n - 1, 0, D ** -0.5), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("H,KV,D", [(9, 3, 64), (16, 2, 128), (4, 1, SCRATCH_DIM), (4, 2, 2 * SCRATCH_DIM),
                                     (8, 8, 64), (6, 3, LANES)])
def test_an_f16_cache_gives_the_bits_of_its_float32_values(H: int, KV: int, D: int) -> None:
    """f16 rows are widened once per block for a group of query heads (when the row fits the
    stack buffer and the group has more than one head) or by each head itself: either way the
    output equals, bit for bit, attention over a float32 cache holding the same (exact) values."""
    rng = np.random.default_rng(H * D + KV)
    for n in (1, LANES - 1, LANES + 1, 33, 70):
        q, keys, vals = _case(rng, n, H, KV, D, "f16")
        wide = [a.view(np.float16).astype(np.float32) for a in (keys, vals)]
        got, want = np.empty((H, D), np.float32), np.empty((H, D), np.float32)
        for window, k0 in ((0, 0), (20, 3)):
            attend_one(q, keys, vals, n - 1 + k0, k0, D ** -0.5, window, 0.0, got)
            attend_one(q, wide[0], wide[1], n - 1 + k0, k0, D ** -0.5, window, 0.0, want)
            assert np.array_equal(got, want), (H, KV, D, n, window)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_windows_offsets_and_softcap(dtype: str) -> None:
    rng = np.random.default_rng(3)
    H, KV, D, n = 8, 2, 64, 70
    q, keys, vals = _case(rng, n, H, KV, D, dtype)
    for pos, k0, window, softcap in ((69, 0, 0, 0.0), (75, 6, 0, 0.0), (69, 0, 20, 0.0), (75, 6, 17, 0.0),
                                     (69, 0, 0, 5.0), (75, 6, 33, 2.0), (40, 0, 0, 0.0)):
        out = np.empty((H, D), np.float32)
        attend_one(q, keys, vals, pos, k0, 0.3, window, softcap, out)
        want = _reference(q, keys, vals, pos, k0, 0.3, window, softcap)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6, err_msg=str((pos, k0, window, softcap)))


def test_the_split_form_agrees_with_the_serial_one() -> None:
    rng = np.random.default_rng(4)
    H, KV, D, n = 8, 2, 64, 301
    q, keys, vals = _case(rng, n, H, KV, D, "f32")
    serial, split = np.empty((H, D), np.float32), np.empty((H, D), np.float32)
    attend_one(q, keys, vals, n - 1, 0, 0.125, 0, 0.0, serial)
    for nt in (2, 3, 7):
        attend_one_par(q, keys, vals, n - 1, 0, 0.125, 0, 0.0, split, nt)
        np.testing.assert_allclose(split, serial, rtol=1e-5, atol=1e-6)


def test_rows_the_vector_bodies_cannot_read_take_the_scalar_loops() -> None:
    """A head dim that is no multiple of the lane width, and a query with strided rows, give the
    same attention through the scalar loops."""
    rng = np.random.default_rng(5)
    q, keys, vals = _case(rng, 40, 4, 2, 12, "f32")
    out = np.empty((4, 12), np.float32)
    attend_one(q, keys, vals, 39, 0, 0.5, 0, 0.0, out)
    np.testing.assert_allclose(out, _reference(q, keys, vals, 39, 0, 0.5), rtol=2e-5, atol=2e-6)
    q2, keys2, vals2 = _case(rng, 40, 4, 2, 64, "f32")
    strided = np.empty((4, 128), np.float32)[:, ::2]
    strided[...] = q2
    out = np.empty((4, 64), np.float32)
    attend_one(strided, keys2, vals2, 39, 0, 0.5, 0, 0.0, out)
    np.testing.assert_allclose(out, _reference(q2, keys2, vals2, 39, 0, 0.5), rtol=2e-5, atol=2e-6)


def test_head_dots_writes_whole_blocks_and_the_live_maximum() -> None:
    """Scores of every head, the last block's spare lanes written (p is padded) but left out of
    the maximum; weigh_rows sums the weighted value rows of each head's kv head."""
    import numba

    @numba.njit
    def run(q, keys, vals, group, lo, n, p, mx, out):  # noqa: ANN001, ANN202
        head_dots(q, keys, group, lo, n, np.float32(0.5), p, mx)
        weigh_rows1(p, vals, group, lo, n, out)

    rng = np.random.default_rng(6)
    H, KV, D = 4, 2, 2 * LANES
    q, keys, vals = _case(rng, 50, H, KV, D, "f32")
    for lo, n in ((0, 1), (3, LANES + 1), (7, 40), (0, 0)):
        p = np.full((H, padded(n)), 7.0, np.float32)
        mx = np.zeros(H, np.float32)
        out = np.full((H, D), np.nan, np.float32)
        run(q, keys, vals, 2, lo, n, p, mx, out)
        for j in range(H):
            s = keys[lo:lo + n, j // 2].astype(np.float64) @ q[j] * 0.5
            np.testing.assert_allclose(p[j, :n], s, rtol=1e-5, atol=1e-5)
            assert mx[j] == (p[j, :n].max() if n else -np.inf)
            want = p[j, :n].astype(np.float64) @ vals[lo:lo + n, j // 2]
            np.testing.assert_allclose(out[j], want, rtol=1e-4, atol=1e-4)
