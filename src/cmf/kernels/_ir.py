"""Row dot products written directly in LLVM IR (numba intrinsics) where numba's loops do not vectorize.

Bit-packed formats need per-lane shifts and byte shuffles with constant patterns, and sign bits
are cheapest as lane masks; numba types all integer arithmetic as int64 and LLVM then leaves
these loops scalar (measured 0.5–0.9 GB/s). Each intrinsic here emits one row's loop over its
32-weight groups with explicit 16-lane vectors:

- ``vbit_dot{3,5,6,8}``: 16 codes of width b are 2b bytes; a constant shuffle gathers, for
  each lane, the byte holding the code's first bit and the next one, a per-lane shift and mask
  extract the code (MSB-first bit order), and the lanes multiply-add into a vector accumulator
  scaled by the group's f16 scale.
- ``vbit_dot4p``: width 4 against an x deinterleaved per group, so the high and low nibbles of
  one widening load are the codes (no shuffles, no per-lane shifts).
- ``q1_dot``: the 32 sign bits of a group are reinterpreted as a 32-lane mask selecting x
  (``Σ s·(2·bit − 1)·x = s·(2·Σ_{bit} x − Σx)``).

Accumulators live in allocas that LLVM promotes to registers; reads stay inside each row's bytes.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import int_dot
from ..numba_prims import ir_pointers as _pointers
from ..numba_prims import ir_splat as _splat
from ..numba_prims import ir_vec_load as _vec_load

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_VF = ir.VectorType(_F32, 16)
_FM = ("contract",)  # let LLVM fuse multiply-adds; no reassociation


def _load_f16(builder, ptr):  # noqa: ANN001, ANN202
    """float32 of the little-endian f16 at a byte pointer."""
    raw = builder.load(builder.bitcast(ptr, _I16.as_pointer()), align=1)
    return builder.fpext(builder.bitcast(raw, ir.HalfType()), _F32)


def _hsum(builder, vec):  # noqa: ANN001, ANN202
    """Pairwise horizontal sum of a float vector (power-of-two length)."""
    n = vec.type.count
    while n > 1:
        n //= 2
        undef = ir.Constant(vec.type, ir.Undefined)
        lo = builder.shuffle_vector(vec, undef, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(vec, undef, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        vec = builder.fadd(lo, hi)
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _make_vbit_dot(b: int):  # noqa: ANN202 - returns a numba intrinsic
    """The row dot of width-b vbit codes (b in 3, 5, 6, 8; width 4 is ``vbit_dot4p``)."""
    nbytes = 2 * b  # bytes of 16 codes
    first = [(b * m) >> 3 for m in range(16)]
    second = [min(f + 1, nbytes - 1) for f in first]  # unused lanes (code within one byte) clamp
    shifts = [16 - b - ((b * m) & 7) for m in range(16)]

    @intrinsic
    def vbit_dot(typingctx, data, pos, soff, gpr, x, xs, level):  # noqa: ANN001
        """Σ_g s_g·(Σ u·x − level·xs[g]) over one row: codes at data[pos:], f16 scales at
        data[soff:], x the row's input vector, xs[g] = Σ of x over group g."""
        sig = types.float32(data, types.int64, types.int64, types.int64, x, xs, types.float32)

        def codegen(context, builder, signature, args):
            dp, xp, sp = _pointers(context, builder, signature, args, 0, 4, 5)
            pos_v, soff_v, gpr_v, lvl = args[1], args[2], args[3], args[6]
            bty = ir.VectorType(_I8, nbytes)
            vi = ir.VectorType(_I32, 16)
            m1 = ir.Constant(ir.VectorType(_I32, 16), first)
            m2 = ir.Constant(ir.VectorType(_I32, 16), second)
            shift = ir.Constant(vi, shifts)
            mask = ir.Constant(vi, [(1 << b) - 1] * 16)
            eight = ir.Constant(vi, [8] * 16)
            accv = cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * 16))
            accz = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
            with cgutils.for_range(builder, gpr_v) as loop:
                g = loop.index
                s_off = builder.add(soff_v, builder.mul(g, ir.Constant(_I64, 2)))
                s = _load_f16(builder, cgutils.gep(builder, dp, s_off))
                gbase = builder.add(pos_v, builder.mul(g, ir.Constant(_I64, 4 * b)))
                part = ir.Constant(_VF, [0.0] * 16)
                for h in range(2):
                    at = builder.add(gbase, ir.Constant(_I64, h * nbytes))
                    raw = _vec_load(builder, cgutils.gep(builder, dp, at), bty)
                    hi = builder.zext(builder.shuffle_vector(raw, ir.Constant(bty, ir.Undefined), m1), vi)
                    lo = builder.zext(builder.shuffle_vector(raw, ir.Constant(bty, ir.Undefined), m2), vi)
                    word = builder.or_(builder.shl(hi, eight), lo)
                    code = builder.and_(builder.lshr(word, shift), mask)
                    xo = builder.add(builder.mul(g, ir.Constant(_I64, 32)), ir.Constant(_I64, 16 * h))
                    xv = _vec_load(builder, cgutils.gep(builder, xp, xo), _VF)
                    part = builder.fadd(part, builder.fmul(builder.uitofp(code, _VF), xv, flags=_FM), flags=_FM)
                sv = _splat(builder, s, _VF)
                builder.store(builder.fadd(builder.load(accv), builder.fmul(part, sv, flags=_FM), flags=_FM), accv)
                xsum = builder.load(cgutils.gep(builder, sp, g))
                builder.store(builder.fadd(builder.load(accz), builder.fmul(s, builder.fmul(lvl, xsum))), accz)
            return builder.fsub(_hsum(builder, builder.load(accv)), builder.load(accz))

        return sig, codegen

    return vbit_dot


@intrinsic
def vbit_dot4p(typingctx, data, pos, soff, gpr, xp):  # noqa: ANN001
    """Σ_g s_g·Σ (u − 7)·x over one width-4 row, with x deinterleaved per group (``xp[32g + j] =
    x[32g + 2j]``, ``xp[32g + 16 + j] = x[32g + 2j + 1]``, :func:`cmf.kernels.vbit.pair_x`).

    Why: a group's 16 bytes hold its 32 codes MSB-first, code 2j in the high nibble of byte j and
    code 2j + 1 in the low one. The general kernel gathers each code's bits with two shuffles and
    a per-lane shift (~28 vector ops a group, compute-bound at ~10 GB/s on 2 threads); against a
    deinterleaved x, one widening load gives the 16 high codes by a shift and the 16 low ones by a
    mask (~14 ops). The level is subtracted from the integer codes, so no Σx term is needed; two
    accumulators (even and odd groups) keep the multiply-add chain off the critical path."""
    sig = types.float32(data, types.int64, types.int64, types.int64, xp)

    def codegen(context, builder, signature, args):
        dp, xpp = _pointers(context, builder, signature, args, 0, 4)
        pos_v, soff_v, gpr_v = args[1], args[2], args[3]
        bty = ir.VectorType(_I8, 16)
        vi = ir.VectorType(_I32, 16)
        four = ir.Constant(vi, [4] * 16)
        low = ir.Constant(vi, [15] * 16)
        seven = ir.Constant(vi, [7] * 16)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * 16)) for _ in range(2)]

        def group(g, acc):  # noqa: ANN001, ANN202
            s = _load_f16(builder, cgutils.gep(builder, dp, builder.add(soff_v, builder.mul(g, ir.Constant(_I64, 2)))))
            at = builder.add(pos_v, builder.mul(g, ir.Constant(_I64, 16)))
            raw = _vec_load(builder, cgutils.gep(builder, dp, at), bty)
            w = builder.zext(raw, vi)
            hi = builder.sitofp(builder.sub(builder.lshr(w, four), seven), _VF)
            lo = builder.sitofp(builder.sub(builder.and_(w, low), seven), _VF)
            xo = builder.mul(g, ir.Constant(_I64, 32))
            xe = _vec_load(builder, cgutils.gep(builder, xpp, xo), _VF)
            xd = _vec_load(builder, cgutils.gep(builder, xpp, builder.add(xo, ir.Constant(_I64, 16))), _VF)
            part = builder.fadd(builder.fmul(hi, xe, flags=_FM), builder.fmul(lo, xd, flags=_FM), flags=_FM)
            sv = _splat(builder, s, _VF)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(part, sv, flags=_FM), flags=_FM), acc)

        pairs = builder.sdiv(gpr_v, ir.Constant(_I64, 2))
        with cgutils.for_range(builder, pairs) as loop:
            g0 = builder.mul(loop.index, ir.Constant(_I64, 2))
            group(g0, accs[0])
            group(builder.add(g0, ir.Constant(_I64, 1)), accs[1])
        odd = builder.icmp_signed("!=", builder.mul(pairs, ir.Constant(_I64, 2)), gpr_v)
        with builder.if_then(odd):
            group(builder.sub(gpr_v, ir.Constant(_I64, 1)), accs[0])
        return _hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))

    return sig, codegen


vbit_dot3 = _make_vbit_dot(3)
vbit_dot5 = _make_vbit_dot(5)
vbit_dot6 = _make_vbit_dot(6)
vbit_dot8 = _make_vbit_dot(8)


@intrinsic
def q1_dot(typingctx, data, base, gpr, x, xs):  # noqa: ANN001
    """One q1 row: groups of ``[f16 s][4 B sign bits]`` at data[base:]; returns
    Σ_g s_g·(2·Σ_{bit set} x − xs[g])."""
    sig = types.float32(data, types.int64, types.int64, x, xs)

    def codegen(context, builder, signature, args):
        dp, xp, sp = _pointers(context, builder, signature, args, 0, 3, 4)
        v32 = ir.VectorType(_F32, 32)
        m32 = ir.VectorType(ir.IntType(1), 32)
        zero32 = ir.Constant(v32, [0.0] * 32)
        accv = cgutils.alloca_once_value(builder, zero32)
        accz = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
        with cgutils.for_range(builder, args[2]) as loop:
            g = loop.index
            tile = cgutils.gep(builder, dp, builder.add(args[1], builder.mul(g, ir.Constant(_I64, 6))))
            s = _load_f16(builder, tile)
            bits = builder.load(builder.bitcast(cgutils.gep(builder, tile, ir.Constant(_I64, 2)), _I32.as_pointer()),
                                align=1)
            xv = _vec_load(builder, cgutils.gep(builder, xp, builder.mul(g, ir.Constant(_I64, 32))), v32)
            picked = builder.select(builder.bitcast(bits, m32), xv, zero32)
            sv = _splat(builder, s, v32)
            builder.store(builder.fadd(builder.load(accv), builder.fmul(picked, sv, flags=_FM), flags=_FM), accv)
            builder.store(builder.fadd(builder.load(accz), builder.fmul(s, builder.load(cgutils.gep(builder, sp, g)))),
                          accz)
        two = ir.Constant(_F32, 2.0)
        return builder.fsub(builder.fmul(two, _hsum(builder, builder.load(accv))), builder.load(accz))

    return sig, codegen


def _mulhi16(builder, a, b):  # noqa: ANN001, ANN202
    """(a·b) >> 16 per u16 lane (LLVM selects ``vpmulhuw`` for this pattern)."""
    wide = ir.VectorType(_I32, a.type.count)
    prod = builder.mul(builder.zext(a, wide), builder.zext(b, wide))
    return builder.trunc(builder.lshr(prod, ir.Constant(wide, [16] * a.type.count)), a.type)


@intrinsic
def q1t_dot(typingctx, data, base, gpr, x):  # noqa: ANN001
    """One q1t row's base: groups of ``[f16 s][7 B base-3]`` at data[base:]; Σ_g s·Σ_k t_k·x.

    The 32 digits of a group are decoded in one pass over 32 u16 lanes: a byte shuffle puts
    byte k // 5 of the group in lane k, ``floor(b / 3^j)`` (j = k % 5 > 0) is the high half of
    b·ceil(2^16 / 3^j) (exact for bytes), the digit is that minus 3·floor(that / 3), and digit 2
    means −1 (0 → 0, 1 → +1, as ``TERNARY_LUT``). The per-byte table lookups this replaces ran
    0.6 GB/s a thread."""
    sig = types.float32(data, types.int64, types.int64, x)
    magic = [[1, 21846, 7282, 2428, 810][k % 5] for k in range(32)]
    pick = [1 + k // 5 for k in range(32)]  # bytes 1..7 of the 8 read from the scale's high byte

    def codegen(context, builder, signature, args):
        dp, xp = _pointers(context, builder, signature, args, 0, 3)
        v32 = ir.VectorType(_F32, 32)
        h32 = ir.VectorType(_I16, 32)
        b16 = ir.VectorType(_I8, 16)
        zero32 = ir.Constant(v32, [0.0] * 32)
        accv = cgutils.alloca_once_value(builder, zero32)
        mix = ir.Constant(ir.VectorType(_I32, 32), pick)
        first = ir.Constant(ir.VectorType(ir.IntType(1), 32), [k % 5 == 0 for k in range(32)])
        with cgutils.for_range(builder, args[2]) as loop:
            g = loop.index
            tile = cgutils.gep(builder, dp, builder.add(args[1], builder.mul(g, ir.Constant(_I64, 9))))
            s = _load_f16(builder, tile)
            # the 8 bytes as one i64 splat into 16 bytes: a shuffle of a 16-byte vector becomes one
            # byte permute (from an 8-byte vector LLVM emitted 32 single-byte inserts)
            word = builder.load(builder.bitcast(cgutils.gep(builder, tile, ir.Constant(_I64, 1)), _I64.as_pointer()),
                                align=1)
            raw = builder.bitcast(_splat(builder, word, ir.VectorType(_I64, 2)), b16)
            b = builder.zext(builder.shuffle_vector(raw, ir.Constant(b16, ir.Undefined), mix), h32)
            q = builder.select(first, b, _mulhi16(builder, b, ir.Constant(h32, magic)))  # b // 3^(k % 5)
            third = _mulhi16(builder, q, ir.Constant(h32, [21846] * 32))
            digit = builder.sub(q, builder.mul(third, ir.Constant(h32, [3] * 32)))
            is_neg = builder.icmp_unsigned("==", digit, ir.Constant(h32, [2] * 32))
            t = builder.select(is_neg, ir.Constant(h32, [-1] * 32), digit)
            xv = _vec_load(builder, cgutils.gep(builder, xp, builder.mul(g, ir.Constant(_I64, 32))), v32)
            part = builder.fmul(builder.sitofp(t, v32), xv)
            sv = _splat(builder, s, v32)
            builder.store(builder.fadd(builder.load(accv), builder.fmul(part, sv, flags=_FM), flags=_FM), accv)
        return _hsum(builder, builder.load(accv))

    return sig, codegen


# The u8 × s8 sums: vpdpbusd where the CPU has AVX-512 VNNI (or AVX-VNNI), vpmaddubsw + vpmaddwd
# on AVX2, generic IR elsewhere — the same integer sums on every path (kernels/int_dot.py).
DOT_PATH = int_dot.DOT_PATH
HW_VNNI = DOT_PATH in ("vnni512", "avxvnni")
INT_DOT = DOT_PATH != "portable"  # a hardware integer dot: the integer kernels beat the float ones


def _make_tile_dot_i8(width: int, pieces: int = 1, path: str | None = None):  # noqa: ANN202 - an intrinsic
    """Integer sums of one 64-row tile-group of the 4-bit family against int8 activations.

    The tile-group starts at ``planes[base]`` in the word-interleaved layout: for each word w
    (bytes 4w..4w+3 of a row's group), the 64 rows' words one after another, so 16 rows' words
    are one 64-byte load with one row per 32-bit lane. Each word's codes are split by phase
    (nibble or crumb position) and multiplied with the four matching int8 activations
    ``xv[xoff + 8j + w·P + p]`` of piece j (one packed int32, broadcast) by a u8 × s8 dot into
    the row's i32 sum. With ``pieces`` > 1 (x split into int8 pieces, ``quantize_x``) the loaded
    codes serve every piece, and the piece sums are combined in the integer domain as
    S_0·128² + S_1·128 + S_2 (exact: |S_0| ≤ 15·127·32, so the total stays below 2^30). Writes
    S[0:64]."""
    phases = 2 if width == 16 else 4
    bits = 8 // phases
    field = sum(((1 << bits) - 1) << (8 * j) for j in range(4))
    words = 8  # int32 words of one piece of a group (32 int8)

    @intrinsic
    def tile_dot_i8(typingctx, planes, base, xv, xoff, S):  # noqa: ANN001
        sig = types.void(planes, types.int64, xv, types.int64, S)

        def codegen(context, builder, signature, args):
            pp, xp, sp = _pointers(context, builder, signature, args, 0, 2, 4)
            v16 = ir.VectorType(_I32, 16)
            msk = ir.Constant(v16, [field] * 16)

            def x_at(j: int, w: int, p: int) -> ir.Value:  # piece j's four int8 activations (an i32), word w, phase p
                at = builder.add(args[3], ir.Constant(_I64, words * j + w * phases + p))
                return builder.load(cgutils.gep(builder, xp, at))

            def load_xs() -> list:  # xs[j][k]: piece j's activations for code vector k = w·phases + p
                return [[x_at(j, w, p) for w in range(width // 4) for p in range(phases)] for j in range(pieces)]

            def codes_of(w: int, c: int) -> list:  # word w of rows 16c .. 16c + 15, one vector per phase
                at = builder.add(args[1], ir.Constant(_I64, 256 * w + 64 * c))
                word = _vec_load(builder, cgutils.gep(builder, pp, at), v16)
                return [builder.and_(word if p == 0 else builder.lshr(word, ir.Constant(v16, [bits * p] * 16)), msk)
                        for p in range(phases)]

            def store(c: int, sums: list) -> None:  # block c's S: S_0·2^14 + S_1·2^7 + S_2 (< 2^30 for 4-bit codes)
                total = sums[0]
                for j in range(1, pieces):
                    total = builder.add(builder.shl(total, ir.Constant(v16, [7] * 16)), sums[j])
                dst = builder.bitcast(cgutils.gep(builder, sp, ir.Constant(_I64, 16 * c)), v16.as_pointer())
                builder.store(total, dst, align=4)

            if (path or int_dot.DOT_PATH) == "vnni512":
                # word by word, the 4 row blocks × pieces accumulators interleaved: 4·pieces
                # independent vpdpbusd chains in flight (32 zmm registers hold them). Block by
                # block (the AVX2 order below) leaves pieces chains of 8 dependent vpdpbusd:
                # SmolLM2 q4tp decode 0.80×, prefill 0.79× (benchmarks/ab.py, RESULTS.md).
                acc = [[ir.Constant(v16, [0] * 16)] * 4 for _ in range(pieces)]
                for w in range(width // 4):
                    # this word's broadcast x only (loaded here): all of a tile-group's
                    # 4·pieces·phases broadcasts at once spilled a third of them
                    splat = [[_splat(builder, x_at(j, w, p), v16) for p in range(phases)] for j in range(pieces)]
                    for c in range(4):
                        for p, codes in enumerate(codes_of(w, c)):
                            for j in range(pieces):
                                acc[j][c] = int_dot.vnni512_acc(builder, acc[j][c], codes, splat[j][p])
                for c in range(4):
                    store(c, [acc[j][c] for j in range(pieces)])
            else:  # block by block: a block's code vectors and its piece sums fit AVX2's 16 registers,
                # and its S is stored before the next block (holding every block's piece sums to the
                # end kept 24 ymm live and spilled them). On the 256-bit paths both halves of a block
                # take each broadcast x in turn, and x is loaded again for each block: broadcasts
                # straight from memory, where values kept across blocks were spilled and reloaded
                # (4-bit products 1.04-1.05x on AVX2, ~1.07x on AVX-VNNI; RESULTS.md "Without
                # AVX-512", 2026-12-06 16:00-16:34)
                ymm = (path or int_dot.DOT_PATH) in ("avx2", "avxvnni")
                xs = None if ymm else load_xs()
                for c in range(4):
                    codes = [v for w in range(width // 4) for v in codes_of(w, c)]  # in xs's order
                    store(c, int_dot.group_dots(builder, codes, load_xs() if ymm else xs, path))
            return context.get_dummy_value()

        return sig, codegen

    return tile_dot_i8


tile_dot_i8_nibbles = _make_tile_dot_i8(16)
tile_dot_i8_crumbs = _make_tile_dot_i8(8)
# x in three int8 pieces (x ≈ d·(q0 + q1/128 + q2/128²)): the exact-mode products
tile_dot_i8x3_nibbles = _make_tile_dot_i8(16, 3)
tile_dot_i8x3_crumbs = _make_tile_dot_i8(8, 3)


def _make_quantize_group(phases: int, pieces: int):  # noqa: ANN202 - returns a numba intrinsic
    """x as int8 pieces for one group of 32 features, in the ``tile_dot_i8*`` layout.

    v = x[xoff : xoff + 32]·inv (NaN, from inf·0 in a group holding inf or NaN, becomes 0);
    piece 0 = rint(v), then twice more rint of the residual times 128 (``xprep.quantize_x``). Each
    piece is permuted so that byte w·4P + 4p + k holds feature P·(4w + k) + p, and stored at
    q8[qoff + 32j]; sums[j] = Σ of piece j. One vector pass: the scalar loop it replaces cost
    ~4 µs per 1024 features."""
    perm = [phases * (4 * w + k) + p for w in range(32 // (4 * phases)) for p in range(phases) for k in range(4)]

    @intrinsic
    def quantize_group(typingctx, x, xoff, inv, q8, qoff, sums):  # noqa: ANN001
        sig = types.void(x, types.int64, types.float32, q8, types.int64, sums)

        def codegen(context, builder, signature, args):
            xp, qp, sp = _pointers(context, builder, signature, args, 0, 3, 5)
            v32 = ir.VectorType(_F32, 32)
            i32v = ir.VectorType(_I32, 32)
            i8v = ir.VectorType(_I8, 32)
            rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32]), "llvm.rint.v32f32")
            radd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [i32v]),
                                                  "llvm.vector.reduce.add.v32i32")
            v = builder.fmul(_vec_load(builder, cgutils.gep(builder, xp, args[1]), v32), _splat(builder, args[2], v32))
            v = builder.select(builder.fcmp_unordered("uno", v, v), ir.Constant(v32, [0.0] * 32), v)
            step = ir.Constant(v32, [128.0] * 32)
            mix = ir.Constant(ir.VectorType(_I32, 32), perm)
            rest = v
            for j in range(pieces):
                q = builder.call(rint, [rest])
                if j + 1 < pieces:
                    rest = builder.fmul(builder.fsub(rest, q), step)
                qi = builder.fptosi(q, i32v)
                builder.store(builder.call(radd, [qi]), cgutils.gep(builder, sp, ir.Constant(_I64, j)))
                q8b = builder.shuffle_vector(builder.trunc(qi, i8v), ir.Constant(i8v, ir.Undefined), mix)
                at = builder.add(args[4], ir.Constant(_I64, 32 * j))
                builder.store(q8b, builder.bitcast(cgutils.gep(builder, qp, at), i8v.as_pointer()), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return quantize_group


quantize_group_n1 = _make_quantize_group(2, 1)  # nibble layout, one piece (int8 activations)
quantize_group_n3 = _make_quantize_group(2, 3)  # nibble layout, three pieces (exact mode)
quantize_group_c1 = _make_quantize_group(4, 1)  # crumb layout (q2tp)
quantize_group_c3 = _make_quantize_group(4, 3)
