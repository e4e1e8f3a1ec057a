"""Samplers as small composed functions (mlx-lm style).

Logits processors (penalties, logit bias) see the tokens generated so far and return new logits;
the sampler turns logits into one token id. Order (REFERENCE_NOTES §3): logit bias → repetition
penalty → presence/frequency penalties → temperature → softmax → min-p → top-k → top-p →
renormalize → draw. temperature < 1e-6 is greedy (argmax over the processed logits, lowest index
on ties, as transformers does).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

Processor = Callable[[np.ndarray, Sequence[int]], np.ndarray]
Sampler = Callable[[np.ndarray], int]


def logit_bias_processor(bias: Mapping[int, float]) -> Processor:
    ids = np.fromiter((int(k) for k in bias), dtype=np.int64)
    vals = np.fromiter((float(v) for v in bias.values()), dtype=np.float32)

    def apply(logits: np.ndarray, seen: Sequence[int]) -> np.ndarray:
        logits = logits.copy()
        ok = ids < logits.size
        logits[ids[ok]] += vals[ok]
        return logits

    return apply


def repetition_penalty_processor(penalty: float, window: int | None = None) -> Processor:
    """Each distinct seen token: logit / penalty if positive, · penalty otherwise (HF/CTRL)."""

    def apply(logits: np.ndarray, seen: Sequence[int]) -> np.ndarray:
        if not seen:
            return logits
        ctx = seen[-window:] if window else seen
        ids = np.unique(np.asarray(ctx, dtype=np.int64))
        logits = logits.copy()
        sel = logits[ids]
        logits[ids] = np.where(sel > 0, sel / penalty, sel * penalty)
        return logits

    return apply


def presence_frequency_processor(presence: float, frequency: float) -> Processor:
    """OpenAI semantics: subtract ``presence`` once per seen token and ``frequency`` per occurrence."""

    def apply(logits: np.ndarray, seen: Sequence[int]) -> np.ndarray:
        if not seen:
            return logits
        ids, counts = np.unique(np.asarray(seen, dtype=np.int64), return_counts=True)
        logits = logits.copy()
        logits[ids] -= np.float32(presence) + np.float32(frequency) * counts.astype(np.float32)
        return logits

    return apply


def make_logits_processors(*, repetition_penalty: float | None = None, presence_penalty: float = 0.0,
                           frequency_penalty: float = 0.0, logit_bias: Mapping[int, float] | None = None,
                           repetition_window: int | None = None) -> list[Processor]:
    procs: list[Processor] = []
    if logit_bias:
        procs.append(logit_bias_processor(logit_bias))
    if repetition_penalty and repetition_penalty != 1.0:
        procs.append(repetition_penalty_processor(repetition_penalty, repetition_window))
    if presence_penalty or frequency_penalty:
        procs.append(presence_frequency_processor(presence_penalty, frequency_penalty))
    return procs


def softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - np.max(x)
    e = np.exp(z)
    return e / e.sum()


def top_order(p: np.ndarray, k: int) -> np.ndarray:
    """The first ``min(k, p.size)`` or more indices of ``np.argsort(-p, kind="stable")`` (largest
    first, lower index first on ties): every index whose value reaches the k-th largest, sorted.
    Partitioning, then sorting only those, takes ~0.3 ms for a 49k vocabulary where the full
    stable sort took 3.7 (docs/PERFORMANCE.md, "Sampling")."""
    if k >= p.size:
        return np.argsort(-p, kind="stable")
    kth = np.partition(p, p.size - k)[p.size - k]
    cand = np.flatnonzero(p >= kth)  # ascending: a stable sort keeps ties in index order
    return cand[np.argsort(-p[cand], kind="stable")]


def draw(rng: np.random.Generator, q: np.ndarray) -> int:
    """``rng.choice(q.size, p=q)`` for probabilities known to be valid: numpy's own steps (the
    normalized cumulative sum, one ``random()``, a right-side search) without its checks of q,
    which took half of its 0.3 ms over a 49k vocabulary. The same draw for the same generator
    state (tests/test_sampling.py holds it to ``rng.choice``)."""
    cdf = q.cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def make_sampler(temperature: float = 0.0, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None) -> Sampler:
    """A sampler; the same seed gives the same sequence of draws."""
    if temperature < 1e-6:
        def greedy(logits: np.ndarray) -> int:
            return int(np.argmax(logits))

        greedy.greedy = True  # type: ignore[attr-defined]  # deterministic: speculative decoding may verify with it
        return greedy
    rng = np.random.Generator(np.random.PCG64(seed))

    def sample(logits: np.ndarray) -> int:
        p = softmax(logits / np.float32(temperature))
        if min_p > 0:
            p = np.where(p < min_p * p.max(), 0.0, p)
        first = int(np.argmax(p))  # the most likely token, lowest index on ties
        if not np.isfinite(p[first]):  # argmax finds a NaN first; numpy's choice refused these too
            raise ValueError("cannot sample: the logits hold NaN or an infinity")
        # orders are taken among the nonzero probabilities only (zeros, from min-p or top-k,
        # are never kept or drawn; a k-th largest of zero would make every index a candidate)
        nonzero = int(np.count_nonzero(p)) if top_k or top_p < 1.0 else 0
        if top_k and top_k < nonzero:
            keep = top_order(p, top_k)[:top_k]
            kept = np.zeros_like(p)
            kept[keep] = p[keep]
            p, nonzero = kept, top_k
        if top_p < 1.0:
            # the smallest prefix of the sorted probabilities whose mass reaches top_p; sorted
            # only as far as needed (a nucleus is usually a few hundred tokens of the vocabulary)
            total, k = p.sum(), max(1, min(64, nonzero))
            while True:
                order = top_order(p, k)
                cum = np.cumsum(p[order]) / total
                if cum[-1] >= top_p or k >= nonzero:
                    break
                k = min(k * 8, nonzero)
            cut = int(np.searchsorted(cum, top_p, side="left")) + 1
            if cut < nonzero:
                kept = np.zeros_like(p)
                kept[order[:cut]] = p[order[:cut]]
                p = kept
        total = p.sum()
        if total <= 0:
            return first
        return draw(rng, p / total)

    return sample
