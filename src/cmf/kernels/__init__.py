"""Matrix products on quantized weights, read in place from the mapped file.

``prepare(tensor)`` returns a :class:`LinearOp` for one weight matrix; the runtime calls it for
every product. A dtype with a fused kernel gets one (decode never materializes the f32 matrix);
every other dtype falls back to the reference path (decode + numpy), which tests compare against.
"""

from __future__ import annotations

from .reference import LinearOp, ReferenceLinear, prepare_reference


def set_threads(n: int) -> int:
    """Threads for the fused kernels and for BLAS (prefill sgemm); returns numba's count."""
    from ._jit import set_threads as _set

    return _set(n)

_FUSED = None


def prepare(tensor, *, reference: bool = False, int8_activations: bool = False) -> LinearOp:
    """The fastest available LinearOp for a stored 2-D weight (``reference=True``: decode + numpy).

    ``int8_activations``: the 4-bit family's and q8's products quantize their input to int8 per
    group of 32 (``tiled.TiledLinear.use_int8_activations``, ``q8.Q8Linear.use_int8_activations``);
    other dtypes ignore it."""
    global _FUSED
    if not reference:
        if _FUSED is None:
            try:
                from . import fused as _fused  # numba kernels (optional at import time)

                _FUSED = _fused
            except ImportError:
                _FUSED = False
        if _FUSED:
            op = _FUSED.prepare_fused(tensor)
            if op is not None:
                if int8_activations and hasattr(op, "use_int8_activations"):
                    op.use_int8_activations(True)
                return op
    return prepare_reference(tensor)


__all__ = ["LinearOp", "ReferenceLinear", "prepare", "prepare_reference", "set_threads"]
