"""``prepare_fused(tensor)``: the fused LinearOp for a stored matrix of any dtype.

One class per dtype family (``floats``, ``q8``, ``tiled`` for the 4-bit and ladder formats,
``vbit``, ``q1``); each reads the payload in place through numba kernels (see their module
docstrings for layouts and the 4-bit repack). The payload is validated here once, so a
crafted file that passed ``open()`` cannot steer a kernel outside its bytes.
"""

from __future__ import annotations

import logging

from ..format.constants import GROUP, Dtype
from ._base import FusedLinear

log = logging.getLogger(__name__)


def _family(dtype: Dtype, shape: tuple[int, ...]) -> type[FusedLinear] | None:
    from . import floats, q1, q8, tiled, vbit

    if dtype == Dtype.F32:
        return floats.F32Linear
    if dtype in (Dtype.F16, Dtype.BF16):
        return floats.HalfLinear
    if dtype in (Dtype.Q8_ROW, Dtype.Q8_2F):
        return q8.Q8Linear
    if dtype == Dtype.Q4_BLOCK and shape[1] % GROUP:
        return None  # groups straddle rows: the reference path decodes those few matrices
    if dtype in (Dtype.Q4_BLOCK, Dtype.Q4_TILED, Dtype.Q4TP, Dtype.Q2TP):
        return tiled.TiledLinear
    if dtype in (Dtype.VBIT, Dtype.VBIT_RO):
        return vbit.VbitLinear
    if dtype in (Dtype.Q1, Dtype.Q1S, Dtype.Q1T):
        return q1.Q1Linear
    return None


def prepare_fused(tensor) -> FusedLinear | None:  # noqa: ANN001 - a cmf QTensor
    """A fused LinearOp for a 2-D stored tensor, or None when no kernel applies (reserved
    dtypes; q4_block matrices whose rows are not whole groups)."""
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) != 2:
        return None
    cls = _family(Dtype(int(tensor.dtype)), shape)
    if cls is None:
        return None
    from .. import quant

    quant.get_codec(tensor.dtype).validate(tensor.numpy(), shape, tensor.name)
    return cls(tensor)


__all__ = ["FusedLinear", "prepare_fused"]
