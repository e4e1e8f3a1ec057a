"""The CMF quantization ladder: one codec per dtype, a registry keyed by dtype id.

Public contract::

    data = cmf.quant.encode(array, "q4tp")            # bytes of the dtype's layout
    w = cmf.quant.decode(data, "q4tp", (rows, cols))   # float32 array of that shape
    part = cmf.quant.decode_rows(data, "q4tp", (rows, cols), [0, 7])

Every dtype's bytes are the reference encoders' (REFERENCE_NOTES §1.8) except q4_block,
q4_tiled, q4tp and q2tp, whose default encoder is ``encoder="mse"`` (``cmf.quant.mse``: same
layouts, less error); ``encoder="reference"`` writes the reference's bytes for those too.

``dtype`` is a spec label (``"f16"``, ``"q8_row"``, ``"q4tp"``, ``"q2tp"``, ...), an alias of the
converter (``"q8"``, ``"q4"``, ``"q4t"``, ``"q1p"``) or an id. Malformed payloads raise a
``CmfError`` subclass (``BoundsError``); reserved ids 5/6/7 raise ``UnsupportedDtype``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..format.constants import Dtype
from . import float as _float_codecs  # noqa: F401  (registers f32/f16/bf16)
from . import ladder as _ladder  # noqa: F401
from . import q1 as _q1  # noqa: F401
from . import q4 as _q4  # noqa: F401
from . import q8 as _q8  # noqa: F401
from . import vbit as _vbit  # noqa: F401
from .base import Buffer, Codec, get_codec, registered, resolve_dtype
from .float import f16_round, f16_scale, f32_to_bf16_bits, f32_to_f16_bits
from .vbit import encode_family as encode_vbit_family
from .vbit import family_biases as vbit_family_biases

# What cmf.kernels reuses of the codecs: row-range decoders, the f16 and exp2 tables, q1t's digits.
from ._fast import F16_TABLE, q1_range, q1t_range, vbit_range
from .float import exp2_f16_table
from .q1 import TERNARY_LUT

__all__ = [
    "F16_TABLE",
    "TERNARY_LUT",
    "Codec",
    "decode",
    "decode_rows",
    "encode",
    "encode_vbit_family",
    "exp2_f16_table",
    "f16_round",
    "f16_scale",
    "f32_to_bf16_bits",
    "f32_to_f16_bits",
    "get_codec",
    "q1_range",
    "q1t_range",
    "registered",
    "resolve_dtype",
    "vbit_family_biases",
    "vbit_range",
]


def encode(array: Any, dtype: Dtype | int | str, **options: Any) -> bytes:
    """Encode an array (anything numpy converts to float32) as ``dtype``'s payload bytes.

    Options per dtype: q4_block/q4_tiled/q4tp/q2tp/vbit/vbit_ro ``encoder`` (``"mse"`` default,
    or ``"reference"``) and ``importance`` (mse: per input feature error weights); q4tp/q2tp
    ``search`` (reference only); vbit/vbit_ro ``mean_bits``, ``bias``; q1
    ``diffusion`` (``"q1p"`` sets it); q1s ``keep``, ``act_rms``; q1t ``keep``, ``act_rms``,
    ``correct``, ``colmask``.
    """
    if isinstance(dtype, str) and dtype.strip().lower() == "q1p":
        options.setdefault("diffusion", True)
    return get_codec(dtype).encode(array, **options)


def decode(data: Buffer, dtype: Dtype | int | str, shape: Sequence[int]) -> np.ndarray:
    """Decode a payload to a float32 array of ``shape``."""
    return get_codec(dtype).decode(data, shape)


def decode_rows(data: Buffer, dtype: Dtype | int | str, shape: Sequence[int],
                rows: Sequence[int] | np.ndarray) -> np.ndarray:
    """Decode only ``rows`` (indices of the first axis) of a payload."""
    return get_codec(dtype).decode_rows(data, shape, rows)
