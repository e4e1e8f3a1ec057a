"""Mixture-of-experts routing and the expert sum (spec §2.2, REFERENCE_NOTES §3 "FFN / MoE").

Routing, per token:

1. scores p = softmax over ALL router logits, or an independent sigmoid per expert;
2. selection score s = p (+ ``expert_bias``, which steers selection only, never the weights);
3. experts outside the admitted set (runtime mask, task mask) are excluded from selection — p
   itself stays normalised over all experts, as the reference engine does;
4. group-limited top-k (DeepSeek-V3, GLM-4.5): a group scores the sum of its best two s; only
   the ``topk_group`` best groups stay candidates;
5. top-k by s, ties to the lower index;
6. weight_e = p_e · scaling / (Σ_kept p (+1e-6 with sigmoid)) when ``norm_topk_prob``, else
   p_e · scaling.

The 1e-6 of step 6 is the reference engine's (REFERENCE_NOTES §3); transformers adds 1e-20 — the
difference is below 1e-6 relative, far inside parity tolerance, and we follow the notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

_NEG_INF = np.float32(-np.inf)


@dataclass(frozen=True)
class Routing:
    """How one MoE layer picks its experts (all header/tensor-derived, see plan_moe.py)."""

    top_k: int
    sigmoid: bool = False
    norm_topk_prob: bool = False
    scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1


def router_scores(logits: np.ndarray, sigmoid: bool) -> np.ndarray:
    """p: softmax over all experts (float32, as transformers), or per-expert sigmoid."""
    logits = np.asarray(logits, dtype=np.float32)
    if sigmoid:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def _group_limit(s: np.ndarray, n_group: int, topk_group: int) -> np.ndarray:
    """Keep only the experts of the ``topk_group`` best groups (group score: sum of its top two)."""
    t, e = s.shape
    g = s.reshape(t, n_group, e // n_group)
    top = -np.sort(-g, axis=-1)[..., :2]
    finite = np.isfinite(top)
    gs = np.where(finite, top, 0).sum(axis=-1)
    gs[~finite.any(axis=-1)] = -np.inf  # a group with no admitted expert can never be chosen
    keep_groups = np.argsort(-gs, axis=-1, kind="stable")[:, :topk_group]
    keep = np.zeros((t, n_group), dtype=bool)
    np.put_along_axis(keep, keep_groups, True, axis=-1)
    return np.where(np.repeat(keep, e // n_group, axis=-1), s, _NEG_INF)


def route(logits: np.ndarray, r: Routing, *, bias: np.ndarray | None = None,
          allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids [T, k], weights [T, k] float32) for router logits [T, E].

    ``allowed`` (bool [E]) restricts the candidates; ``k`` is ``top_k`` clamped to the number of
    admitted experts. A slot left without a finite candidate (only possible when groups and masks
    leave fewer than k experts) gets weight 0.
    """
    p = router_scores(logits, r.sigmoid)
    t, e = p.shape
    s = p + bias.astype(np.float32) if bias is not None else p.copy()
    n_ok = e
    if allowed is not None:
        s = np.where(allowed[None, :], s, _NEG_INF)
        n_ok = int(allowed.sum())
    if r.n_group > 1:
        s = _group_limit(s, r.n_group, r.topk_group)
    k = max(1, min(r.top_k, n_ok))
    # A stable sort on -s keeps the lower index first among equal scores.
    idx = np.argsort(-s, axis=-1, kind="stable")[:, :k]
    valid = np.isfinite(np.take_along_axis(s, idx, axis=-1))
    w = np.where(valid, np.take_along_axis(p, idx, axis=-1), np.float32(0))
    if r.norm_topk_prob:
        denom = w.sum(axis=-1, keepdims=True, dtype=np.float32)
        if r.sigmoid:
            denom = denom + np.float32(1e-6)
        w = w / np.where(denom > 0, denom, np.float32(1))
    if r.scaling != 1.0:
        w = w * np.float32(r.scaling)
    return idx, w.astype(np.float32)


def expert_mix(x: np.ndarray, idx: np.ndarray, w: np.ndarray,
               expert: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
    """Σ_k w·FFN_e(x) with tokens grouped by expert: each selected expert runs once on its tokens.

    ``expert(e, rows)`` computes expert ``e`` on a [n, hidden] batch. Experts nobody selected are
    never called, so their weights are never read.
    """
    out = np.zeros_like(x, dtype=np.float32)
    if x.shape[0] == 1:  # decode: the k experts of the one token, nothing else
        for e, we in sorted(zip(idx[0].tolist(), w[0].tolist())):  # expert order, as the batched path
            if we != 0.0:
                out[0] += expert(e, x)[0] * np.float32(we)
        return out
    for e in np.unique(idx).tolist():
        tok, slot = np.nonzero(idx == e)
        ww = w[tok, slot]
        if not ww.any():
            continue
        # A token selects an expert at most once, so `tok` has no repeats and += is exact.
        out[tok] += expert(e, x[tok]) * ww[:, None]
    return out


def expert_counts(idx: np.ndarray, w: np.ndarray, n_experts: int) -> np.ndarray:
    """Selection counts per expert (slots with weight 0 were not really selected)."""
    return np.bincount(idx[w != 0].ravel(), minlength=n_experts).astype(np.int64)


def cover_mask(counts: np.ndarray, cover: float) -> np.ndarray:
    """The smallest top expert set reaching ``cover`` of the routing mass (spec §11.1), as bool [E].

    Ties in count keep the lower index first; a layer with no recorded mass keeps every expert.
    """
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    keep = np.zeros(counts.size, dtype=bool)
    if total <= 0:
        keep[:] = True
        return keep
    order = np.argsort(-counts, kind="stable")
    cum = np.cumsum(counts[order]) / total
    # Small tolerance so cover=1.0 keeps exactly the experts with mass despite rounding.
    n = int(np.searchsorted(cum, min(cover, 1.0) - 1e-12, side="left")) + 1
    keep[order[:min(n, counts.size)]] = True
    return keep
