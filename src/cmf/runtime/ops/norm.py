"""RMSNorm in the two styles of the format (spec §2 ``norm_style``): the weight folding done at
load, and the numpy reference.

The runtime does not normalise with this module: every RMSNorm — a layer's norms at any T, the
final norm (model.py), MLA's latent norms (blocks.py), the MTP head (speculative.py) — runs one
kernel, ``ops/decode.rms_norm_into`` (blocks of tokens through ``rowwise.rms_norm_rows``).
:func:`rms_norm_prepared` is the reference it is tested equal to, bit for bit: the kernel adds
the float64 squares in the order ``np.mean`` does (numpy's pairwise sum).
(``gdn.gated_rms_norm`` is a different operator: a silu gate, the stored weight as is.)
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, gemma: bool) -> np.ndarray:
    """y = x / sqrt(mean(x²) + eps) · w ("qwen") or · (1 + w) ("gemma"): :func:`rms_norm_prepared`
    of the folded weight (the same float32 values as multiplying by ``1 + w`` here).

    The mean of squares is accumulated in float64 (REFERENCE_NOTES §3): it removes the summation
    order from the result, so chunked and whole-sequence runs agree to the bit.
    """
    return rms_norm_prepared(x, prepare_norm_weight(weight, gemma), eps)


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
