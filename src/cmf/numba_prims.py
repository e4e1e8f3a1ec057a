"""The bottom of the compiled layers: numba primitives that both ``cmf.quant`` (the codecs'
whole-tensor decoders) and ``cmf.kernels`` (the fused products) use, and the runtime's small
shared pieces (thread chunking, scratch buffers). It imports nothing from cmf but
``numba_cache`` (installed here, below every cached kernel), so neither package has to reach
into the other's private modules (tests/test_layering.py).

- **CPU features**: :func:`target_has` — the features of the CPU numba compiles for, which
  follows ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` as numba does — and ``HW_F16``.
- **f16 → f32 in registers**: LLVM's ``half`` type (one ``vcvtph2ps`` per 16 values on F16C
  CPUs, ``fcvt`` on ARM) or exact bit manipulation elsewhere (:func:`f16_soft`); both agree with
  numpy's ``astype(float32)`` on all 65536 patterns (tested).
- :func:`expand_nibbles`: 32 weights of a nibble group times a scale, one vector pass.
- :func:`chunk` (thread j's share of a range) and :func:`scratch` (reused per-thread buffers).
- ``ir_pointers`` / ``ir_vec_load`` / ``ir_splat`` / ``ir_prefetch``: LLVM IR helpers for intrinsics.
"""

from __future__ import annotations

import platform
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_cache import install as _install_cache_stamp

# Before any cmf module decorates a cached kernel: numba's cache stamps then cover every pycmf
# numba source, not only the kernel's own file (numba_cache.py says why).
_install_cache_stamp()

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_F32 = ir.FloatType()


# LLVM's default feature set for a CPU name, as far as the kernels ask (numba is given an empty
# feature string when NUMBA_CPU_FEATURES is set but empty: LLVM then uses the name's defaults).
# Names not listed count as having none of these: the portable paths, correct on any CPU.
_AVX2 = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
_VNNI512 = _AVX512 | {"avx512vnni"}
_CPU_NAMES: dict[str, frozenset] = {
    **dict.fromkeys(("haswell", "broadwell", "skylake", "x86-64-v3", "znver1", "znver2", "znver3", "bdver4"), _AVX2),
    **dict.fromkeys(("alderlake", "raptorlake", "meteorlake", "arrowlake", "arrowlake-s", "gracemont",
                     "sierraforest", "grandridge", "lunarlake", "pantherlake"), _AVX2 | {"avxvnni"}),
    **dict.fromkeys(("skylake-avx512", "x86-64-v4", "cannonlake"), _AVX512),
    **dict.fromkeys(("cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
                     "znver4"), _VNNI512),
    **dict.fromkeys(("sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d", "znver5"),
                    _VNNI512 | {"avxvnni"}),
}


def target_cpu() -> tuple[str, frozenset]:
    """(name, enabled LLVM features) of the CPU numba's JIT compiles for.

    numba's rule (``numba.core.codegen.JITCPUCodegen``): the name is ``NUMBA_CPU_NAME`` or the
    host's, the features ``NUMBA_CPU_FEATURES`` or — even when a name is given — the host's. So
    ``NUMBA_CPU_NAME=haswell`` alone still enables an AVX-512 host's AVX-512; AVX2-only code
    takes ``NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=`` (empty: the name's own features)."""
    try:
        from llvmlite import binding
        from numba.core import codegen, config

        name = config.CPU_NAME or binding.get_host_cpu_name()
        flat = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    except Exception:  # pragma: no cover - exotic llvmlite builds
        return "", frozenset()
    if not flat:
        return name, _CPU_NAMES.get(name, frozenset())
    return name, frozenset(f[1:] for f in flat.split(",") if f.startswith("+"))


def target_has(*features: str) -> bool:
    """Whether the CPU numba compiles for has every LLVM feature named (``"f16c"``, ``"avx2"``)."""
    have = target_cpu()[1]
    return all(f in have for f in features)


HW_F16 = platform.machine().lower() in ("aarch64", "arm64") or target_has("f16c")


@intrinsic
def bits_as_f32(typingctx, x):  # noqa: ANN001 - numba intrinsic signature
    """Reinterpret a uint32 as float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def f16_hw(typingctx, h):  # noqa: ANN001
    """uint16 f16 bits -> float32 through LLVM's half type (one vcvtph2ps when vectorized)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@numba.njit(inline="always")
def f16_soft(h):  # pragma: no cover - compiled
    """uint16 f16 bits -> float32 by exact bit manipulation (CPUs without a conversion)."""
    em = np.uint32(h) & np.uint32(0x7FFF)
    sign = (np.uint32(h) & np.uint32(0x8000)) << np.uint32(16)
    if em >= np.uint32(0x7C00):  # inf / NaN: all-ones exponent, payload kept
        return bits_as_f32(sign | (em << np.uint32(13)) | np.uint32(0x7F800000))
    # normal and subnormal halves: shift into an f32 pattern, then rescale by 2^112 (exact)
    v = bits_as_f32(em << np.uint32(13)) * np.float32(5.192296858534828e33)
    return -v if sign else v


f16_to_f32 = f16_hw if HW_F16 else f16_soft


# ---------------------------------------------------------------------------------------------
# LLVM IR helpers


def ir_pointers(context, builder, signature, args, *which):  # noqa: ANN001, ANN201
    """Data pointers of the array arguments at positions ``which`` of an intrinsic's call."""
    return [context.make_array(signature.args[i])(context, builder, args[i]).data for i in which]


def ir_vec_load(builder, ptr, ty):  # noqa: ANN001, ANN201
    """An unaligned load of vector type ``ty`` from a byte pointer."""
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)


def ir_splat(builder, value, ty):  # noqa: ANN001, ANN201
    """``value`` in every lane of vector type ``ty``."""
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), value, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, ty.count), [0] * ty.count)
    return builder.shuffle_vector(v, ir.Constant(ty, ir.Undefined), zeros)


L1, L2 = 3, 2  # llvm.prefetch locality: into L1 (prefetcht0) or L2 (prefetcht1)


def ir_prefetch(builder, ptr, locality: int = L2) -> None:  # noqa: ANN001
    """A read prefetch of the cache line at ``ptr`` (any pointer; only a hint, never a fault)."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, locality),
                      ir.Constant(_I32, 1)])


@intrinsic
def expand_nibbles(typingctx, src, soff, scale, out, ooff):  # noqa: ANN001
    """out[ooff : ooff + 32] = (nibble − 8)·scale for the 16 bytes at src[soff:] (weight 2k is
    byte k's low nibble, 2k+1 its high one): one 16-byte load, the two nibble vectors interleaved
    by a byte shuffle, one conversion and a 32-lane multiply — the same float32 operations as
    ``(lo_nibble(b) − 8)·s`` one weight at a time, so the same bits."""
    sig = types.void(src, types.int64, types.float32, out, types.int64)

    def codegen(context, builder, signature, args):
        sp, op = ir_pointers(context, builder, signature, args, 0, 3)
        b16 = ir.VectorType(_I8, 16)
        v32 = ir.VectorType(_F32, 32)
        raw = ir_vec_load(builder, cgutils.gep(builder, sp, args[1]), b16)
        lo = builder.and_(raw, ir.Constant(b16, [15] * 16))
        hi = builder.lshr(raw, ir.Constant(b16, [4] * 16))
        mix = ir.Constant(ir.VectorType(_I32, 32), [v for k in range(16) for v in (k, 16 + k)])
        codes = builder.uitofp(builder.shuffle_vector(lo, hi, mix), v32)
        vals = builder.fmul(builder.fsub(codes, ir.Constant(v32, [8.0] * 32)), ir_splat(builder, args[2], v32))
        builder.store(vals, builder.bitcast(cgutils.gep(builder, op, args[4]), v32.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


# ---------------------------------------------------------------------------------------------
# threading and scratch


@numba.njit(inline="always")
def chunk(n, nt, j, align):  # pragma: no cover - compiled
    """Thread j's contiguous share [r0, r1) of n items split nt ways, in multiples of ``align``."""
    step = ((n + nt - 1) // nt + align - 1) // align * align
    r0 = min(n, j * step)
    return r0, min(n, r0 + step)


_local = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    """A reusable per-thread buffer (contents undefined): no allocation or page faults per call.

    One buffer per ``name`` is kept per Python thread and grown when a larger one is asked for,
    so the whole process holds a few MB of scratch however many matrices it prepares.
    """
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    n = 1
    for d in shape:
        n *= int(d)
    need = n * np.dtype(dtype).itemsize
    buf = pool.get(name)
    if buf is None or buf.size < need:
        buf = np.empty(max(need, 4096), np.uint8)
        pool[name] = buf
    return buf[:need].view(dtype).reshape(shape)
