"""Dot products of weight rows with float32 vectors in one fixed summation order (LLVM IR).

Every float mat-vec body of the q8, f16/bf16 and f32 families — their one row-range body
(``rows.row_dots`` and its paired form), run by the LinearOps, the one-token grouped products and
the batched server step — sums a row the same way, spelled out here rather than left to
LLVM's loop vectorizer: per (row, vector) two 8-lane partial sums of fused multiply-adds, lanes
over elements 16j..16j+7 and 16j+8..16j+15, added together and reduced by a fixed tree of
strict adds (lane i + lane i+4, then i + i+2, then 0 + 1), then the elements past the last block
of 16 one by one by fused multiply-adds.

Why not the vectorizer: it picks the vector width and the number of partial sums per CPU and per
loop (AVX2: 8 lanes × 2; Skylake-X/Ice Lake/Sapphire Rapids: 8 × 4; Zen 4: 16 × 4, and a
vectorized epilogue of another width), so a loop that converts each weight block once for two
vectors summed in another order than the one-vector loop, and on AVX-512 hosts the batched rows
differed from the one-token ones in the last bits. With one order written down, a row's value is
the same in every kernel, for any number of rows or vectors per pass, and on every CPU with
fused multiply-add (no operation here may be reordered, see ``_STRICT``). The
kernels: :func:`dot4` (four rows, one vector: x loaded once for four rows), :func:`dot1` (one
row), :func:`dot22` (two rows × two vectors: each weight block converted once for two vectors).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

_F32 = ir.FloatType()
_V8 = ir.VectorType(_F32, 8)
_V1 = ir.VectorType(_F32, 1)
_I64 = ir.IntType(64)
# numba's fastmath pass gives every float operation without flags its reassoc/contract set, and every
# call returning a scalar float too: the adds carry "nsz" alone (which permits no reordering) and
# the scalar multiply-adds are one-lane vector calls, so the order below is the order that runs.
_STRICT = ("nsz",)
ELEMS = ("i8", "f16", "bf16", "f32")


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


def _one(builder: ir.IRBuilder, f: ir.Value) -> ir.Value:
    """A float as a one-lane vector."""
    return builder.insert_element(ir.Constant(_V1, None), f, ir.Constant(ir.IntType(32), 0))


def _reduce(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """The 8 lanes' sum as a fixed tree of strict adds: (i + i+4), then (i + i+2), then (0 + 1)."""
    for half in (4, 2, 1):
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half),
                                                      list(range(half, 2 * half))))
        v = builder.fadd(lo, hi, flags=_STRICT)
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


def _dot_codegen(elem: str, nrows: int, nvecs: int):
    """IR for ``nrows`` weight rows times ``nvecs`` vectors (arguments: the rows, then the
    vectors, all of one length); returns the nrows·nvecs sums, vector-major."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202 - numba's codegen protocol
        arrs = [context.make_array(t)(context, builder, v) for t, v in zip(sig.args, args)]
        ws = [a.data for a in arrs[:nrows]]
        xs = [a.data for a in arrs[nrows:]]
        n = builder.extract_value(arrs[nrows].shape, 0)
        wt = ws[0].type.pointee
        fma_v = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8] * 3), "llvm.fma.v8f32")
        fma_s = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V1, [_V1] * 3), "llvm.fma.v1f32")
        zero = ir.Constant(_V8, [0.0] * 8)
        pairs = [(r, v) for v in range(nvecs) for r in range(nrows)]  # the output order
        acc = {(r, v, h): cgutils.alloca_once_value(builder, zero) for r, v in pairs for h in range(2)}

        def vload(ptr: ir.Value, ty: ir.Type, idx: ir.Value, align: int) -> ir.Value:
            p = builder.bitcast(builder.gep(ptr, [idx]), ir.PointerType(ir.VectorType(ty, 8)))
            return builder.load(p, align=align)

        blocks = builder.udiv(n, ir.Constant(_I64, 16))
        with cgutils.for_range(builder, blocks) as loop:
            lo = builder.mul(loop.index, ir.Constant(_I64, 16))
            idx = (lo, builder.add(lo, ir.Constant(_I64, 8)))
            walign = max(1, wt.width // 8) if isinstance(wt, ir.IntType) else 4
            w = {(r, h): _convert(builder, vload(ws[r], wt, idx[h], walign), elem)
                 for r in range(nrows) for h in range(2)}
            x = {(v, h): vload(xs[v], _F32, idx[h], 4) for v in range(nvecs) for h in range(2)}
            for r, v in pairs:
                for h in range(2):
                    a = acc[r, v, h]
                    builder.store(builder.call(fma_v, [w[r, h], x[v, h], builder.load(a)]), a)
        sums = [cgutils.alloca_once_value(builder, _reduce(builder, builder.fadd(
            builder.load(acc[r, v, 1]), builder.load(acc[r, v, 0]), flags=_STRICT))) for r, v in pairs]
        start = builder.mul(blocks, ir.Constant(_I64, 16))
        with cgutils.for_range_slice(builder, start, n, ir.Constant(_I64, 1)) as (i, _):
            wv = [_one(builder, _convert(builder, builder.load(builder.gep(p, [i])), elem)) for p in ws]
            xv = [_one(builder, builder.load(builder.gep(p, [i]))) for p in xs]
            for k, (r, v) in enumerate(pairs):
                acc1 = _one(builder, builder.load(sums[k]))
                out = builder.call(fma_s, [wv[r], xv[v], acc1])
                builder.store(builder.extract_element(out, ir.Constant(ir.IntType(32), 0)), sums[k])
        vals = [builder.load(s) for s in sums]
        return context.make_tuple(builder, sig.return_type, vals)
    return codegen


def _make(elem: str, nrows: int, nvecs: int):
    """A numba intrinsic for ``nrows`` rows × ``nvecs`` vectors (intrinsics take no ``*args``)."""
    def typer(arrays: tuple):  # noqa: ANN202
        return types.UniTuple(types.float32, nrows * nvecs)(*arrays), _dot_codegen(elem, nrows, nvecs)

    if nrows + nvecs == 2:
        def dot(typingctx, a, b):  # noqa: ANN001, ANN202 - numba intrinsic signature
            return typer((a, b))
    elif nrows + nvecs == 4:
        def dot(typingctx, a, b, c, d):  # noqa: ANN001, ANN202
            return typer((a, b, c, d))
    else:
        def dot(typingctx, a, b, c, d, e):  # noqa: ANN001, ANN202
            return typer((a, b, c, d, e))
    return intrinsic(dot)


_KERNELS = {(e, r, v): _make(e, r, v) for e in ELEMS for r, v in ((4, 1), (1, 1), (2, 2))}


# weight element types with one kernel each (uint16 holds f16 or bf16 bits: chosen by ``kind``)
_ELEM = {types.int8: "i8", types.float32: "f32"}


def _contiguous(*arrays) -> bool:  # noqa: ANN002
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays)


def dot4(wa, wb, wc, wd, x, kind):  # noqa: ANN001, ANN201 - typed by the overload below
    """(wa·x, wb·x, wc·x, wd·x) for 1-D weight rows (int8, f32, or f16/bf16 bits: kind 1 / other)
    and a float32 vector of their length."""


def dot1(w, x, kind):  # noqa: ANN001, ANN201 - typed by the overload below
    """w·x in :func:`dot4`'s order."""


def dot22(wa, wb, x0, x1, kind):  # noqa: ANN001, ANN201 - typed by the overload below
    """(wa·x0, wb·x0, wa·x1, wb·x1), each weight block converted once for both vectors."""


@overload(dot4, inline="always")
def _dot4_impl(wa, wb, wc, wd, x, kind):  # noqa: ANN001, ANN202 - chosen by the weight type
    if not _contiguous(wa, wb, wc, wd, x):  # the IR reads each row as one contiguous run
        c = np.ascontiguousarray
        return lambda wa, wb, wc, wd, x, kind: dot4(c(wa), c(wb), c(wc), c(wd), c(x), kind)
    if wa.dtype == types.uint16:
        f16, bf16 = _KERNELS["f16", 4, 1], _KERNELS["bf16", 4, 1]
        return lambda wa, wb, wc, wd, x, kind: (f16(wa, wb, wc, wd, x) if kind == 1 else bf16(wa, wb, wc, wd, x))
    if wa.dtype not in _ELEM:
        return None
    k = _KERNELS[_ELEM[wa.dtype], 4, 1]
    return lambda wa, wb, wc, wd, x, kind: k(wa, wb, wc, wd, x)


@overload(dot1, inline="always")
def _dot1_impl(w, x, kind):  # noqa: ANN001, ANN202 - chosen by the weight type
    if not _contiguous(w, x):
        c = np.ascontiguousarray
        return lambda w, x, kind: dot1(c(w), c(x), kind)
    if w.dtype == types.uint16:
        f16, bf16 = _KERNELS["f16", 1, 1], _KERNELS["bf16", 1, 1]
        return lambda w, x, kind: (f16(w, x)[0] if kind == 1 else bf16(w, x)[0])
    if w.dtype not in _ELEM:
        return None
    k = _KERNELS[_ELEM[w.dtype], 1, 1]
    return lambda w, x, kind: k(w, x)[0]


@overload(dot22, inline="always")
def _dot22_impl(wa, wb, x0, x1, kind):  # noqa: ANN001, ANN202 - chosen by the weight type
    if not _contiguous(wa, wb, x0, x1):
        c = np.ascontiguousarray
        return lambda wa, wb, x0, x1, kind: dot22(c(wa), c(wb), c(x0), c(x1), kind)
    if wa.dtype == types.uint16:
        f16, bf16 = _KERNELS["f16", 2, 2], _KERNELS["bf16", 2, 2]
        return lambda wa, wb, x0, x1, kind: (f16(wa, wb, x0, x1) if kind == 1 else bf16(wa, wb, x0, x1))
    if wa.dtype not in _ELEM:
        return None
    k = _KERNELS[_ELEM[wa.dtype], 2, 2]
    return lambda wa, wb, x0, x1, kind: k(wa, wb, x0, x1)
