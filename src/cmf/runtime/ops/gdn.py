"""Gated DeltaNet, the linear-attention mixer of Qwen3-Next / Qwen3.5 (REFERENCE_NOTES §3).

Per layer: qkv = causal depthwise conv (kernel K) + SiLU over ``in_proj_qkv·x``; q, k
L2-normalised per head, q scaled by 1/√dk; decay g = −exp(A_log)·softplus(a + dt_bias), β =
sigmoid(b); per value head h a state S[h] ∈ R^{dk×dv}:

    S ← S·exp(g);  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq

then a gated RMSNorm over dv, ``w·norm(o)·silu(z)``, and ``out_proj``. Key heads serve
``nv/nk`` consecutive value heads. Two evaluations of the same recurrence: token by token
(decode, and whenever per-position states are needed for a speculative rollback) and chunked
(prefill: the delta-rule updates of a chunk condensed into triangular solves and matmuls).
"""

from __future__ import annotations

import numpy as np

CHUNK = 64


def causal_conv(x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU. x [T, C], state [K-1, C] (the previous inputs), weight [C, K].

    Returns (y [T, C], new state [K-1, C]).
    """
    k = weight.shape[1]
    t = x.shape[0]
    xp = np.concatenate([state, x], axis=0)  # [K-1+T, C]
    y = np.zeros_like(x, dtype=np.float32)
    for j in range(k):
        y += xp[j:j + t] * weight[:, j]
    y = y / (1.0 + np.exp(-y))
    return y.astype(np.float32), np.ascontiguousarray(xp[t:])


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(Σx² + eps) over the last axis (the FLA / transformers form)."""
    return (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))).astype(np.float32)


def gates(a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log-decay g [T, H], β [T, H]) from the a/b projections."""
    x = a + dt_bias
    softplus = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    g = -np.exp(a_log.astype(np.float32)) * softplus
    beta = 1.0 / (1.0 + np.exp(-b))
    return g.astype(np.float32), beta.astype(np.float32)


def delta_rule_steps(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state: np.ndarray, states_out: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token by token. q, k [T, H, dk] (normalised, q scaled), v [T, H, dv], g/β [T, H], state [H, dk, dv].

    ``states_out``, when given, receives a copy of the state after every token.
    """
    t = q.shape[0]
    out = np.empty(v.shape, dtype=np.float32)
    s = state.astype(np.float32, copy=True)
    decay = np.exp(g)
    for i in range(t):
        s *= decay[i][:, None, None]
        kv_mem = np.einsum("hkv,hk->hv", s, k[i])
        delta = (v[i] - kv_mem) * beta[i][:, None]
        s += k[i][:, :, None] * delta[:, None, :]
        out[i] = np.einsum("hkv,hk->hv", s, q[i])
        if states_out is not None:
            states_out.append(s.copy())
    return out, s


def delta_rule_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       state: np.ndarray, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """The same recurrence over chunks of ``chunk`` tokens (shapes as :func:`delta_rule_steps`).

    Inside a chunk, the sequential delta updates form a unit lower-triangular system
    (I + tril(βK·Kᵀ ⊙ decay, −1))·U = βV, solved once per chunk; the state then advances by one
    matmul per chunk. Padding tokens carry β = 0 and g = 0, so they leave the state unchanged.
    """
    t, h, dk = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def chunks(x: np.ndarray) -> np.ndarray:  # [T, H, ...] -> [H, N, C, ...]
        x = np.moveaxis(x, 1, 0)
        if pad:
            x = np.concatenate([x, np.zeros((h, pad) + x.shape[2:], np.float32)], axis=1)
        return x.reshape((h, n, chunk) + x.shape[2:])

    qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    k_beta = kc * bc[..., None]
    v_beta = vc * bc[..., None]
    cum = np.cumsum(gc, axis=-1)  # [H, N, C]
    lower = np.tril(np.ones((chunk, chunk), dtype=bool))
    diff = cum[..., :, None] - cum[..., None, :]
    pair = np.exp(np.where(lower, diff, -np.inf)).astype(np.float32)  # decay from j to i, j ≤ i
    a = (k_beta @ np.swapaxes(kc, -1, -2)) * pair
    system = np.tril(a, -1) + np.eye(chunk, dtype=np.float32)
    u = np.linalg.solve(system, v_beta).astype(np.float32)
    w = np.linalg.solve(system, k_beta * np.exp(cum)[..., None]).astype(np.float32)
    intra = (qc @ np.swapaxes(kc, -1, -2)) * pair
    q_dec = qc * np.exp(cum)[..., None]
    k_dec = kc * np.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = np.exp(cum[..., -1])  # [H, N]
    s = state.astype(np.float32, copy=True)
    out = np.empty((h, n, chunk, dv), dtype=np.float32)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i][:, None, None] + np.swapaxes(k_dec[:, i], -1, -2) @ v_new
    out = out.reshape(h, n * chunk, dv)[:, :t]
    return np.ascontiguousarray(np.moveaxis(out, 0, 1)), s


def gated_rms_norm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """w·x/√(mean x² + eps)·silu(z) over the last axis (the stored weight is used as is)."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    y = x * (1.0 / np.sqrt(ms + eps)).astype(np.float32) * weight
    return (y * (z / (1.0 + np.exp(-z)))).astype(np.float32)


def split_heads(qkv: np.ndarray, nk: int, nv: int, dk: int, dv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The conv output [T, 2·nk·dk + nv·dv] → q, k [T, nv, dk] (key heads repeated per value
    group, L2-normalised, q scaled by 1/√dk) and v [T, nv, dv]."""
    t = qkv.shape[0]
    kd = nk * dk
    q = qkv[:, :kd].reshape(t, nk, dk)
    k = qkv[:, kd:2 * kd].reshape(t, nk, dk)
    v = np.ascontiguousarray(qkv[:, 2 * kd:].reshape(t, nv, dv))
    q = l2norm(q) * np.float32(dk ** -0.5)
    k = l2norm(k)
    if nv != nk:
        q = np.repeat(q, nv // nk, axis=1)
        k = np.repeat(k, nv // nk, axis=1)
    return q.astype(np.float32), k.astype(np.float32), v
