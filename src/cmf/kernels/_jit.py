"""What every fused kernel shares: numba options, scalar intrinsics, threading policy, scratch.

numba types every integer operation on small ints as int64, which makes LLVM vectorize nibble
and byte arithmetic in 64-bit lanes (8 per register instead of 16) or not at all; the
intrinsics below keep the byte arithmetic 8 bits wide so the loops vectorize. f16 is converted
by the hardware instruction (``fpext half``, F16C on x86) where the CPU has one, else by exact
bit manipulation; both agree with numpy's ``astype(float32)`` on all 65536 patterns (tested).

Parallelism: every kernel has a serial body over a range of rows and a parallel driver that
splits the rows into one contiguous chunk per thread. A parallel region costs ~1.6 µs to start
on an idle host (numba's OpenMP layer) and far more on a loaded 2-core machine (a chunk waits for
a descheduled thread), so products below ``PARALLEL_MIN_BYTES`` of payload call the serial body
directly.
"""

from __future__ import annotations

import mmap
import platform
import threading
import weakref

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..numba_prims import (HW_F16, bits_as_f32, chunk, f16_hw, f16_soft, f16_to_f32, ir_prefetch, scratch,  # noqa: F401
                           target_has)

# reassoc lets LLVM vectorize float reductions; no nnan/ninf, so crafted inf/NaN weights give
# inf/NaN results instead of undefined behaviour.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
SERIAL = {"cache": True, "nogil": True, "fastmath": FASTMATH, "error_model": "numpy"}
PARALLEL = dict(SERIAL, parallel=True)
# Kernels vectorized across rows have no reduction to reorder; without reassoc LLVM keeps the
# independent partial sums they are written with instead of folding them into one long chain.
SERIAL_ORDERED = dict(SERIAL, fastmath={"contract", "nsz", "arcp"})
PARALLEL_ORDERED = dict(SERIAL_ORDERED, parallel=True)

# Below this many payload bytes a product runs single-threaded: a 2-thread region pays off once
# the work is a few times what it costs to start one (128 KB streams in ~8 µs on one thread;
# PERFORMANCE.md, "Small products on two threads").
PARALLEL_MIN_BYTES = 1 << 17


# f16 conversion, CPU features, chunking and scratch live in the neutral bottom module, shared
# with cmf.quant's decoders; they are re-exported here for the kernels.
_f16_hw, _f16_soft = f16_hw, f16_soft  # the two f16 conversions by their old names (tests)


@numba.njit(inline="always")
def f16_at(buf, i):  # pragma: no cover - compiled
    """The little-endian f16 at byte offset ``i`` of a uint8 array, as float32."""
    return f16_to_f32(np.uint16(buf[i]) | (np.uint16(buf[i + 1]) << np.uint16(8)))


@intrinsic
def bf16_to_f32(typingctx, h):  # noqa: ANN001
    """uint16 bf16 bits -> float32 (the bits are the top half of an f32)."""
    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def lo_nibble(typingctx, b):  # noqa: ANN001
    """Low nibble of a byte as float32 (0..15), computed in 8-bit lanes."""
    def codegen(context, builder, signature, args):
        v = builder.and_(args[0], ir.Constant(ir.IntType(8), 15))
        return builder.uitofp(v, ir.FloatType())
    return types.float32(types.uint8), codegen


@intrinsic
def hi_nibble(typingctx, b):  # noqa: ANN001
    """High nibble of a byte as float32 (0..15)."""
    def codegen(context, builder, signature, args):
        return builder.uitofp(builder.lshr(args[0], ir.Constant(ir.IntType(8), 4)), ir.FloatType())
    return types.float32(types.uint8), codegen


@intrinsic
def word_at(typingctx, a, off):  # noqa: ANN001
    """The little-endian uint32 at byte ``off`` of a uint8 array (the repacked tiles' words: a
    loop over consecutive words is one vector load per 16 of them)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(cgutils.gep(builder, data, args[1]), ir.IntType(32).as_pointer())
        return builder.load(ptr, align=1)
    return types.uint32(a, types.int64), codegen


@intrinsic
def put_word(typingctx, a, off, v):  # noqa: ANN001
    """Store the uint32 ``v`` little-endian at byte ``off`` of a uint8 array (packing tiles a word
    at a time instead of a byte at a time)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(cgutils.gep(builder, data, args[1]), ir.IntType(32).as_pointer())
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()
    return types.void(a, types.int64, types.uint32), codegen


@intrinsic
def prefetch_at(typingctx, a, off):  # noqa: ANN001
    """Prefetch the cache line at byte ``off`` of an array (any dtype; llvm.prefetch, read, L2
    locality). Only a hint: an address past the array is not an error, but callers stay inside."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ir_prefetch(builder, cgutils.gep(builder, builder.bitcast(data, ir.IntType(8).as_pointer()), args[1]))
        return context.get_dummy_value()
    return types.void(a, types.int64), codegen


@intrinsic
def field32(typingctx, word, shift, mask):  # noqa: ANN001
    """(word >> shift) & mask of a uint32 as float32, in 32-bit lanes (numba would widen the
    shift to int64, which keeps LLVM from vectorizing the loop around it)."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = builder.lshr(args[0], builder.trunc(args[1], i32))
        return builder.uitofp(builder.and_(v, builder.trunc(args[2], i32)), ir.FloatType())
    return types.float32(types.uint32, types.int64, types.int64), codegen


@intrinsic
def crumb(typingctx, b, j):  # noqa: ANN001
    """2-bit field ``j`` (bits 2j..2j+1, j in 0..3) of a byte as float32 (0..3), in 8-bit lanes."""
    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        shift = builder.shl(builder.trunc(args[1], i8), ir.Constant(i8, 1))
        v = builder.and_(builder.lshr(args[0], shift), ir.Constant(i8, 3))
        return builder.uitofp(v, ir.FloatType())
    return types.float32(types.uint8, types.int64), codegen


@intrinsic
def byte_f32(typingctx, b):  # noqa: ANN001
    """A uint8 as float32 (without numba's detour through int64)."""
    def codegen(context, builder, signature, args):
        return builder.uitofp(args[0], ir.FloatType())
    return types.float32(types.uint8), codegen


@intrinsic
def int8_f32(typingctx, b):  # noqa: ANN001
    """An int8 as float32."""
    def codegen(context, builder, signature, args):
        return builder.sitofp(args[0], ir.FloatType())
    return types.float32(types.int8), codegen


# AVX-512's 16-lane mask registers: group_scales multiplies the powers in under a plane's bits
# directly; without them (AVX2, NEON) it takes the lane masks from PLANE_MASKS.
MASK_REGS = target_has("avx512f")
# The table form's fma variant needs a hardware fused multiply-add (AVX2 machines have FMA3,
# aarch64 has it in every NEON unit); without one LLVM would call fmaf per lane.
FMA_SCALES = not MASK_REGS and (target_has("fma") or platform.machine().lower() in ("aarch64", "arm64"))
# group_scales' mode for a ladder's scales kept decoded, as float32 (see ladder_scales.DECODED_SCALES)
DECODED = 5
# PLANE_MASKS[b, k] = -1 where bit k of the byte b is set, else 0: a plane byte's 8 lane masks
PLANE_MASKS = np.array([[-1 if (b >> k) & 1 else 0 for k in range(8)] for b in range(256)], np.int32)


def _rungs_by_table(builder, pl, t0p, pw, sp, base, dead31: bool, fma: bool) -> None:  # noqa: ANN001
    """group_scales' ladder for targets without mask registers (:data:`MASK_REGS`): 8 rows at
    a time, each plane's byte → lane masks from :data:`PLANE_MASKS`, and in plane order as the
    masked form does, either ``v·factor`` with the factor ((power ^ 1.0) & mask) ^ 1.0 (the
    power, or exactly 1.0), or — ``fma``: ``pw`` holds d = power − 1, exact — ``fma(v, d & mask,
    v)``: one rounding of v + v·d = v·power, or v + v·0 = v, so the same bits with two vector
    operations a plane instead of four (the caller checks that the tile's values allow it, see
    ``ladder_scales.increments_exact``; only where the target has an FMA unit, :data:`FMA_SCALES`).
    ``dead31`` (modes 2 and 4) zeroes rows whose five bits are all set."""
    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    vf, vi = ir.VectorType(f32, 8), ir.VectorType(i32, 8)
    table = builder.module.globals.get("cmf_plane_masks")  # one copy per module, however many calls
    if table is None:
        table = cgutils.global_constant(builder.module, "cmf_plane_masks", ir.Constant(
            ir.ArrayType(vi, 256), [ir.Constant(vi, [int(v) for v in row]) for row in PLANE_MASKS]))
    one = ir.Constant(vi, [0x3F800000] * 8)
    fma_fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), "llvm.fma.v8f32")

    def vload(ptr, off):  # noqa: ANN001, ANN202
        return builder.load(builder.bitcast(cgutils.gep(builder, ptr, ir.Constant(i64, off)), vf.as_pointer()), align=4)

    for c in range(8):  # rows 8c .. 8c + 7: byte c of each plane
        v = vload(t0p, 8 * c)
        every = None
        for p in range(5):
            byte = builder.load(cgutils.gep(builder, pl, builder.add(base, ir.Constant(i64, 8 * p + c))))
            m = builder.load(builder.gep(table, [ir.Constant(i32, 0), builder.zext(byte, i32)]), align=32)
            if dead31:
                every = m if every is None else builder.and_(every, m)
            power = builder.bitcast(vload(pw, 64 * p + 8 * c), vi)
            if fma:
                v = builder.call(fma_fn, [v, builder.bitcast(builder.and_(power, m), vf), v])
            else:
                factor = builder.xor(builder.and_(builder.xor(power, one), m), one)
                v = builder.fmul(v, builder.bitcast(factor, vf))
        if dead31:  # code 31: an exact 0
            v = builder.bitcast(builder.and_(builder.bitcast(v, vi), builder.xor(every, ir.Constant(vi, [-1] * 8))), vf)
        dst = builder.bitcast(cgutils.gep(builder, sp, ir.Constant(i64, 8 * c)), vf.as_pointer())
        builder.store(v, dst, align=4)


def _make_group_scales(mask_regs: bool):  # noqa: ANN202 - returns a numba intrinsic
    """:func:`group_scales` with AVX-512's mask registers or, without them, the plane-mask table."""

    @intrinsic
    def group_scales(typingctx, sc, planes, tg, t0, powers, s, mode):  # noqa: ANN001
        """s[0:64] = the scales of the 64 rows of tile-group ``tg`` (tile·groups per row + group).

        ``mode`` 0: f16 bits at ``sc[64·tg : 64·tg + 64]``. Otherwise from bit-sliced 5-bit codes
        (40 bytes a tile-group): s[i] = t0[i]·Π_p powers[p·64 + i]^bit_p(i), where
        ``planes[40·tg + 8p : 40·tg + 8p + 8]`` is bit p of the 64 rows' codes (little-endian: bit
        i = row i). Each 16-row slice of a plane is
        reinterpreted as a 16-lane mask under which the power is multiplied in (AVX-512: one
        merge-masked multiply per plane): no per-row gather. ``mode`` 2: rows whose code is 31
        (all bits set) get an exact 0. Modes 3 and 4 are 1 and 2 with ``powers`` holding
        power − 1 (targets without mask registers only; see :func:`_rungs_by_table`). Mode
        :data:`DECODED` (5): a ladder's scales decoded once when the tile was packed, as float32
        bits at ``sc[128·tg : 128·tg + 128]`` (``ladder_scales.DECODED_SCALES``).

        Without AVX-512's mask registers (:data:`MASK_REGS`) the same products run on 8-row
        slices: a plane's byte is looked up in a table of lane masks (:data:`PLANE_MASKS`), and the
        factor is the power where the mask is set and exactly 1.0 elsewhere (``v·1.0 == v`` bit for
        bit, so the scales equal the masked form's): no mask built from a broadcast, compare and
        blend per plane, which made AVX2's scales cost as much as the group's integer dot.

        An intrinsic rather than an inlined numba helper: a helper taking these arrays costs a
        reference-count call per array and call, which inside the group loop of a tile was as much
        as the group's integer work.
        """
        def codegen(context, builder, signature, args):
            i1, i16, i64, f32 = ir.IntType(1), ir.IntType(16), ir.IntType(64), ir.FloatType()
            scp, pl, t0p, pw, sp = (context.make_array(signature.args[k])(context, builder, args[k]).data
                                    for k in (0, 1, 3, 4, 5))
            vf = ir.VectorType(f32, 16)
            vm = ir.VectorType(i1, 16)
            zeros = ir.Constant(vf, [0.0] * 16)
            mode = args[6]
            soff = builder.mul(args[2], ir.Constant(i64, 64))
            base = builder.mul(args[2], ir.Constant(i64, 40))

            def store(c, v):
                dst = builder.bitcast(cgutils.gep(builder, sp, ir.Constant(i64, 16 * c)), vf.as_pointer())
                builder.store(v, dst, align=4)

            def vload(ptr, off):
                p = builder.bitcast(cgutils.gep(builder, ptr, ir.Constant(i64, off)), vf.as_pointer())
                return builder.load(p, align=4)

            stored = builder.or_(builder.icmp_signed("==", mode, ir.Constant(i64, 0)),
                                 builder.icmp_signed("==", mode, ir.Constant(i64, DECODED)))
            with builder.if_else(stored) as (kept, ladder):
                with kept:
                    with builder.if_else(builder.icmp_signed("==", mode, ir.Constant(i64, 0))) as (f16, f32s):
                        with f16:
                            vh = ir.VectorType(i16, 16)
                            for c in range(4):
                                at = builder.add(soff, ir.Constant(i64, 16 * c))
                                raw = builder.load(builder.bitcast(cgutils.gep(builder, scp, at), vh.as_pointer()),
                                                   align=2)
                                store(c, builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 16)), vf))
                        with f32s:  # 64 float32 as 128 uint16 a tile-group
                            for c in range(4):
                                at = builder.add(builder.add(soff, soff), ir.Constant(i64, 32 * c))
                                store(c, builder.load(builder.bitcast(cgutils.gep(builder, scp, at), vf.as_pointer()),
                                                      align=4))
                with ladder:
                    def rungs(dead31):
                        for c in range(4):
                            v = vload(t0p, 16 * c)
                            every = ir.Constant(i16, 0xFFFF)
                            for p in range(5):
                                off = builder.add(base, ir.Constant(i64, 8 * p + 2 * c))
                                ptr16 = builder.bitcast(cgutils.gep(builder, pl, off), i16.as_pointer())
                                bits = builder.load(ptr16, align=1)  # little-endian: bit k = row 16c + k
                                every = builder.and_(every, bits)
                                # v·power where the bit is set: one merge-masked multiply
                                v = builder.select(builder.bitcast(bits, vm), builder.fmul(v, vload(pw, 64 * p + 16 * c)), v)
                            store(c, builder.select(builder.bitcast(every, vm), zeros, v) if dead31 else v)

                    def live_or_dead(form):  # noqa: ANN001, ANN202
                        # q2tp's dead groups in their own copy, so q4tp's path carries no test for them
                        dead_mode = builder.or_(builder.icmp_signed("==", mode, ir.Constant(i64, 2)),
                                                builder.icmp_signed("==", mode, ir.Constant(i64, 4)))
                        with builder.if_else(dead_mode) as (dead, live):
                            with dead:
                                form(True)
                            with live:
                                form(False)

                    if mask_regs:
                        live_or_dead(rungs)
                    else:  # modes 3 and 4: the powers arrive as d = power − 1 (ladder_scales.powers)
                        with builder.if_else(builder.icmp_signed(">=", mode, ir.Constant(i64, 3))) as (fma, mul):
                            with fma:
                                live_or_dead(lambda dead31: _rungs_by_table(builder, pl, t0p, pw, sp, base, dead31, True))
                            with mul:
                                live_or_dead(lambda dead31: _rungs_by_table(builder, pl, t0p, pw, sp, base, dead31, False))
            return context.get_dummy_value()
        return types.void(sc, planes, types.int64, t0, powers, s, types.int64), codegen

    return group_scales


group_scales = _make_group_scales(MASK_REGS)


# ---------------------------------------------------------------------------------------------
# threading and scratch


def threads() -> int:
    """numba's current thread count (``numba.set_num_threads`` changes it)."""
    return numba.get_num_threads()


def set_threads(n: int) -> int:
    """Use ``n`` threads for the kernels (numba) and for BLAS (the batched path's sgemm), as far
    as each allows; returns numba's thread count. BLAS is set through OpenBLAS's C API when
    numpy links it (best effort: other BLAS builds keep their own setting)."""
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    fn = _openblas_setter()
    if fn is not None:
        fn(n)
    return n


def _openblas_setter():  # noqa: ANN202 - a ctypes function or None
    global _BLAS_SETTER
    if _BLAS_SETTER is None:
        _BLAS_SETTER = False
        try:
            import ctypes
            import glob
            import os

            libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
            for path in libs:
                lib = ctypes.CDLL(path)
                for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                             "openblas_set_num_threads64_", "openblas_set_num_threads"):
                    if hasattr(lib, name):
                        fn = getattr(lib, name)
                        fn.argtypes = [ctypes.c_int]
                        fn.restype = None
                        _BLAS_SETTER = fn
                        break
                if _BLAS_SETTER:
                    break
        except OSError:  # pragma: no cover - unusual installs
            pass
    return _BLAS_SETTER or None


_BLAS_SETTER = None


def parallel_for(nbytes: int) -> bool:
    """Whether a product over ``nbytes`` of payload is worth a parallel region."""
    return nbytes >= PARALLEL_MIN_BYTES and numba.get_num_threads() > 1


# ---------------------------------------------------------------------------------------------
# repacked weights in huge pages

_HUGE = 2 << 20  # a transparent huge page
_CHUNK = 64 << 20  # address space reserved at a time; pages become resident only when written
_arena_lock = threading.Lock()
# the current reservation: [mmap, offset of its first huge page, next free offset, usable size]
_arena: list = [None, 0, 0, 0]
_PAGE = mmap.PAGESIZE if hasattr(mmap, "PAGESIZE") else 4096


def _give_back(m, lo: int, hi: int) -> None:  # noqa: ANN001 - an mmap
    """Return the whole pages inside [lo, hi) of a dead array to the kernel (the bump allocator
    never reuses them, so without this a re-prepared matrix would leave its old copy resident)."""
    lo = (lo + _PAGE - 1) // _PAGE * _PAGE
    hi = hi // _PAGE * _PAGE
    if hi > lo and not m.closed:
        try:
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):  # pragma: no cover - best effort
            pass


def huge_zeros(shape: tuple[int, ...], dtype: type = np.uint8) -> np.ndarray:
    """A zero-filled array carved from anonymous memory advised into transparent huge pages.

    Why: a decoded token streams every repacked 4-bit tile once, and with 4 KB pages each page
    is a TLB miss and a fresh start for the hardware prefetcher; in 2 MB pages the same kernels
    decode the benchmark model ~15% faster (q4_tiled, int8 activations: 160 -> 185 t/s). Arrays
    are packed back to back (64-byte aligned) into 64 MB reservations, so small matrices do not
    each round up to a huge page; like ``np.zeros``, nothing is resident until written (then a
    2 MB page at a time), and the pages of an array that dies are given back (``_give_back``).
    Falls back to ``np.zeros`` where madvise is unavailable."""
    n = 1
    for d in shape:
        n *= int(d)
    nbytes = n * np.dtype(dtype).itemsize
    if nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(shape, dtype)
    with _arena_lock:
        m, start, off, size = _arena
        off = (off + 63) // 64 * 64
        if m is None or off + nbytes > size:
            size = max(_CHUNK, (nbytes + _HUGE - 1) // _HUGE * _HUGE)
            try:
                m = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                start = (-np.frombuffer(m, np.uint8, count=1).ctypes.data) % _HUGE
                m.madvise(mmap.MADV_HUGEPAGE, start, size)
            except (OSError, ValueError):  # pragma: no cover - no THP support
                return np.zeros(shape, dtype)
            off = 0
        _arena[:] = [m, start, off + nbytes, size]
    root = np.frombuffer(m, np.uint8, count=nbytes, offset=start + off)
    # on the root, not the returned view: every view of the result keeps the root alive, so the
    # pages go back only when no view can read them
    weakref.finalize(root, _give_back, m, start + off, start + off + nbytes)
    return root.view(dtype).reshape(shape)
