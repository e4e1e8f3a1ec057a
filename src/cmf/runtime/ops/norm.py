"""RMSNorm in the two styles of the format (spec §2 ``norm_style``)."""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, gemma: bool) -> np.ndarray:
    """y = x / sqrt(mean(x²) + eps) · w ("qwen") or · (1 + w) ("gemma").

    The mean of squares is accumulated in float64 (REFERENCE_NOTES §3): it removes the summation
    order from the result, so chunked and whole-sequence runs agree to the bit.
    """
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    inv = (1.0 / np.sqrt(ms + eps)).astype(np.float32)
    y = x * inv
    if weight is None:
        return y
    return y * (1.0 + weight) if gemma else y * weight


def prepare_norm_weight(w: np.ndarray | None, gemma: bool) -> np.ndarray | None:
    """Fold the gemma ``1 + w`` into the stored weight once, at load time."""
    if w is None:
        return None
    w = np.asarray(w, dtype=np.float32)
    return (1.0 + w).astype(np.float32) if gemma else w


def rms_norm_prepared(x: np.ndarray, scale: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm with an already folded scale (see :func:`prepare_norm_weight`)."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    y = x * (1.0 / np.sqrt(ms + eps)).astype(np.float32)
    return y if scale is None else y * scale
