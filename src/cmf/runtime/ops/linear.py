"""Matrix products of the runtime: blocks of tokens through the threaded dequantize + sgemm kernels."""

from __future__ import annotations

import numpy as np

from ...kernels import gemm

# Above this many tokens a product dequantizes rows and multiplies them with sgemm; at or below
# it the fused mat-vec kernels read the quantized bytes once per token block (kernels/_base.py).
GEMM_MIN_T = 4


def mm(op, x: np.ndarray) -> np.ndarray:  # noqa: ANN001 - a LinearOp
    """``x @ W.T`` for x [in] or [T, in]: prefill-sized blocks through :func:`cmf.kernels.gemm.matmul`
    (one thread pool, per-thread tiles), everything else through the op itself."""
    if x.ndim == 2 and x.shape[0] > min(GEMM_MIN_T, getattr(op, "fused_max_t", GEMM_MIN_T)) and gemm.supported(op):
        return gemm.matmul(op, x)
    return op(x)
