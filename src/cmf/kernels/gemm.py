"""Prefill products ``Y[T, out] = X[T, in] @ W.T`` for blocks of tokens: dequantize + sgemm per thread.

Each numba thread owns one contiguous chunk of output rows. It dequantizes ``R`` rows at a time
into its own buffer (sized to stay in its L2) and multiplies them with single-threaded OpenBLAS
sgemm (``kernels/blas.py``), writing straight into its column block of ``Y`` (``ldc = out``): no
transposed result, no second thread pool, no f32 copy of the matrix. f32 weights are multiplied
in place (each thread's mapped rows are its operand). The 4-bit family dequantizes whole 64-row tiles
transposed (contiguous on both sides, see q4.py) and multiplies them untransposed — unless its
blocks run the integer tile loop instead (``q4.block_par``; AVX-512 VNNI, or int8 activations on
AVX2: ``q4.BLOCK_PIECES``).

f32 goes this way too although numpy's sgemm on the mapped view would need no kernel: OpenBLAS's
own threads keep spinning ~0.1 s after each call and starve the numba regions that follow
(measured: f32 prefill-512 268 t/s through np.dot, norms and attention 3-10x slower). The row
split changes OpenBLAS's edge blocking, so f32 results differ from the reference path's
``x @ W.T`` in the last bits. vbit and q1 rows are decoded by the codecs' own
row-range decoders (``quant/_fast.py``). Where numpy's BLAS has no reachable ``cblas_sgemm``
(``SGEMM.addr == 0``), :func:`matmul` falls back to the LinearOp's own batched path.

Each family's per-thread body lives in its own module (``floats.f32_gemm``/``half_gemm``,
``q8.q8_gemm``, ``vbit.vbit_gemm``, ``q1.q1_gemm``, ``tiled.tiled_gemm``/``tiled_tail``) and is
called by its LinearOp's ``_gemm`` method; this module holds what they share (buffer sizing, the
driver) and imports no family, so the families and ``_base`` import it without a cycle.
"""

from __future__ import annotations

import numpy as np

from ._jit import scratch, threads
from .blas import SGEMM, single_threaded

# Bytes of dequantized f32 rows per thread and step: half of a 2 MB L2 (the tile is still cached
# when sgemm packs it). Measured on the benchmark model: 256 KB 162-173, 512 KB 173-180, 1 MB
# 178-180, 4 MB 177-181 GFLOP/s (numpy's own sgemm on the f32 matrix: 186).
STEP_BYTES = 1 << 20


def bufs(name: str, nt: int, rows: int, cols: int) -> np.ndarray:
    """Per-thread dequantization buffers [nt, rows, cols] (reused scratch)."""
    return scratch(name, (nt, rows, cols))


def step_rows(in_features: int, align: int) -> int:
    """Rows a thread dequantizes per sgemm: STEP_BYTES of f32, a multiple of ``align``."""
    r = STEP_BYTES // max(4 * in_features, 1)
    return max(align, r // align * align)


def supported(op) -> bool:  # noqa: ANN001
    """Whether :func:`matmul` has a threaded sgemm path for this LinearOp."""
    return bool(SGEMM.addr) and getattr(op, "_gemm", None) is not None


def matmul(op, X: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:  # noqa: ANN001
    """``X[T, in] @ W.T`` for a block of tokens, into ``out`` [T, out] when given (C-contiguous).

    Uses the op family's per-thread dequantize + sgemm body (its ``_gemm``) when it has one, else
    the op's own product."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    if not supported(op) or X.ndim != 2 or X.shape[0] == 0 or op.in_features == 0:
        Y = op(X)
        if out is None:
            return Y
        out[...] = Y
        return out
    T, k = X.shape
    n = op.out_features
    Y = np.empty((T, n), np.float32) if out is None else out
    nt = threads()
    a, w64 = SGEMM.addr, SGEMM.ilp64
    with single_threaded():
        op._gemm(a, w64, X, Y, nt)
    return Y


__all__ = ["STEP_BYTES", "bufs", "matmul", "step_rows", "supported"]
