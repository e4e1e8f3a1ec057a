"""The sampler's top-k / top-p without a full sort: the same tokens kept and the same draws as
the full stable sort of the probabilities (the REFERENCE_NOTES §3 order)."""

from __future__ import annotations

import numpy as np
import pytest

from cmf.runtime.sampling import draw, make_sampler, softmax, top_order


def _full_sort_sampler(temperature: float, top_k: int, top_p: float, min_p: float, seed: int):
    """The sampler as written with one full ``argsort`` (the oracle)."""
    rng = np.random.Generator(np.random.PCG64(seed))

    def sample(logits: np.ndarray) -> int:
        p = softmax(logits / np.float32(temperature))
        if min_p > 0:
            p = np.where(p < min_p * p.max(), 0.0, p)
        order = np.argsort(-p, kind="stable")
        if top_k and top_k < p.size:
            p[order[top_k:]] = 0.0
        if top_p < 1.0:
            sorted_p = p[order]
            cum = np.cumsum(sorted_p) / sorted_p.sum()
            cut = int(np.searchsorted(cum, top_p, side="left")) + 1
            p[order[cut:]] = 0.0
        total = p.sum()
        if total <= 0:
            return int(order[0])
        return int(rng.choice(p.size, p=p / total))

    return sample


def _logits(rng: np.random.Generator, n: int, ties: bool) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32) * 3
    return np.round(x) if ties else x  # rounded: thousands of equal logits, ties at every cut


@pytest.mark.parametrize("ties", [False, True])
def test_top_order_is_the_stable_sorts_prefix(ties) -> None:
    rng = np.random.default_rng(0)
    for n, k in ((1000, 1), (1000, 17), (49152, 64), (49152, 3000), (50, 50), (50, 80)):
        p = softmax(_logits(rng, n, ties))
        full = np.argsort(-p, kind="stable")
        got = top_order(p, k)
        assert got.size >= min(k, n)
        assert np.array_equal(got, full[:got.size])


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (40, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.999, 0.0),
                                               (20, 0.9, 0.01), (0, 0.5, 0.05), (3, 0.3, 0.0), (1, 1.0, 0.0),
                                               (40, 0.95, 0.0), (100, 0.9, 0.2), (0, 0.9, 0.2), (5000, 0.99, 0.0)])
def test_sampler_draws_equal_the_full_sort(top_k, top_p, min_p, ties) -> None:
    rng = np.random.default_rng(1)
    fast = make_sampler(0.8, top_k=top_k, top_p=top_p, min_p=min_p, seed=7)
    slow = _full_sort_sampler(0.8, top_k, top_p, min_p, 7)
    for _ in range(40):
        logits = _logits(rng, 4096, ties)
        assert fast(logits) == slow(logits)


def test_sampler_keeps_the_nucleus_only() -> None:
    """Four tokens carry 0.97 of the mass: top_p 0.9 draws from them alone, whatever the seed."""
    logits = np.full(1000, -10.0, np.float32)
    logits[[5, 99, 500, 7]] = [6.0, 5.5, 5.0, 4.5]
    for seed in range(30):
        assert make_sampler(1.0, top_p=0.9, seed=seed)(logits) in {5, 99, 500, 7}


def test_draw_is_numpys_choice() -> None:
    """``draw`` gives ``Generator.choice``'s index for the same state, vocabulary sizes and shapes
    of distribution of every kind (many exact zeros, one dominant token, near-uniform)."""
    rng = np.random.default_rng(3)
    for trial in range(120):
        n = int(rng.integers(2, 60000))
        p = rng.random(n) ** [1, 8, 40][trial % 3]
        p[rng.random(n) < 0.5] = 0.0
        p[int(rng.integers(n))] += 1e-6
        q = p / p.sum()
        for seed in range(3):
            a, b = (np.random.Generator(np.random.PCG64(seed)) for _ in range(2))
            assert [int(a.choice(n, p=q)) for _ in range(3)] == [draw(b, q) for _ in range(3)]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf − inf in the softmax
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_sampler_refuses_non_finite_logits(bad) -> None:
    logits = np.zeros(100, np.float32)
    logits[7] = bad
    for kw in ({}, {"top_p": 0.9}, {"top_k": 5}):
        with pytest.raises(ValueError, match="NaN or an infinity"):
            make_sampler(1.0, seed=0, **kw)(logits)
