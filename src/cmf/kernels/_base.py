"""FusedLinear: the LinearOp every fused kernel family implements.

A subclass supplies four numba-backed hooks over the stored bytes:

- ``_matmul(X, Y, par)``: ``Y[T, out] = X[T, in] @ W.T`` reading the quantized bytes in place;
- ``_matmul_rows(rows, X, Y, par)``: the same for the output rows ``rows`` only;
- ``_dequant(r0, r1, out, par)`` / ``_dequant_rows(rows, out, par)``: rows as float32, for the
  batched path (default: the codec's ``decode_rows``).

The base class turns them into the protocol of :class:`cmf.kernels.reference.LinearOp`. A batch
of up to ``fused_max_t`` vectors runs through the fused kernel (the weights are read once for
all of them); a larger batch (prefill) dequantizes ``tile_bytes`` of rows at a time into a
reused buffer and multiplies it with BLAS sgemm, so the f32 matrix never exists as a whole.
"""

from __future__ import annotations

import numpy as np

from ..format.errors import BoundsError
from . import gemm
from ._jit import parallel_for, scratch

# f32 rows per batched tile: ~1 MB fits the L2 cache, so BLAS reads what was just written.
TILE_BYTES = 1 << 20
# Batched tiles are dequantized on the calling thread. Alternating a numba parallel region with
# OpenBLAS's threaded sgemm tile after tile makes the two thread pools (each spinning a while
# after its work) fight for the cores: measured 3-7 GFLOP/s for T=64 against 10-22 with serial
# dequantization on the same loaded 2-core machine (plain sgemm: 49-60).
DEQUANT_PARALLEL = False


def as_batch(x: np.ndarray, cols: int) -> tuple[np.ndarray, bool]:
    """``x`` as a C-contiguous float32 [T, cols] array, and whether it was one vector."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    if a.ndim == 1:
        a = a.reshape(1, -1)
        vec = True
    elif a.ndim == 2:
        vec = False
    else:
        raise ValueError(f"x must be [in] or [T, in], got shape {list(np.shape(x))}")
    if a.shape[1] != cols:
        raise ValueError(f"x has {a.shape[1]} features, the matrix takes {cols}")
    return a, vec


class FusedLinear:
    """y = x @ W.T straight from a stored payload (see the module docstring)."""

    fused_max_t = 8  # batches up to this size use the fused kernel (overridden per family)
    # Whether the fused kernel computes each (row, vector) product with the same instructions
    # whatever the batch size, so that a row's result never depends on the other rows of the
    # batch and equals the one-token MatvecGroup's (the server's decode batch relies on it).
    rows_exact = False
    DTYPES: tuple = ()  # the stored dtypes this family runs (set by registry.family)

    @classmethod
    def accepts(cls, dtype, shape: tuple[int, ...]) -> bool:  # noqa: ANN001 - a Dtype
        """Whether this family runs a stored matrix of this dtype and shape (default: any)."""
        return True

    @property
    def group_family(self) -> str | None:
        """``"<kernel>"`` or ``"<kernel>:<variant>"``: the compiled group kernel of
        ``gemv.MatvecGroup`` that takes this op (``gemv.GROUP_KERNELS``: "rows", "tiled", "vbit",
        "q1"), which then reads the op's :meth:`group_arrays`; ops with equal strings share a
        parallel region. None: it runs through its own product."""
        return None

    def group_arrays(self) -> tuple:
        """This op's arguments to its group kernel (see :attr:`group_family`), in that kernel's order."""
        raise NotImplementedError(f"{type(self).__name__} has no group kernel")

    def __init__(self, tensor) -> None:  # noqa: ANN001 - a cmf QTensor
        if len(tensor.shape) != 2:
            raise ValueError(f"tensor {tensor.name!r} is not a matrix: shape {list(tensor.shape)}")
        self.tensor = tensor
        self.name = tensor.name
        self.dtype = tensor.dtype
        self.out_features, self.in_features = (int(d) for d in tensor.shape)
        self.nbytes = int(tensor.nbytes)
        # the work of one product in payload bytes of a bandwidth-bound kernel, for the choice
        # of a parallel region (families whose kernels compute far longer per byte raise it)
        self.work = self.nbytes

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} {self.dtype.label} "
                f"[{self.out_features}, {self.in_features}]>")

    # -- hooks -----------------------------------------------------------------------------------
    def _matmul(self, X: np.ndarray, Y: np.ndarray, par: bool) -> None:
        raise NotImplementedError

    def _matmul_rows(self, rows: np.ndarray, X: np.ndarray, Y: np.ndarray, par: bool) -> None:
        raise NotImplementedError

    def _dequant(self, r0: int, r1: int, out: np.ndarray, par: bool) -> None:
        self._dequant_rows(np.arange(r0, r1, dtype=np.int64), out, par)

    def _dequant_rows(self, rows: np.ndarray, out: np.ndarray, par: bool) -> None:
        """Default: the codec's own row decoder (exact; allocates one tile per call)."""
        from .. import quant

        out[...] = quant.decode_rows(self.tensor.numpy(), self.dtype, self.tensor.shape, rows)

    # -- protocol --------------------------------------------------------------------------------
    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x: [in] or [T, in] float32 → [out] or [T, out] float32 (a new array)."""
        X, vec = as_batch(x, self.in_features)
        T = X.shape[0]
        if T <= self.fused_max_t:
            Y = np.empty((T, self.out_features), np.float32)
            if Y.size:
                if self.in_features:
                    self._matmul(X, Y, parallel_for(self.work * T))
                else:
                    Y[...] = 0
        else:
            Y = self._batched(X, None)
        return Y[0] if vec else Y

    def fused(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] → [T, out] through the fused kernel whatever T (the weights are read once for
        all rows): a decode batch of T sequences. With ``rows_exact`` each row is bit-identical to
        the product of that row alone."""
        X, _ = as_batch(x, self.in_features)
        Y = np.empty((X.shape[0], self.out_features), np.float32)
        if Y.size:
            if self.in_features:
                self._matmul(X, Y, parallel_for(self.work * X.shape[0]))
            else:
                Y[...] = 0
        return Y

    def rows(self, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Only output rows ``rows``: x @ W[rows].T (other rows' bytes are not read)."""
        idx = self._check_rows(rows)
        X, vec = as_batch(x, self.in_features)
        T = X.shape[0]
        if T <= self.fused_max_t:
            Y = np.empty((T, idx.size), np.float32)
            if Y.size:
                if self.in_features:
                    work = self.work * T * idx.size // max(self.out_features, 1)
                    self._matmul_rows(idx, X, Y, parallel_for(work))
                else:
                    Y[...] = 0
        else:
            Y = self._batched(X, idx)
        return Y[0] if vec else Y

    def dequant_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of W as float32, exactly what ``cmf.quant.decode_rows`` returns, from
        this op's prepared views (no payload validation per call: embedding lookups)."""
        idx = self._check_rows(rows)
        out = np.empty((idx.size, self.in_features), np.float32)
        if out.size:
            self._dequant_rows(idx, out, False)
        return out

    def dequant_row(self, row: int) -> np.ndarray:
        """Row ``row`` as [1, in] float32 (:meth:`dequant_rows` of one index, with one bounds
        check instead of the general index validation: a decode step's embedding lookup)."""
        if not 0 <= row < self.out_features:
            raise self._outside(row)
        out = np.empty((1, self.in_features), np.float32)
        if out.size:
            self._dequant_rows(np.array([row], np.int64), out, False)
        return out

    def dense(self) -> np.ndarray:
        """The whole matrix as float32 (exactly what ``cmf.quant.decode`` returns)."""
        from .. import quant

        return quant.decode(self.tensor.numpy(), self.dtype, self.tensor.shape)

    # -- shared pieces ---------------------------------------------------------------------------
    def _check_rows(self, rows: np.ndarray) -> np.ndarray:
        idx = np.asarray(rows)
        if idx.dtype == bool or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise BoundsError(f"tensor {self.name!r}: rows must be integer indices")
        idx = np.ascontiguousarray(idx, dtype=np.int64).reshape(-1)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.out_features):
            raise self._outside(int(idx.min()) if int(idx.min()) < 0 else int(idx.max()))
        return idx

    def _outside(self, row: int) -> BoundsError:
        return BoundsError(f"tensor {self.name!r}: row index {row} is outside 0..{self.out_features - 1}")

    def _tile_rows(self) -> int:
        return max(8, min(1024, TILE_BYTES // max(4 * self.in_features, 1)))

    def _batched(self, X: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """Prefill: dequantize a tile of rows into a reused buffer, then BLAS sgemm per tile.

        Families with a per-thread dequantize + sgemm kernel (``kernels.gemm``: OpenBLAS called
        from the numba threads, one thread pool) use it for whole matrices."""
        if rows is None:
            if gemm.supported(self):
                return gemm.matmul(self, X)
        n = self.out_features if rows is None else rows.size
        T = X.shape[0]
        Yt = np.empty((n, T), np.float32)
        if n == 0 or self.in_features == 0:
            Yt[...] = 0
            return np.ascontiguousarray(Yt.T)
        R = self._tile_rows()
        buf = scratch("dequant-tile", (R, self.in_features))
        par = DEQUANT_PARALLEL and parallel_for(min(R, n) * self.nbytes // max(self.out_features, 1))
        Xt = X.T
        for r0 in range(0, n, R):
            r1 = min(n, r0 + R)
            w = buf[:r1 - r0]
            if rows is None:
                self._dequant(r0, r1, w, par)
            else:
                self._dequant_rows(rows[r0:r1], w, par)
            np.dot(w, Xt, out=Yt[r0:r1])
        return np.ascontiguousarray(Yt.T)
