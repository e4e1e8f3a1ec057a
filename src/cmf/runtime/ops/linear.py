"""Matrix products of the runtime: f32 blocks of tokens through the threaded sgemm kernel."""

from __future__ import annotations

import numpy as np

from ...kernels import gemm
from ...kernels.floats import F32Linear

# Above this many tokens an f32 product runs kernels.gemm (per-thread sgemm on the numba threads).
GEMM_MIN_T = 4


def mm(op, x: np.ndarray) -> np.ndarray:  # noqa: ANN001 - a LinearOp
    """``x @ W.T`` for x [in] or [T, in].

    Quantized families choose their own path (fused kernel up to ``fused_max_t`` tokens, then
    ``kernels.gemm``). An f32 LinearOp would hand every block to numpy's sgemm, whose OpenBLAS
    threads keep spinning ~0.1 s after each call and starve the numba regions in between
    (prefill-512 of the f32 benchmark model: 268-310 t/s that way, 521 through kernels.gemm)."""
    if isinstance(op, F32Linear) and x.ndim == 2 and x.shape[0] > GEMM_MIN_T and gemm.supported(op):
        return gemm.matmul(op, x)
    return op(x)
