"""The RMSNorm's sum of squares in LLVM IR: numpy's eight-accumulator leaf as one vector.

numpy's pairwise sum adds a leaf of up to 128 float64 squares with eight accumulators, r_k over
the elements i ≡ k (mod 8), combined as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)). The
eight accumulators are the eight lanes of one <8 x double>: numba compiled the scalar form as
scalar code (``vcvtss2sd``, ``vmulsd``, ``vaddsd`` per element, ~0.5 µs a 576-wide row, 4% of a
16-sequence decode step of SmolLM2-135M). Here each step is one widening load, one multiply and
one add of eight lanes — the same IEEE operations on the same values in the same order (a
float32 squared is exact in float64, so the products need no rounding care), hence the same bits.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I64, _F32, _F64 = ir.IntType(64), ir.FloatType(), ir.DoubleType()
_V8F, _V8D = ir.VectorType(_F32, 8), ir.VectorType(_F64, 8)


@intrinsic
def squares8(typingctx, x, t, lo, m):  # noqa: ANN001 - numba intrinsic signature
    """Σ float64(x[t, i])² over i in [lo, m) of a float32 array x [T, n] whose rows are
    contiguous, (m − lo) a positive multiple of 8, in numpy's leaf order (eight accumulators,
    the tree above)."""
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 2):
        return None
    sig = types.float64(x, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        row = builder.mul(args[1], cgutils.unpack_tuple(builder, arr.strides, 2)[0])
        byte = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        base = builder.bitcast(builder.gep(byte, [row]), _F32.as_pointer())
        lo, m = args[2], args[3]

        def eight(i):  # noqa: ANN001, ANN202 - elements i .. i + 7 as float64 lanes
            p = builder.bitcast(builder.gep(base, [i]), _V8F.as_pointer())
            return builder.fpext(builder.load(p, align=4), _V8D)

        first = eight(lo)
        acc = cgutils.alloca_once_value(builder, builder.fmul(first, first))
        with cgutils.for_range_slice(builder, builder.add(lo, ir.Constant(_I64, 8)), m, ir.Constant(_I64, 8)) as (i, _):
            v = eight(i)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(v, v)), acc)
        r = builder.load(acc)
        e = [builder.extract_element(r, ir.Constant(ir.IntType(32), k)) for k in range(8)]
        left = builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3]))
        right = builder.fadd(builder.fadd(e[4], e[5]), builder.fadd(e[6], e[7]))
        return builder.fadd(left, right)

    return sig, codegen


__all__ = ["squares8"]
