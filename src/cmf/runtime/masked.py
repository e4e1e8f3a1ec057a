"""Task-mask execution helpers (spec §5): live-row ``gate_proj``/``up_proj``, the live-column
``down_proj`` and page release.

Under an FFN mask only the live neurons run: the live ROWS of ``gate_proj``/``up_proj`` and the
live COLUMNS of ``down_proj``. Each is gathered once per task into a small in-memory payload of
the same dtype (``cmf.quant.columns``) that the ordinary fused kernels multiply at full speed
(and the decode step runs as for an unmasked layer). After a gather the mapped pages of the full
matrix are handed back to the kernel (``madvise(MADV_DONTNEED)`` on the read-only file mapping:
nothing is lost, a later unmasked product faults them in again), so a mask's resident memory is
its live part. Why rows are gathered too: a random half of the neurons leaves few whole pages
of dead rows (four 1 KiB q8 rows share a page), so reading the live rows in place kept ~15/16 of
the pages resident. Dtypes whose rows are not separate byte ranges (vbit, q1s, q1t) keep the
row-restricted product in place. A ``down_proj`` whose gather would keep most of its columns
(the 4-bit family's 32-column groups under a scattered mask) or that has no same-dtype gather
runs whole, with zero activations at the dead positions.
"""

from __future__ import annotations

import logging

import numpy as np

from .. import kernels
from ..format.constants import Dtype
from .memory import release_pages

log = logging.getLogger(__name__)


class MemTensor:
    """An in-memory matrix with the QTensor attributes the kernels use."""

    def __init__(self, name: str, dtype: Dtype, shape: tuple[int, int], payload: np.ndarray) -> None:
        self.name, self.dtype, self.shape = name, Dtype(int(dtype)), tuple(int(d) for d in shape)
        self._u8 = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
        self.nbytes = int(self._u8.size)

    def numpy(self) -> np.ndarray:
        return self._u8


# A gather that would keep at least this fraction of a matrix's columns is not made: the whole
# matrix runs with zero activations at the dead positions (a copy would save little and, for the
# 4-bit family under a random mask — which leaves hardly a 32-column group without a live
# neuron — hold the payload a second time next to its repacked tiles).
WHOLE_MATRIX_FRACTION = 0.875


def live_columns(op, cols: np.ndarray, *, reference: bool = False,
                 int8_activations: bool = False) -> tuple[object, np.ndarray | None]:
    """(LinearOp over ``W[:, cols]`` or a superset of it, positions) for the LinearOp ``op``.

    ``positions`` is None when the op takes exactly the live activations in order; otherwise the
    op takes a wider vector and live activation k goes to column ``positions[k]`` (zeros elsewhere).
    The op is ``op`` itself (positions = ``cols``) when the dtype has no same-dtype gather (vbit,
    q1s, q1t: their live columns as float32 would take more memory than the whole matrix) or the
    gather would keep most columns (``WHOLE_MATRIX_FRACTION``). An op that is not over stored bytes
    (a blend's working tensor) gives its dense columns. ``reference`` / ``int8_activations``: as
    the model's own LinearOps (``kernels.prepare``).
    """
    from ..quant.columns import gather_columns, kept_column_fraction

    cols = np.ascontiguousarray(cols, dtype=np.int64)
    tensor = getattr(op, "tensor", None)
    if tensor is None or not hasattr(tensor, "numpy"):
        w = np.ascontiguousarray(op.dense()[:, cols], dtype=np.float32)
        return kernels.prepare(MemTensor("live", Dtype.F32, w.shape, w.view(np.uint8)), reference=reference,
                               int8_activations=int8_activations), None
    kept = kept_column_fraction(tensor.dtype, int(tensor.shape[1]), cols)
    if kept is None or kept >= WHOLE_MATRIX_FRACTION:
        log.debug("%s: the whole %s matrix runs under the mask (a gather would keep %s of it)", tensor.name,
                  tensor.dtype.label, "none" if kept is None else f"{kept:.0%}")
        return op, cols
    buf = tensor.numpy()
    sub = gather_columns(buf, tensor.dtype, tensor.shape, cols)
    sub_t = MemTensor(tensor.name + "[live]", sub.dtype, sub.shape, sub.payload)
    positions = None if np.array_equal(sub.positions, np.arange(cols.size)) else sub.positions
    release_pages(buf)
    return kernels.prepare(sub_t, reference=reference, int8_activations=int8_activations), positions


def live_rows(op, rows: np.ndarray, *, reference: bool = False,  # noqa: ANN001, ANN201 - LinearOps
              int8_activations: bool = False):
    """A LinearOp over ``W[rows]`` gathered from the stored bytes of ``op``, or None when the
    dtype has no exact row gather or ``op`` is not over stored bytes (the caller then multiplies
    the live rows in place). The mapped pages of ``op``'s payload are given back after a gather."""
    from ..quant.columns import gather_rows

    tensor = getattr(op, "tensor", None)
    if tensor is None or not hasattr(tensor, "numpy"):
        return None
    buf = tensor.numpy()
    sub = gather_rows(buf, tensor.dtype, tensor.shape, np.ascontiguousarray(rows, dtype=np.int64))
    if sub is None:
        return None
    release_pages(buf)
    return kernels.prepare(MemTensor(tensor.name + "[live rows]", sub.dtype, sub.shape, sub.payload),
                           reference=reference, int8_activations=int8_activations)
