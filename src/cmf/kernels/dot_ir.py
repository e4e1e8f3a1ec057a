"""Two rows times two vectors in one loop, with the one-token kernel's summation order (LLVM IR).

``gemv._dot4_loop`` is a float reduction that LLVM vectorizes (reassoc) as two 8-lane partial sums
per row — lanes over elements 16j..16j+7 and 16j+8..16j+15 — added together and reduced by the
backend's shuffle tree, the elements past the last block of 16 added one by one. A batch of
vectors could reuse each converted weight block for several of them, but written in Python the
vectorizer picks another interleave for a loop with more sums, and the rows' results change in the
last bits. :func:`dot22` spells that summation out as IR: per (row, vector) the same two
partial-sum chains, fused multiply-adds, the same final add and ``llvm.vector.reduce.fadd``, the
same scalar tail; each weight block is loaded and converted once for both vectors. Whether the
result really equals the one-token kernel's on this CPU is checked at run time
(``gemv_batch.BatchGroup``), with the plain kernel as the fallback.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

_F32 = ir.FloatType()
_V8 = ir.VectorType(_F32, 8)
_I64 = ir.IntType(64)
_FAST = ("reassoc", "contract", "nsz", "arcp")  # the kernels' fastmath set (kernels/_jit.FASTMATH)


def _convert(builder: ir.IRBuilder, raw: ir.Value, elem: str) -> ir.Value:
    """8 (or 1) stored weights as float32, exactly (every storage type widens without rounding)."""
    n = raw.type.count if isinstance(raw.type, ir.VectorType) else None
    f = _V8 if n else _F32
    if elem == "i8":
        return builder.sitofp(raw, f)
    if elem == "f16":
        half = ir.VectorType(ir.HalfType(), n) if n else ir.HalfType()
        return builder.fpext(builder.bitcast(raw, half), f)
    if elem == "bf16":  # the bits are the top half of an f32
        i32 = ir.VectorType(ir.IntType(32), n) if n else ir.IntType(32)
        sh = ir.Constant(i32, [16] * n) if n else ir.Constant(i32, 16)
        return builder.bitcast(builder.shl(builder.zext(raw, i32), sh), f)
    return raw  # f32


def _dot22_codegen(elem: str):
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202 - numba's codegen protocol
        arrs = [context.make_array(t)(context, builder, v) for t, v in zip(sig.args, args)]
        wa, wb, x0, x1 = (a.data for a in arrs)
        n = builder.extract_value(arrs[2].shape, 0)
        wt = wa.type.pointee
        fma_v = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8] * 3), "llvm.fma.v8f32")
        fma_s = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        red_ty = ir.FunctionType(_F32, [_F32, _V8])
        reduce = cgutils.get_or_insert_function(builder.module, red_ty, "llvm.vector.reduce.fadd.v8f32")
        zero = ir.Constant(_V8, [0.0] * 8)
        # accumulators: (row a, row b) × (vector 0, 1) × (block half lo, hi)
        acc = [cgutils.alloca_once_value(builder, zero) for _ in range(8)]

        def vload(ptr: ir.Value, ty: ir.Type, idx: ir.Value, align: int) -> ir.Value:
            p = builder.bitcast(builder.gep(ptr, [idx]), ir.PointerType(ir.VectorType(ty, 8)))
            return builder.load(p, align=align)

        blocks = builder.udiv(n, ir.Constant(_I64, 16))
        with cgutils.for_range(builder, blocks) as loop:
            lo = builder.mul(loop.index, ir.Constant(_I64, 16))
            hi = builder.add(lo, ir.Constant(_I64, 8))
            walign = max(1, wt.width // 8) if isinstance(wt, ir.IntType) else 4
            w = [_convert(builder, vload(p, wt, i, walign), elem) for p in (wa, wb) for i in (lo, hi)]
            x = [vload(p, _F32, i, 4) for p in (x0, x1) for i in (lo, hi)]
            k = 0
            for r in range(2):
                for v in range(2):
                    for h in range(2):
                        out = builder.call(fma_v, [w[2 * r + h], x[2 * v + h], builder.load(acc[k])])
                        builder.store(out, acc[k])
                        k += 1
        sums = []
        for k in range(0, 8, 2):
            both = builder.fadd(builder.load(acc[k + 1]), builder.load(acc[k]), flags=_FAST)
            sums.append(cgutils.alloca_once_value(
                builder, builder.call(reduce, [ir.Constant(_F32, -0.0), both], fastmath=_FAST)))
        start = builder.mul(blocks, ir.Constant(_I64, 16))
        with cgutils.for_range_slice(builder, start, n, ir.Constant(_I64, 1)) as (i, _):
            ws = [_convert(builder, builder.load(builder.gep(p, [i])), elem) for p in (wa, wb)]
            xs = [builder.load(builder.gep(p, [i])) for p in (x0, x1)]
            for k, (r, v) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
                builder.store(builder.call(fma_s, [ws[r], xs[v], builder.load(sums[k])]), sums[k])
        vals = [builder.load(s) for s in sums]  # (a·x0, a·x1, b·x0, b·x1)
        return context.make_tuple(builder, sig.return_type, [vals[0], vals[2], vals[1], vals[3]])
    return codegen


def _make(elem: str):
    @intrinsic
    def dot(typingctx, wa, wb, x0, x1):  # noqa: ANN001, ANN202 - numba intrinsic signature
        return types.UniTuple(types.float32, 4)(wa, wb, x0, x1), _dot22_codegen(elem)
    return dot


_dot22_i8, _dot22_f16, _dot22_bf16, _dot22_f32 = (_make(e) for e in ("i8", "f16", "bf16", "f32"))


def dot22(wa, wb, x0, x1, kind):  # noqa: ANN001, ANN201 - typed by the overload below
    """(wa·x0, wb·x0, wa·x1, wb·x1) for 1-D weight rows (int8, f32, or f16/bf16 bits: kind 1/2)
    and float32 vectors of one length."""


@overload(dot22, inline="always")
def _dot22_impl(wa, wb, x0, x1, kind):  # noqa: ANN001, ANN202 - chosen by the weight type
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (wa, wb, x0, x1)):
        return None  # the IR reads each row as one contiguous run
    dt = wa.dtype
    if dt == types.int8:
        return lambda wa, wb, x0, x1, kind: _dot22_i8(wa, wb, x0, x1)
    if dt == types.uint16:
        def half(wa, wb, x0, x1, kind):  # noqa: ANN001, ANN202
            if kind == 1:
                return _dot22_f16(wa, wb, x0, x1)
            return _dot22_bf16(wa, wb, x0, x1)
        return half
    if dt == types.float32:
        return lambda wa, wb, x0, x1, kind: _dot22_f32(wa, wb, x0, x1)
    return None
