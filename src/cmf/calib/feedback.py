"""GPTQ-style rounding with error feedback over an input Hessian, at fixed scales.

Given a matrix W (rows × cols), per-element scales S (the group scales an encoder chose), the
dtype's level set and H = E[x xᵀ] of the matrix's inputs, the columns are rounded one at a time
and each column's rounding error is spread over the columns not yet rounded, weighted by the
inverse Hessian (Frantar et al., "GPTQ", 2022: the optimal-brain-surgeon update with a Cholesky
factor of H⁻¹, in blocks of 128 columns). The output error ``(W - Q) x`` on the calibration
inputs is what shrinks, not ``W - Q`` itself. The scales stay those given, so the result packs
into the dtype's unchanged layout.
"""

from __future__ import annotations

import logging

import numpy as np
from numba import njit, prange

log = logging.getLogger(__name__)

BLOCK = 128
DAMP = 0.01  # λ = DAMP · mean(diag H): the usual GPTQ damping; retried ×10 if H is not positive definite


def inverse_cholesky(h: np.ndarray) -> np.ndarray | None:
    """Upper Cholesky factor U of (H + λI)⁻¹ (so H⁻¹ = Uᵀ U), f64; None when H is degenerate.

    Without forming H⁻¹: with J the order reversal, J(H + λI)J = M Mᵀ (M lower), so
    H + λI = R Rᵀ with R = J M J upper, and U = R⁻¹ = J M⁻¹ J. One Cholesky and one triangular
    inverse (n³/3 + ~2n³/3 flops, all BLAS-3) where an explicit inverse and a second Cholesky
    took ~2.3n³: 2.7–3× faster at n = 576–3072 (docs/QUANT.md, "Calibration")."""
    h = np.array(h, np.float64)
    d = np.diag(h)
    dead = d <= 0
    h[dead, dead] = 1.0
    mean = float(d[~dead].mean()) if (~dead).any() else 1.0
    diag = np.diag_indices(h.shape[0])
    for k in range(4):
        lam = DAMP * (10 ** k) * mean
        damped = h.copy()
        damped[diag] += lam  # no n×n identity beside it: the largest Hessians are ~1 GB in f64
        try:
            m = np.linalg.cholesky(damped[::-1, ::-1])  # fails unless H + λI is positive definite
        except np.linalg.LinAlgError:
            continue
        # For H ⪰ 0 every pivot² is at least λ (the Schur complements of H + λI keep its smallest
        # eigenvalue as a floor); a smaller one means H is indefinite and the factor would be
        # huge where rounding let the factorization through: damp more instead.
        if float(np.diag(m).min()) ** 2 < 0.5 * lam:
            continue
        u = _lower_inverse(m)[::-1, ::-1]
        if np.isfinite(u).all():
            return np.ascontiguousarray(u)
    return None


def _lower_inverse(m: np.ndarray) -> np.ndarray:
    """M⁻¹ for lower-triangular M with a positive diagonal, by halves: [[A, 0], [C, D]]⁻¹ =
    [[A⁻¹, 0], [−D⁻¹ C A⁻¹, D⁻¹]] (matrix products, which BLAS runs at full speed; numpy has
    no triangular inverse)."""
    n = m.shape[0]
    if n <= 64:
        return np.tril(np.linalg.inv(m))  # exactly triangular: LU leaves ~1e-16 above the diagonal
    k = n // 2
    a, dd = _lower_inverse(m[:k, :k]), _lower_inverse(m[k:, k:])
    out = np.zeros((n, n), np.float64)
    out[:k, :k] = a
    out[k:, k:] = dd
    out[k:, :k] = -(dd @ (m[k:, :k] @ a))
    return out


_KINDS = {"q4": (-8.0, 7.0), "q2": (-1.5, 1.5), "q8": (-128.0, 127.0)}


@njit(cache=True, nogil=True)
def _level(r: float, two_bit: bool, lo: float, hi: float) -> float:
    if two_bit:  # ±0.5, ±1.5
        return min(max(np.floor(r) + 0.5, lo), hi)
    return min(max(np.rint(r), lo), hi)


@njit(cache=True, nogil=True, parallel=True)
def _round_block(w1: np.ndarray, s1: np.ndarray, u1: np.ndarray, two_bit: bool, lo: np.ndarray,
                 hi: np.ndarray, levels: np.ndarray, err: np.ndarray) -> None:
    """One block of columns, row by row (rows are independent within GPTQ's update)."""
    rows, b = w1.shape
    for r in prange(rows):
        for i in range(b):
            x = w1[r, i]
            s = s1[r, i]
            q = _level(x / s, two_bit, lo[r], hi[r]) if s != 0.0 else 0.0
            e = (x - q * s) / u1[i, i]
            for j in range(i + 1, b):
                w1[r, j] -= e * u1[i, j]
            levels[r, i] = q
            err[r, i] = e


def round_levels(w: np.ndarray, s: np.ndarray, kind: str) -> np.ndarray:
    """Nearest level of each ``w / s`` (level values, not codes); ``s == 0`` gives 0.

    ``kind``: ``"q4"`` (-8..7), ``"q2"`` (±0.5, ±1.5), ``"q8"`` (-128..127)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(s != 0, w / s, 0.0)
    if kind == "q4":
        q = np.clip(np.rint(r), -8, 7)
    elif kind == "q8":
        q = np.clip(np.rint(r), -128, 127)
    elif kind == "q2":
        q = np.clip(np.floor(r) + 0.5, -1.5, 1.5)
    else:
        raise ValueError(f"unknown level kind {kind!r}")
    return np.where(s != 0, q, 0.0)


def gptq_levels(w: np.ndarray, scales: np.ndarray, hessian: np.ndarray, kind: str,
                act_order: bool = True, factor: np.ndarray | None = None,
                bounds: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray | None:
    """Levels (rows × cols, f32 level values) for W at per-element ``scales`` under ``hessian``.

    ``kind``: ``"q4"`` (-8..7), ``"q8"`` (-128..127), ``"q2"`` (±0.5, ±1.5) or ``"int"``: integers
    within per-row ``bounds`` = (lowest, highest) level, e.g. vbit's ``-L .. L+1`` per row width.
    ``act_order``: columns are rounded in decreasing order of diag(H) (the most excited inputs
    first, while the most freedom is left to absorb their error), as GPTQ's act-order; the scales
    being fixed beforehand, the order changes no layout. ``factor``: :func:`inverse_cholesky` of
    the (permuted) Hessian when the caller has it (matrices sharing an input share it). None when
    the Hessian is degenerate beyond damping (the caller keeps its plain rounding)."""
    rows = w.shape[0]
    if kind == "int":
        if bounds is None:
            raise ValueError("kind 'int' needs bounds=(lowest, highest) levels per row")
        lo, hi = (np.broadcast_to(np.asarray(b, np.float64), (rows,)).copy() for b in bounds)
    elif kind in _KINDS:
        lo, hi = (np.full(rows, v, np.float64) for v in _KINDS[kind])
    else:
        raise ValueError(f"unknown level kind {kind!r}")
    perm = order(hessian) if act_order else np.arange(hessian.shape[0])
    u = factor if factor is not None else inverse_cholesky(hessian[np.ix_(perm, perm)])
    if u is None:
        return None
    w = np.array(w[:, perm], np.float64)
    s = np.ascontiguousarray(scales[:, perm], np.float64)
    rows, cols = w.shape
    levels = np.empty((rows, cols), np.float64)
    for i1 in range(0, cols, BLOCK):
        i2 = min(i1 + BLOCK, cols)
        w1 = np.ascontiguousarray(w[:, i1:i2])
        err1 = np.empty_like(w1)
        lv = np.empty_like(w1)
        _round_block(w1, np.ascontiguousarray(s[:, i1:i2]), np.ascontiguousarray(u[i1:i2, i1:i2]),
                     kind == "q2", lo, hi, lv, err1)
        levels[:, i1:i2] = lv
        if i2 < cols:
            w[:, i2:] -= err1 @ u[i1:i2, i2:]
    out = np.empty((rows, cols), np.float32)
    out[:, perm] = levels
    return out


def order(hessian: np.ndarray) -> np.ndarray:
    """Act-order: input features by decreasing diag(H)."""
    return np.argsort(-np.diag(hessian), kind="stable")


def output_error(w: np.ndarray, wq: np.ndarray, hessian: np.ndarray) -> float:
    """tr((W - Q) H (W - Q)ᵀ): the mean squared output error on the calibration inputs."""
    d = np.asarray(w, np.float64) - np.asarray(wq, np.float64)
    return float(((d @ np.asarray(hessian, np.float64)) * d).sum())
