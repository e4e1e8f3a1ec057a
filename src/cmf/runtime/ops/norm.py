"""RMSNorm in the two styles of the format (spec §2 ``norm_style``), numpy form.

The decoder layers do not run this module: every layer's norms — the one-token step (step.py,
batched.py) and blocks of tokens (``rowwise.rms_norm_rows``, blocks.py) — go through one kernel,
``ops/decode.rms_norm_into``, so a layer's norm has the same bits at any T. Two implementations
remain on purpose. :func:`rms_norm_prepared` here is the numpy oracle the kernels are tested
against, and it still serves the final norm of a block of tokens (model.py), MLA's latent norms
(blocks.py) and the MTP head (speculative.py). ``np.mean`` sums the float64 squares pairwise, the
kernel sequentially: the float64 means differ in their last bits, and in rare rows the float32
scale ``1/√(ms + eps)`` then differs by one ulp (the tests allow two). Moving those callers to the
kernel would change prefill logits, MLA and MTP outputs at that level, so they stay (issue 27).
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
