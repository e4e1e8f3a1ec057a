"""Multi-head latent attention over a compressed cache (DeepSeek-V2/V3).

Per position the cache holds the normalised latent c ∈ R^rank and the rotated rope key
k_rot ∈ R^rope shared by all heads. With kv_b split per head into W_k [nope, rank] and
W_v [v, rank], the expanded attention

    score(t, s) = q_nope·(W_k c_s) + q_rot·k_rot_s,   out_t = Σ_s p(t, s)·(W_v c_s)

is evaluated with kv_b absorbed: q_lat = W_kᵀ q_nope, score = q_lat·c_s + q_rot·k_rot_s,
out = W_v (Σ_s p·c_s). Same values, without ever materialising per-head keys or values.
"""

from __future__ import annotations

import numpy as np


def deinterleave(x: np.ndarray) -> np.ndarray:
    """Reorder the last axis (x0, x1, x2, x3, …) → (x0, x2, …, x1, x3, …).

    DeepSeek rotates interleaved pairs (2i, 2i+1). Applying the same permutation to queries and
    keys leaves their dot products unchanged and turns those pairs into the half-split pairs
    (i, i + d/2) that :func:`~cmf.runtime.ops.rope.apply_rope` rotates.
    """
    return np.ascontiguousarray(np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1))


def latent_attend(q_nope: np.ndarray, q_rot: np.ndarray, latents: np.ndarray, k_rot: np.ndarray,
                  w_k: np.ndarray, w_v: np.ndarray, q_pos0: int, k_pos0: int, scale: float) -> np.ndarray:
    """q_nope [T, H, nope], q_rot [T, H, rope], latents [S, rank], k_rot [S, rope],
    w_k [H, nope, rank], w_v [H, v, rank] → [T, H, v]. Causal: query t sits at q_pos0 + t."""
    t = q_nope.shape[0]
    s = latents.shape[0]
    q_lat = np.matmul(np.ascontiguousarray(q_nope.transpose(1, 0, 2)), w_k)  # [H, T, rank]
    scores = np.matmul(q_lat, latents.T) + np.matmul(q_rot.transpose(1, 0, 2), k_rot.T)  # [H, T, S]
    scores *= np.float32(scale)
    qp = q_pos0 + np.arange(t)[:, None]
    kp = k_pos0 + np.arange(s)[None, :]
    visible = kp <= qp
    if not visible.all():
        scores = np.where(visible[None], scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    o_lat = np.matmul(scores, latents)  # [H, T, rank]
    out = np.matmul(o_lat, w_v.transpose(0, 2, 1))  # [H, T, v]
    return np.ascontiguousarray(out.transpose(1, 0, 2)).astype(np.float32, copy=False)
