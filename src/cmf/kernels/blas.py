"""sgemm callable from numba kernels: numpy's own OpenBLAS, reached through its C entry point.

Why: prefill multiplies a dequantized tile by a block of tokens. With numpy's ``np.dot`` the
tile is dequantized by numba threads and multiplied by OpenBLAS threads; on a 2-core machine
the two pools take turns, and the one that just finished keeps spinning on a core the other
needs (measured: 5-10x slower prefill under any background load). Calling ``cblas_sgemm`` from
inside the numba worker threads instead — each thread dequantizes its own rows and multiplies
them single-threaded — keeps one pool and the tile hot in the thread's cache.

The function address is passed to the kernels as an integer argument (``SGEMM.addr``) rather
than baked into the code, so the kernels stay cacheable (numba refuses to cache functions that
reference ctypes pointers). Where numpy is not linked against an OpenBLAS that exports
``cblas_sgemm`` (other BLAS vendors), ``SGEMM.addr`` is 0 and callers use ``np.dot`` instead.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

log = logging.getLogger(__name__)

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


@dataclass(frozen=True)
class Blas:
    """numpy's OpenBLAS entry points (``addr`` 0: not found)."""

    addr: int  # cblas_sgemm
    ilp64: int  # 1 when its integer arguments are 64-bit
    set_threads: Callable[[int], None] | None
    get_threads: Callable[[], int] | None


def _find() -> Blas:
    none = Blas(0, 0, None, None)
    try:
        libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
        libs += glob.glob(os.path.join(os.path.dirname(np.__file__), ".dylibs", "*openblas*"))
        for path in libs:
            lib = ctypes.CDLL(path)
            for name, ilp64 in (("scipy_cblas_sgemm64_", 1), ("cblas_sgemm64_", 1), ("scipy_cblas_sgemm", 0),
                                ("cblas_sgemm", 0)):
                if not hasattr(lib, name):
                    continue
                addr = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
                sfx = "64_" if ilp64 else ""
                setter = getter = None
                for s, g in ((f"scipy_openblas_set_num_threads{sfx}", f"scipy_openblas_get_num_threads{sfx}"),
                             ("openblas_set_num_threads", "openblas_get_num_threads")):
                    if hasattr(lib, s) and hasattr(lib, g):
                        setter, getter = getattr(lib, s), getattr(lib, g)
                        setter.argtypes, setter.restype = [ctypes.c_int], None
                        getter.argtypes, getter.restype = [], ctypes.c_int
                        break
                return Blas(addr, ilp64, setter, getter)
    except OSError as exc:  # pragma: no cover - unusual installs
        log.debug("OpenBLAS entry points not found: %s", exc)
    return none


SGEMM = _find()


@contextmanager
def single_threaded() -> Iterator[None]:
    """OpenBLAS on one thread for the duration: the callers are numba worker threads, each
    running its own sgemm (OpenBLAS's thread count is process-wide, not per thread)."""
    if SGEMM.set_threads is None:
        yield
        return
    old = SGEMM.get_threads()
    if old != 1:
        SGEMM.set_threads(1)
    try:
        yield
    finally:
        if old != 1:
            SGEMM.set_threads(old)


@intrinsic
def sgemm(typingctx, addr, ilp64, tb, M, N, K, A, lda, B, ldb, C, ldc):  # noqa: ANN001
    """C[M, N] = A[M, K] @ op(B) (row-major; op(B) = Bᵀ when ``tb`` is TRANS, B [N, K] then,
    else B [K, N]); A, B, C are arrays whose first element starts the operand. ``addr`` and
    ``ilp64`` come from :data:`SGEMM`."""
    def codegen(context, builder, sig, args):
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        fp = ir.PointerType(f32)
        ptrs = [builder.bitcast(context.make_array(sig.args[i])(context, builder, args[i]).data, fp)
                for i in (6, 8, 10)]
        flag = builder.icmp_signed("!=", args[1], ir.Constant(i64, 0))
        with builder.if_else(flag) as (wide, narrow):
            for block, it in ((wide, i64), (narrow, i32)):
                with block:
                    fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, it, it, it, f32, fp, it, fp, it, f32, fp, it])
                    fn = builder.inttoptr(args[0], fnty.as_pointer())

                    def n(v):
                        return v if it is i64 else builder.trunc(v, i32)
                    order, ta = ir.Constant(i32, ROW_MAJOR), ir.Constant(i32, NO_TRANS)
                    builder.call(fn, [order, ta, builder.trunc(args[2], i32), n(args[3]), n(args[4]), n(args[5]),
                                      ir.Constant(f32, 1.0), ptrs[0], n(args[7]), ptrs[1], n(args[9]),
                                      ir.Constant(f32, 0.0), ptrs[2], n(args[11])])
        return context.get_dummy_value()
    sig = types.void(addr, ilp64, tb, M, N, K, A, lda, B, ldb, C, ldc)
    return sig, codegen


__all__ = ["SGEMM", "sgemm", "single_threaded", "TRANS", "NO_TRANS"]
