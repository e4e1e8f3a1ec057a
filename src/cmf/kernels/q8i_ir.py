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
256-bit halves where the CPU has VNNI; elsewhere (AVX2, portable IR) each byte is split into its
two nibbles, whose sums the 4-bit kernels' ``group_dots`` form without saturation, and recombined
as 16·Σ hi·x + Σ lo·x — the same integers.
"""

from __future__ import annotations

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
ROWS = 32  # rows per packed block
WORDS = 8  # 4-byte words per row and group
GROUP_BYTES = ROWS * WORDS * 4  # one block's bytes per group (1 KB)
MAX_VECS = 4


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
    # AVX2 / portable: bytes as two nibbles, each within the 4-bit forms' bounds
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
            base, xoff, vstride, soff, gpr = args[1], args[3], args[4], args[7], args[8]
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * 16)) for _ in range(nvecs)]
                    for _ in range(2)]
            use = path or int_dot.DOT_PATH
            pf = args[10]
            want_pf = builder.icmp_signed(">", pf, ir.Constant(_I64, 0))
            with cgutils.for_range(builder, gpr) as loop:
                g = loop.index
                gb = builder.add(base, builder.mul(g, ir.Constant(_I64, GROUP_BYTES)))
                with builder.if_then(want_pf, likely=False):
                    ahead = builder.add(gb, pf)
                    for line in range(GROUP_BYTES // 64):
                        ir_prefetch(builder, cgutils.gep(builder, pp, builder.add(ahead, ir.Constant(_I64, 64 * line))))
                codes = [[ir_vec_load(builder, cgutils.gep(builder, pp, builder.add(
                    gb, ir.Constant(_I64, 128 * w + 64 * b))), _V16) for w in range(WORDS)] for b in range(2)]
                xs = []
                for v in range(nvecs):
                    at = builder.add(builder.add(xoff, builder.mul(ir.Constant(_I64, v), vstride)),
                                     builder.mul(g, ir.Constant(_I64, WORDS)))
                    xs.append([builder.load(cgutils.gep(builder, xp, builder.add(at, ir.Constant(_I64, w))))
                               for w in range(WORDS)])
                ks = [builder.add(builder.add(soff, builder.mul(ir.Constant(_I64, v), gpr)), g) for v in range(nvecs)]
                corr = [ir_splat(builder, builder.load(cgutils.gep(builder, cp, k)), _V16) for k in ks]
                sums = _integer_sums(builder, codes, xs, use, corr)
                for v in range(nvecs):
                    dv = ir_splat(builder, builder.load(cgutils.gep(builder, dp, ks[v])), _VF)
                    for b in range(2):
                        f = builder.sitofp(sums[b][v], _VF)
                        a = accs[b][v]
                        builder.store(builder.call(fma, [f, dv, builder.load(a)]), a)
            for v in range(nvecs):
                for b in range(2):
                    dst = cgutils.gep(builder, op, ir.Constant(_I64, ROWS * v + 16 * b))
                    builder.store(builder.load(accs[b][v]), builder.bitcast(dst, _VF.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return q8i_block


q8i_block1, q8i_block2, q8i_block3, q8i_block4 = (_make(n) for n in range(1, MAX_VECS + 1))


def kernels_for(path: str) -> tuple:
    """The four intrinsics (1..4 vectors) forced onto ``path`` (tests compare the paths)."""
    return tuple(_make(n, path) for n in range(1, MAX_VECS + 1))


__all__ = ["GROUP_BYTES", "MAX_VECS", "ROWS", "WORDS", "kernels_for", "q8i_block1", "q8i_block2", "q8i_block3",
           "q8i_block4"]
