"""Grouped-query causal attention over a KV cache, with sliding windows and soft-capping."""

from __future__ import annotations

import numpy as np


def attend(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, q_pos0: int, k_pos0: int, *,
           scale: float, window: int | None = None, softcap: float | None = None) -> np.ndarray:
    """q [T, H, D], keys [S, KV, D], vals [S, KV, Dv] → [T, H, Dv].

    Query t sits at absolute position q_pos0 + t, key s at k_pos0 + s. A key is visible when it is
    not in the future and, for sliding layers, when q_pos - k_pos < window (HF semantics).
    """
    t, h, d = q.shape
    s, kvh, _ = keys.shape
    group = h // kvh
    qg = q.reshape(t, kvh, group, d).transpose(1, 2, 0, 3)  # [KV, G, T, D]
    kt = keys.transpose(1, 2, 0)[:, None]  # [KV, 1, D, S]
    scores = np.matmul(qg, kt) * np.float32(scale)  # [KV, G, T, S]
    if softcap:
        c = np.float32(softcap)
        scores = np.tanh(scores / c) * c
    qp = q_pos0 + np.arange(t)[:, None]
    kp = k_pos0 + np.arange(s)[None, :]
    visible = kp <= qp
    if window is not None:
        visible &= (qp - kp) < window
    if not visible.all():
        scores = np.where(visible[None, None], scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, vals.transpose(1, 0, 2)[:, None])  # [KV, G, T, Dv]
    return out.transpose(2, 0, 1, 3).reshape(t, h, vals.shape[-1])
