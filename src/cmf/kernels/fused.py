"""``prepare_fused(tensor)``: the fused LinearOp for a stored matrix of any dtype.

One class per dtype family (``floats``, ``q8``, ``tiled`` for the 4-bit and ladder formats,
``vbit``, ``q1``), found through ``families`` (each class declares its dtypes in ``registry``); each reads the payload in place through numba kernels (see their module
docstrings for layouts and the 4-bit repack). The payload is validated here once, so a
crafted file that passed ``open()`` cannot steer a kernel outside its bytes.
"""

from __future__ import annotations

import logging

from ..format.constants import Dtype
from . import families
from ._base import FusedLinear

log = logging.getLogger(__name__)


def prepare_fused(tensor) -> FusedLinear | None:  # noqa: ANN001 - a cmf QTensor
    """A fused LinearOp for a 2-D stored tensor, or None when no kernel applies (reserved
    dtypes; q4_block matrices whose rows are not whole groups)."""
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) != 2:
        return None
    cls = families.family_for(Dtype(int(tensor.dtype)), shape)
    if cls is None:
        return None
    from .. import quant

    quant.get_codec(tensor.dtype).validate(tensor.numpy(), shape, tensor.name)
    return cls(tensor)


__all__ = ["FusedLinear", "prepare_fused"]
