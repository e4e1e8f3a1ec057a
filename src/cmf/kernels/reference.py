"""The reference matrix product: decode the stored matrix (or the needed rows) and use numpy.

Correct for every dtype, and the oracle fused kernels are tested against. f32 weights are used
as zero-copy views; other dtypes are decoded on each call (nothing is cached, so the resident
memory of a model stays its mapped file).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..format.constants import Dtype


class LinearOp(Protocol):
    """y = x @ W.T for a stored weight W [out, in]."""

    out_features: int
    in_features: int

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x: [in] or [T, in] float32 → [out] or [T, out] float32."""

    def rows(self, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Only output rows ``rows``: x @ W[rows].T."""

    def dense(self) -> np.ndarray:
        """The whole matrix as float32 (for blends and tests)."""


class ReferenceLinear:
    """Decode + numpy. ``tensor`` is a cmf QTensor (zero-copy view into the mmap)."""

    def __init__(self, tensor) -> None:
        if len(tensor.shape) != 2:
            raise ValueError(f"tensor {tensor.name!r} is not a matrix: shape {list(tensor.shape)}")
        self.tensor = tensor
        self.out_features, self.in_features = tensor.shape

    def dense(self) -> np.ndarray:
        t = self.tensor
        buf = t.numpy()
        if t.dtype == Dtype.F32:
            return buf.view("<f4").reshape(t.shape)
        from .. import quant

        return quant.decode(buf, t.dtype, t.shape)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32) @ self.dense().T

    def rows(self, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
        t = self.tensor
        from .. import quant

        w = quant.decode_rows(t.numpy(), t.dtype, t.shape, np.asarray(rows))
        return np.asarray(x, dtype=np.float32) @ w.T


def prepare_reference(tensor) -> ReferenceLinear:
    return ReferenceLinear(tensor)


def int8_activations(x: np.ndarray) -> np.ndarray:
    """x as the int8-activation kernels see it (``xprep.quantize_x``), dequantized: per group of 32
    features d = max|x|/127 and x̂ = rint(x·(1/d))·d, all in float32. The oracle for
    ``TiledLinear.use_int8_activations``: its rows equal ``decode(W) @ x̂`` (whole 64-row tiles;
    rows past the last whole tile use x itself)."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    g = a.reshape(*a.shape[:-1], -1, 32)
    d = (np.abs(g).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint((g * inv).astype(np.float32))
    return (q * d).astype(np.float32).reshape(a.shape)
