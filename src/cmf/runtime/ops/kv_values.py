"""KV cache entries in float32 or f16, read and written by the same compiled attention bodies.

A KV cache stores its keys and values as float32 arrays or, with ``kv_cache="f16"``, as uint16
arrays of IEEE half-precision bits (numba has no float16 type). The attention bodies in
``decode.py`` read cache elements through :func:`as_f32` and write a token's entry through
:func:`put_entry`; both are typed overloads, so numba compiles one specialization per storage
type from one source — the f32 cache's code is unchanged, the f16 one converts in registers
(``vcvtph2ps`` / ``vcvtps2ph`` on F16C, ``fcvt`` on ARM). Rounding to f16 is to nearest even,
as numpy's ``astype(np.float16)`` (tested on every float32 class), so a cache written by the
compiled token step and one written by a prefill (numpy) hold the same bits.

Half the bytes per cached position is the point: inside a batched decode step attention reads
every sequence's whole cache from memory (16 sequences × 30 layers × ~100 positions of
SmolLM2-135M is ~80 MB a step in float32, more than the L3 holds).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ...numba_prims import HW_F16, f16_to_f32

KV_DTYPES = ("f32", "f16")


def storage_dtype(kv_cache: str) -> type:
    """The numpy dtype a cache named ``kv_cache`` ("f32" or "f16") stores its entries in."""
    if kv_cache == "f32":
        return np.float32
    if kv_cache == "f16":
        return np.uint16
    raise ValueError(f"unknown KV cache type {kv_cache!r}: one of {', '.join(KV_DTYPES)}")


def check_supported(kv_cache: str) -> None:
    """Refuse a KV cache type this CPU cannot run (f16 needs a hardware conversion: F16C or ARM)."""
    storage_dtype(kv_cache)
    if kv_cache == "f16" and not HW_F16:
        raise ValueError("an f16 KV cache needs a CPU with f16 conversions (x86 F16C or ARM); use f32")


def to_storage(x: np.ndarray, dtype: type) -> np.ndarray:
    """float32 rows as a cache of ``dtype`` stores them (f16 bits: rounded to nearest even, as
    numpy's ``astype(np.float16)``; beyond ±65504 a value becomes ±inf, as in the compiled step
    and llama.cpp's f16 cache). Compiled (:func:`_to_f16`): numpy's float16 conversion is scalar
    software, ~5 ns an element — 1.7 ms of every 30-token prefill of SmolLM2-135M."""
    if dtype is np.uint16:
        src = np.ascontiguousarray(x, np.float32)
        out = np.empty(src.shape, np.uint16)
        _to_f16(src.reshape(-1), out.reshape(-1))
        return out
    return x


def to_f32(a: np.ndarray) -> np.ndarray:
    """Cache entries as float32 (a new array for an f16 cache, ``a`` itself for float32)."""
    if a.dtype == np.uint16:
        out = np.empty(a.shape, np.float32)
        _from_f16(np.ascontiguousarray(a).reshape(-1), out.reshape(-1))
        return out
    return a


@intrinsic
def f32_to_f16(typingctx, x):  # noqa: ANN001 - numba intrinsic signature
    """float32 -> uint16 f16 bits, rounded to nearest even (LLVM ``fptrunc``: ``vcvtps2ph``)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def pointer_at(typingctx, addr, like):  # noqa: ANN001
    """The pointer at address ``addr`` (an int64) to elements of ``like``'s dtype (an array whose
    only use is its type: the batched step passes each sequence's cache by address)."""
    sig = types.CPointer(like.dtype)(types.int64, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def _to_f16(src, dst):  # pragma: no cover - compiled
    """dst[i] = f16 bits of src[i] (``vcvtps2ph`` vectors on F16C: f16 caches need it)."""
    for i in range(src.shape[0]):
        dst[i] = f32_to_f16(src[i])


@numba.njit(cache=True, nogil=True)
def _from_f16(src, dst):  # pragma: no cover - compiled
    """dst[i] = the float32 value of the f16 bits src[i]."""
    for i in range(src.shape[0]):
        dst[i] = f16_to_f32(src[i])


def as_f32(v):  # noqa: ANN001, ANN201 - typed by the overload below
    """A cache element as float32 (f16 bits converted; float32 as it is)."""
    raise NotImplementedError("compiled only")


@overload(as_f32, inline="always")
def _as_f32(v):  # noqa: ANN001, ANN202
    if isinstance(v, types.Integer):
        return lambda v: f16_to_f32(v)
    if isinstance(v, types.Float):
        return lambda v: v
    return None


def put_entry(dst, src):  # noqa: ANN001, ANN201 - typed by the overload below
    """dst[h, i] = src[h, i] for a cache entry ``dst`` [heads, dim] (converted to f16 bits for an
    f16 cache)."""
    raise NotImplementedError("compiled only")


@overload(put_entry, inline="always")
def _put_entry(dst, src):  # noqa: ANN001, ANN202
    if dst.dtype == types.uint16:
        def store_f16(dst, src):
            for h in range(dst.shape[0]):
                for i in range(dst.shape[1]):
                    dst[h, i] = f32_to_f16(np.float32(src[h, i]))
        return store_f16

    def store(dst, src):
        for h in range(dst.shape[0]):
            for i in range(dst.shape[1]):
                dst[h, i] = src[h, i]
    return store


__all__ = ["KV_DTYPES", "as_f32", "check_supported", "f32_to_f16", "pointer_at", "put_entry", "storage_dtype",
           "to_f32", "to_storage"]
