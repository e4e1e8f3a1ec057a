"""Float dtypes (f32, f16, bf16) and the scalar conversions every encoder shares.

The f32 -> f16 conversion is the reference writer's (REFERENCE_NOTES §1.6): round-to-nearest-even
for normal results, but subnormal results round half UP (in magnitude), so exactly 2^-25 becomes
2^-24 where numpy's ``astype(float16)`` would give 0. Everything else agrees with numpy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

import numpy as np

from ..format.constants import Dtype
from . import _fast, _outputs
from .base import Codec, as_bytes_array, check_shape, row_block

F16_TINY = np.float32(6.1035156e-5)  # smallest normal f16 (2^-14): floor of every stored scale
_SUBNORMAL_LIMIT = np.float32(2.0 ** -14)
_F16_ULP = 2.0 ** 24  # 1 / (smallest f16 subnormal)


def f32_to_f16_bits(x: np.ndarray | float) -> np.ndarray:
    """Convert f32 values to f16 bit patterns (uint16) exactly as the reference writer does."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):  # overflow to ±inf is the reference behaviour
        bits = x.astype(np.float16).view(np.uint16)
    if bits.ndim == 0:
        bits = bits.reshape(1)
        out = _fix_f16(x.reshape(1), bits.copy())
        return out.reshape(())
    return _fix_f16(x, bits)


def _fix_f16(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
    ax = np.abs(x)
    sub = ax < _SUBNORMAL_LIMIT
    if sub.any():
        # Subnormal results are linear in the bit pattern: bits = |x|·2^24 rounded. The
        # reference rounds ties up (not to even); f64 makes the +0.5 exact.
        idx = np.flatnonzero(sub)
        xs = x.ravel()[idx]
        mag = np.floor(np.abs(xs).astype(np.float64) * _F16_ULP + 0.5).astype(np.uint16)
        sign = np.where(np.signbit(xs), np.uint16(0x8000), np.uint16(0))
        if not bits.flags.writeable:
            bits = bits.copy()
        bits.ravel()[idx] = sign | mag
    nan = np.isnan(x)
    if nan.any():
        if not bits.flags.writeable:
            bits = bits.copy()
        sign = np.where(np.signbit(x[nan]), np.uint16(0x8000), np.uint16(0))
        bits[nan] = sign | np.uint16(0x7E00)
    return bits


def f16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """IEEE half bit patterns (uint16) -> float32, subnormals included."""
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def f16_round(x: np.ndarray | float) -> np.ndarray:
    """Round f32 values to f16 precision and back (the reference rounding)."""
    return f16_bits_to_f32(f32_to_f16_bits(x))


def f16_scale(x: np.ndarray | float) -> np.ndarray:
    """``f16_scale`` of REFERENCE_NOTES §1.6: round to f16, then floor at 2^-14.

    Every encoder quantizes against this value so that writer and reader use the same scale,
    and a stored scale is never zero or subnormal.
    """
    return np.maximum(f16_round(x), F16_TINY)


def f16_scale_bits(x: np.ndarray | float) -> np.ndarray:
    """``f16_scale`` of non-negative values as f16 bit patterns (the floor is bits 0x0400)."""
    return np.maximum(f32_to_f16_bits(x), np.uint16(0x0400))


# Transcendentals on f16 arguments. The reference encoder (Rust) calls the C library's log2f and
# exp2f; numpy's own float32 log2/exp2 differ from those in the last bit for ~3% / ~8% of f16
# inputs (measured on glibc 2.36), which would change q4tp/q2tp lo, step, codes and ladders. Every
# argument there is an f16 value, so one 65536-entry table per function gives the C library's
# results exactly. Without glibc the tables hold correctly rounded values (f64, then f32).


@functools.lru_cache(maxsize=None)
def _libm_function(name: str):  # noqa: ANN202 - a ctypes function or None
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float]
    return fn


@functools.lru_cache(maxsize=None)
def _f16_table(name: str) -> np.ndarray:
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):
        table = getattr(np, name)(x.astype(np.float64)).astype(np.float32)
    fn = _libm_function(name + "f")
    if fn is not None:
        ok = np.isfinite(x) & ((x > 0) if name == "log2" else True)
        idx = np.flatnonzero(ok)
        table[idx] = np.array(list(map(fn, x[idx].tolist())), np.float32)
    table.setflags(write=False)
    return table


def exp2_f16_table() -> np.ndarray:
    """exp2 of every f16 bit pattern (float32, 65536 entries, as the C library's exp2f): the one
    table every q4tp/q2tp encoder, decoder and kernel shares. Treat it as read-only."""
    return _f16_table("exp2")


def log2_f16(bits: np.ndarray) -> np.ndarray:
    """log2 of f16 values given as bit patterns, as the C library's log2f computes it (float32)."""
    return _f16_table("log2")[np.asarray(bits, np.uint16)]


def exp2_f16(bits: np.ndarray) -> np.ndarray:
    """exp2 of f16 values given as bit patterns, as the C library's exp2f computes it (float32)."""
    return _f16_table("exp2")[np.asarray(bits, np.uint16)]


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits with round-to-nearest-even, as ``cortiq dequant --dtype bf16``.

    Deviation: NaN stays a quiet NaN of the same sign (the reference's carry could turn a NaN
    payload into an infinity or zero; no in-repo tool writes bf16 files anyway).
    """
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    out = ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000)) | np.uint16(0x7FC0)
    return out


class F32Codec(Codec):
    """Little-endian float32, stored verbatim."""

    id = Dtype.F32
    itemsize = 4

    def encode(self, array: np.ndarray) -> bytes:
        return np.ascontiguousarray(array, dtype="<f4").tobytes()

    def _decode_flat(self, data: np.ndarray) -> np.ndarray:
        return data.view("<f4").astype(np.float32, copy=False)

    def decode(self, buf, shape):
        shape = check_shape(shape)
        data = self._checked(buf, shape)
        return self._decode_flat(data).reshape(shape)

    def decode_rows(self, buf, shape, rows):
        shape = check_shape(shape)
        data = self._checked(buf, shape)
        nrows, rowlen, rows = row_block(shape, rows)
        picked = data.reshape(nrows, self.itemsize * rowlen)[rows].reshape(-1)
        return self._decode_flat(picked).reshape((len(rows),) + tuple(shape[1:]))

    def _checked(self, buf, shape) -> np.ndarray:
        data = as_bytes_array(buf)
        self.validate(data, shape)
        return data


class F16Codec(F32Codec):
    """Little-endian IEEE half; the encoder rounds subnormal ties up like the reference."""

    id = Dtype.F16
    itemsize = 2

    def encode(self, array: np.ndarray) -> bytes:
        return f32_to_f16_bits(np.asarray(array, dtype=np.float32)).astype("<u2").tobytes()

    def _decode_flat(self, data: np.ndarray) -> np.ndarray:
        out = _outputs.empty(data.size // 2, np.float32)
        _fast.f16_decode(data, _fast.F16_TABLE, out)
        return out


class BF16Codec(F32Codec):
    """bfloat16: decode is ``bits << 16``; encode rounds to nearest even."""

    id = Dtype.BF16
    itemsize = 2

    def encode(self, array: np.ndarray) -> bytes:
        return f32_to_bf16_bits(np.asarray(array, dtype=np.float32)).astype("<u2").tobytes()

    def _decode_flat(self, data: np.ndarray) -> np.ndarray:
        out = _outputs.empty(data.size // 2, np.uint32)
        _fast.bf16_decode(data, out)
        return out.view(np.float32)
