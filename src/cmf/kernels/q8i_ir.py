"""The q8 integer product in LLVM IR: 32 rows × up to four int8 activation vectors, all groups.

``q8i.py`` packs a q8 matrix into 32-row blocks (per group of 32 features: eight 4-byte words,
each word the 32 rows' words one after another, so 16 rows' words are one 64-byte vector with one
row per 32-bit lane) storing u = q + 128 (q XOR 0x80: unsigned bytes for ``vpdpbusd``). For
each group g this kernel forms, per row and vector, the exact integer

    I_g = Σ_k u_k·x_k − 128·Σ_k x_k = Σ_k q_k·x_k

(x: the vector's int8 activations of the group; ``xc`` holds 128·Σ x_k — on the 512-bit VNNI path
the integer chain starts at −128·Σ x_k instead of subtracting it per 16 rows) and accumulates
``acc = fma(float(I_g), d_g, acc)`` over the groups in order (d_g: the group's activation scale).
Each (row, vector) value is thus one fixed sequence of operations whatever the number of vectors
per call or the CPU: a sequence's product never depends on the rest of its batch.

The integer sums run on the CPU's integer dot (``int_dot``): ``vpdpbusd`` on 512-bit vectors or on
256-bit halves where the CPU has VNNI; on AVX2 ``vpmaddubsw`` of |q| by x carrying q's sign
(``int_dot.signed_dots_avx2``: no saturation, no correction term); on the portable path each byte is split into
its two nibbles, whose sums the 4-bit kernels' ``group_dots`` form without saturation, recombined
as 16·Σ hi·x + Σ lo·x. The same integers on every path.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import int_dot
from ..numba_prims import ir_pointers, ir_prefetch, ir_splat, ir_vec_load

_I32, _I64 = ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_V16 = ir.VectorType(_I32, 16)
_VF = ir.VectorType(_F32, 16)
_RECIP_127 = float(np.float32(1.0 / 127))  # the float32 reciprocal the helper's arcp division multiplies by
ROWS = 32  # rows per packed block
WORDS = 8  # 4-byte words per row and group
GROUP_BYTES = ROWS * WORDS * 4  # one block's bytes per group (1 KB)
MAX_VECS = 4


def vecs_per_pass(path: str) -> int:
    """Vectors a pass over a block takes on ``path``: one on the 256-bit paths, whose codes and
    broadcast x then fit the 16 ymm registers (four vectors' spilled: prefill-512 1.02-1.04x on
    AVX2, 1.28x on AVX-VNNI with one); four on 512 bits (prefill 1.18x that with one;
    docs/PERFORMANCE.md "q8 with int8 activations")."""
    return 1 if path in ("avx2", "avxvnni") else MAX_VECS


VECS_PER_PASS = vecs_per_pass(int_dot.DOT_PATH)  # this target's


def _integer_sums(builder, codes: list, xs: list, path: str, corr: list) -> list:  # noqa: ANN001
    """codes[b][w]: <16 x i32> of 16 rows' word w; xs[v][w]: vector v's word w (i32); corr[v]:
    vector v's correction (<16 x i32>, 128·Σx in every lane). Returns sums[b][v] = per lane
    Σ_w Σ_bytes u·x − corr[v] = Σ q·x (exact, u the unsigned code bytes)."""
    if path == "vnni512":  # word by word, every (block, vector) chain interleaved
        splat = [[ir_splat(builder, x, _V16) for x in xv] for xv in xs]
        # the chains start at −corr: the same integers without a subtraction per 16 rows
        neg = [builder.sub(ir.Constant(_V16, [0] * 16), c) for c in corr]
        acc = [[neg[v] for v in range(len(xs))] for _ in codes]
        for w in range(WORDS):
            for b in range(len(codes)):
                for v in range(len(xs)):
                    acc[b][v] = int_dot.vnni512_acc(builder, acc[b][v], codes[b][w], splat[v][w])
        return acc
    if path == "avxvnni":  # vpdpbusd takes any unsigned byte (no saturation)
        return [[builder.sub(int_dot.group_dot(builder, list(zip(cb, xv)), path), c) for xv, c in zip(xs, corr)]
                for cb in codes]
    if path == "avx2":  # the stored u = q XOR 0x80 turned back into q, then the sign form
        flip = ir.Constant(_V16, [0x80808080] * 16)
        return [int_dot.signed_dots_avx2(builder, [builder.xor(c, flip) for c in cb], xs) for cb in codes]
    # portable: bytes as two nibbles, each within the 4-bit forms' bounds
    low = ir.Constant(_V16, [0x0F0F0F0F] * 16)
    four = ir.Constant(_V16, [4] * 16)
    out = []
    for cb in codes:
        hi = [builder.and_(builder.lshr(c, four), low) for c in cb]
        lo = [builder.and_(c, low) for c in cb]
        sh = int_dot.group_dots(builder, hi, xs, path)
        sl = int_dot.group_dots(builder, lo, xs, path)
        out.append([builder.sub(builder.add(builder.shl(h, four), lo_), c) for h, lo_, c in zip(sh, sl, corr)])
    return out


def _emit_block(builder, pp, base, xp, xoff, vstride, cp, dp, soff, gpr, pf, lines, nvecs: int,  # noqa: ANN001
                path: str) -> list:
    """One block's pass over every group for ``nvecs`` vectors; returns accs[b][v] (<16 x float>:
    rows 16b .. 16b + 15, vector v) = Σ_g fma(float(I_g), d_g, ·) from 0.0, groups in order.
    ``pf`` > 0: prefetch lines [l0, l1) of ``lines`` (of the 16) of each group's kilobyte ``pf``
    bytes ahead."""
    c64 = lambda n: ir.Constant(_I64, n)  # noqa: E731
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * 16)) for _ in range(nvecs)] for _ in range(2)]
    want_pf = builder.icmp_signed(">", pf, c64(0))
    with cgutils.for_range(builder, gpr) as loop:
        g = loop.index
        gb = builder.add(base, builder.mul(g, c64(GROUP_BYTES)))
        with builder.if_then(want_pf, likely=False):
            ahead = builder.add(gb, pf)
            with cgutils.for_range_slice(builder, lines[0], lines[1], c64(1)) as (line, _):
                ir_prefetch(builder, cgutils.gep(builder, pp, builder.add(ahead, builder.mul(line, c64(64)))))
        codes = [[ir_vec_load(builder, cgutils.gep(builder, pp, builder.add(gb, c64(128 * w + 64 * b))), _V16)
                  for w in range(WORDS)] for b in range(2)]
        xs = []
        for v in range(nvecs):
            at = builder.add(builder.add(xoff, builder.mul(c64(v), vstride)), builder.mul(g, c64(WORDS)))
            xs.append([builder.load(cgutils.gep(builder, xp, builder.add(at, c64(w)))) for w in range(WORDS)])
        ks = [builder.add(builder.add(soff, builder.mul(c64(v), gpr)), g) for v in range(nvecs)]
        corr = [ir_splat(builder, builder.load(cgutils.gep(builder, cp, k)), _V16) for k in ks]
        sums = _integer_sums(builder, codes, xs, path, corr)
        for v in range(nvecs):
            dv = ir_splat(builder, builder.load(cgutils.gep(builder, dp, ks[v])), _VF)
            for b in range(2):
                a = accs[b][v]
                builder.store(builder.call(fma, [builder.sitofp(sums[b][v], _VF), dv, builder.load(a)]), a)
    return [[builder.load(a) for a in row] for row in accs]


def _make(nvecs: int, path: str | None = None):  # noqa: ANN202 - returns a numba intrinsic
    @intrinsic
    def q8i_block(typingctx, planes, base, xv, xoff, vstride, xc, d, soff, gpr, out, pf):  # noqa: ANN001
        """out[32v + i] = Σ_g d[soff + v·gpr + g]·I_g(row i, vector v) for the block at
        planes[base:] and vectors v < nvecs (x words at xv[xoff + v·vstride:], corrections
        xc and scales d at [soff + v·gpr + g]). ``pf`` > 0: while reading each group's kilobyte,
        prefetch the kilobyte ``pf`` bytes further (the next block, on the first pass over this
        one): the hardware prefetcher alone left a 16-sequence product ~35% slower from memory
        than from cache."""
        sig = types.void(planes, types.int64, xv, types.int64, types.int64, xc, d, types.int64, types.int64, out,
                         types.int64)

        def codegen(context, builder, signature, args):
            pp, xp, cp, dp, op = ir_pointers(context, builder, signature, args, 0, 2, 5, 6, 9)
            every = (ir.Constant(_I64, 0), ir.Constant(_I64, GROUP_BYTES // 64))  # all of a group's lines
            accs = _emit_block(builder, pp, args[1], xp, args[3], args[4], cp, dp, args[7], args[8], args[10], every,
                               nvecs, path or int_dot.DOT_PATH)
            for v in range(nvecs):
                for b in range(2):
                    dst = cgutils.gep(builder, op, ir.Constant(_I64, ROWS * v + 16 * b))
                    builder.store(accs[b][v], builder.bitcast(dst, _VF.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return q8i_block


def _make_rows(path: str | None = None):  # noqa: ANN202 - returns a numba intrinsic
    @intrinsic
    def q8i_rows(typingctx, planes, b0, b1, xv, vstride, xc, d, gpr, nvec, s, Y, pf):  # noqa: ANN001
        """Y[t, 32·blk + i] = s[32·blk + i]·Σ_g d[t·gpr + g]·I_g(row 32·blk + i, vector t) for the
        whole blocks blk in [b0, b1) and vectors t < ``nvec``: :func:`vecs_per_pass` vectors per
        pass over a block (then the rest), as :func:`q8i_block4` … :func:`q8i_block1` compute them,
        the scale and the store into Y's rows (last axis contiguous) in the same compiled loop — the numba loop
        around the per-pass kernels cost a fifth of a 16-vector product. ``pf`` > 0: prefetch the
        next block (``pf`` bytes ahead), a share of it on each of the block's passes."""
        sig = types.void(planes, types.int64, types.int64, xv, types.int64, xc, d, types.int64, types.int64, s, Y,
                         types.int64)

        def codegen(context, builder, signature, args):
            pp, xp, cp, dp, sp = ir_pointers(context, builder, signature, args, 0, 3, 5, 6, 9)
            b0, b1, vstride, gpr, nvec, pf = args[1], args[2], args[4], args[7], args[8], args[11]
            yarr = context.make_array(signature.args[10])(context, builder, args[10])
            ystride = cgutils.unpack_tuple(builder, yarr.strides, 2)[0]
            ybase = builder.bitcast(yarr.data, ir.IntType(8).as_pointer())
            use = path or int_dot.DOT_PATH
            c64 = lambda n: ir.Constant(_I64, n)  # noqa: E731
            zero = c64(0)
            per = vecs_per_pass(use)

            # the next block's prefetches spread over this block's passes: each pass a share of every
            # group's 16 lines (all on the first pass: a 16-vector step's products ~20% slower from L3)
            npass = builder.sdiv(builder.add(nvec, c64(per - 1)), c64(per))
            share = builder.sdiv(builder.add(c64(GROUP_BYTES // 64 - 1), npass), npass)

            def one_pass(blk, t0, nvecs: int) -> None:  # noqa: ANN001
                base = builder.mul(blk, builder.mul(gpr, c64(GROUP_BYTES)))
                l0 = builder.mul(builder.sdiv(t0, c64(per)), share)
                l1 = builder.add(l0, share)
                l1 = builder.select(builder.icmp_signed(">", l1, c64(GROUP_BYTES // 64)), c64(GROUP_BYTES // 64), l1)
                accs = _emit_block(builder, pp, base, xp, builder.mul(t0, vstride), vstride, cp, dp,
                                   builder.mul(t0, gpr), gpr, pf, (l0, l1), nvecs, use)
                for b in range(2):
                    col = builder.add(builder.mul(blk, c64(ROWS)), c64(16 * b))
                    at_s = builder.bitcast(cgutils.gep(builder, sp, col), ir.IntType(8).as_pointer())
                    scale = ir_vec_load(builder, at_s, _VF)
                    for v in range(nvecs):
                        row = builder.add(t0, c64(v))
                        at = builder.gep(ybase, [builder.add(builder.mul(row, ystride), builder.mul(col, c64(4)))])
                        builder.store(builder.fmul(accs[b][v], scale), builder.bitcast(at, _VF.as_pointer()), align=4)

            whole = builder.mul(builder.sdiv(nvec, c64(per)), c64(per))
            rest = builder.sub(nvec, whole)
            with cgutils.for_range_slice(builder, b0, b1, c64(1)) as (blk, _):
                with cgutils.for_range_slice(builder, zero, whole, c64(per)) as (t0, _):
                    one_pass(blk, t0, per)
                for n in range(1, per):
                    with builder.if_then(builder.icmp_signed("==", rest, c64(n))):
                        one_pass(blk, whole, n)
            return context.get_dummy_value()

        return sig, codegen

    return q8i_rows


q8i_rows = _make_rows()


@intrinsic
def quantize_rows(typingctx, X, t0, t1, xq, d, xc):  # noqa: ANN001
    """Rows [t0, t1) of X [T, 32·gpr] float32 (C-contiguous) → int8 activations ``xq``, scales ``d``
    and corrections ``xc`` = 128·Σ q per group of 32, one vector pass per group. The rule is
    ``xprep.group_scale``'s as the compiled helper evaluated it (its ``arcp`` made d = max|x|·(1/127)
    and 1/d = 127/max|x|): q = rint(x·(1/d)) ties to even, 0 where x·(1/d) is NaN, and a group
    holding inf or NaN gets d = NaN — the same bits as before (tests/test_q8_int8.py), in half the
    time of the per-group helper calls (7 → 3.5 µs for 16 × 576 features)."""
    sig = types.void(X, types.int64, types.int64, xq, d, xc)

    def codegen(context, builder, signature, args):
        xp, qp, dp, cp = ir_pointers(context, builder, signature, args, 0, 3, 4, 5)
        dshape = context.make_array(signature.args[4])(context, builder, args[4]).shape
        gpr = cgutils.unpack_tuple(builder, dshape, 2)[1]
        c64 = lambda n: ir.Constant(_I64, n)  # noqa: E731
        v32, i32v, i8v = ir.VectorType(_F32, 32), ir.VectorType(_I32, 32), ir.VectorType(ir.IntType(8), 32)
        rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32]), "llvm.rint.v32f32")
        radd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [i32v]),
                                              "llvm.vector.reduce.add.v32i32")
        umax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [i32v]),
                                              "llvm.vector.reduce.umax.v32i32")
        xbytes = builder.bitcast(xp, ir.IntType(8).as_pointer())
        with cgutils.for_range_slice(builder, args[1], args[2], c64(1)) as (t, _):
            with cgutils.for_range(builder, gpr) as loop:
                k = builder.add(builder.mul(t, gpr), loop.index)  # the group's index in d / xc
                at = builder.mul(k, c64(32))  # its first feature in X / xq
                raw = builder.load(builder.bitcast(builder.gep(xbytes, [builder.mul(at, c64(4))]), i32v.as_pointer()),
                                   align=4)
                top = builder.call(umax, [builder.and_(raw, ir.Constant(i32v, [0x7FFFFFFF] * 32))])
                special = builder.icmp_unsigned(">=", top, ir.Constant(_I32, 0x7F800000))
                dd = builder.fmul(builder.bitcast(top, _F32), ir.Constant(_F32, _RECIP_127))
                dd = builder.select(special, ir.Constant(_F32, 0.0), dd)
                inv = builder.select(builder.fcmp_ordered(">", dd, ir.Constant(_F32, 0.0)),  # 1/d, folded as 127/max
                                     builder.fdiv(ir.Constant(_F32, 127.0), builder.bitcast(top, _F32)),
                                     ir.Constant(_F32, 0.0))
                v = builder.fmul(builder.bitcast(raw, v32), ir_splat(builder, inv, v32))
                v = builder.select(builder.fcmp_unordered("uno", v, v), ir.Constant(v32, [0.0] * 32), v)
                qi = builder.fptosi(builder.call(rint, [v]), i32v)
                builder.store(builder.trunc(qi, i8v), builder.bitcast(cgutils.gep(builder, qp, at), i8v.as_pointer()),
                              align=1)
                corr = builder.mul(builder.call(radd, [qi]), ir.Constant(_I32, 128))
                builder.store(corr, cgutils.gep(builder, cp, k))
                nan = ir.Constant(_F32, float("nan"))
                builder.store(builder.select(special, nan, dd), cgutils.gep(builder, dp, k))
        return context.get_dummy_value()

    return sig, codegen


q8i_block1, q8i_block2, q8i_block3, q8i_block4 = (_make(n) for n in range(1, MAX_VECS + 1))


def kernels_for(path: str) -> tuple:
    """The four intrinsics (1..4 vectors) forced onto ``path`` (tests compare the paths)."""
    return tuple(_make(n, path) for n in range(1, MAX_VECS + 1))


def rows_for(path: str):  # noqa: ANN201 - a numba intrinsic
    """:data:`q8i_rows` forced onto ``path``."""
    return _make_rows(path)


__all__ = ["GROUP_BYTES", "MAX_VECS", "ROWS", "VECS_PER_PASS", "WORDS", "kernels_for", "q8i_block1", "q8i_block2",
           "q8i_block3", "q8i_block4", "q8i_rows", "quantize_rows", "rows_for", "vecs_per_pass"]
